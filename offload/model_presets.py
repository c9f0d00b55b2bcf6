"""Model-size presets: `ModelPreset` (the byte and FLOP sizes of a model the cost model needs), one preset per
published model (each from its config.json, cited beside it), `MODELS` by family and `PRESETS` by name.

Read by the cost model (`offload/cost_model.py`, which re-exports every name here), the simulator and the
benchmarks that replay routing at a real model's sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fmoe_jax.models.quant import ExpertQuantization, expert_quantization


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPreset:
    """The sizes of a model that the cost model needs (gated-MLP experts; weights of `bytes_per_param`).

    Only byte and FLOP sizes are read by the simulator: the number of MoE layers, experts and top-k of a
    replay come from the routing trace, so a trace recorded on a small model replays "at real size" with
    these per-layer and per-expert sizes. `num_layers`, `num_experts` and `top_k` describe the real model
    (`num_layers` counts its MoE layers). Attention is grouped-query, or multi-head latent (DeepSeek-V2)
    when `kv_lora_rank > 0`; then `head_dim` is the query/key head (nope + rope part). Hybrid models
    (Qwen3-Next, Qwen3.5-MoE) have `linear_layers` Gated DeltaNet layers among their MoE layers, each with a
    fixed-size recurrent state per sequence read and written at every step (`linear_state_bytes`), and gate
    their softmax attention's output (`attention_output_gate`: q_proj twice as wide). Dense layers
    (DeepSeek's first) count in the parameters and the resident bytes; their time is not modelled (the
    simulator steps through the MoE layers of a trace): 1 of 27 layers in DeepSeek-V2-Lite.

    `expert_quantization` ("int8" / "int4", `quantization_group_size` inputs per scale of
    `bytes_per_param`, as `fmoe_jax.models.quant` stores them) is the routed experts' stored precision:
    `expert_bytes`, what a copy moves and an expert kernel reads, counts their values and scales, e.g.
    `dataclasses.replace(MIXTRAL_8X7B, expert_quantization="int4")`. Everything else keeps `bytes_per_param`.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int  # D
    expert_intermediate_size: int  # F of one routed expert
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    shared_expert_intermediate_size: int = 0  # always-active shared expert(s), summed (0: none)
    shared_expert_gate: bool = True  # Qwen1.5-MoE gates its shared expert (a [D] vector); DeepSeek does not
    tie_word_embeddings: bool = False
    kv_lora_rank: int = 0  # MLA: cached latent per token and layer (0: grouped-query attention)
    q_lora_rank: int = 0  # MLA: query bottleneck (0: queries projected directly)
    qk_rope_head_dim: int = 0  # MLA: rotary part of head_dim, one key shared by every head (cached)
    v_head_dim: int = 0  # MLA: value head size
    dense_layers: int = 0  # layers with a dense MLP instead of experts
    dense_intermediate_size: int = 0
    attention_output_gate: bool = False  # Qwen3-Next: q_proj also yields a gate per query dimension
    linear_layers: int = 0  # MoE layers whose token mixer is Gated DeltaNet instead of softmax attention
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    bytes_per_param: int = 2  # bf16
    expert_quantization: str | None = None  # None: experts in bytes_per_param too; "mxfp4": gpt-oss's
    quantization_group_size: int | None = None  # default 64 when quantized (MXFP4: 32)
    expert_bias: bool = False  # gpt-oss: each expert's gate, up and down biases travel with it

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"model {self.name!r}: {field.name} must be >= 0, got {value}")
        if self.hidden_size <= 0 or self.expert_intermediate_size <= 0:
            raise ValueError(
                f"model {self.name!r}: hidden_size ({self.hidden_size}) and expert_intermediate_size "
                f"({self.expert_intermediate_size}) must be positive"
            )
        if self.linear_layers > self.num_layers or (self.linear_layers and not self.linear_key_head_dim):
            raise ValueError(
                f"model {self.name!r}: linear_layers ({self.linear_layers}) must be at most num_layers "
                f"({self.num_layers}) and have their heads' sizes"
            )
        try:
            q = self.quantization
            if q is not None:
                q.check_model(self.hidden_size, self.expert_intermediate_size)
        except ValueError as err:
            raise ValueError(f"model {self.name!r}: {err}") from None

    @property
    def quantization(self) -> ExpertQuantization | None:
        return expert_quantization(self.expert_quantization, self.quantization_group_size)

    @classmethod
    def from_config(
        cls, cfg: Any, name: str | None = None, *, quantization: ExpertQuantization | None = None
    ) -> ModelPreset:
        """The sizes of a `fmoe_jax.models.MoEConfig` (e.g. `model.config`), in bf16, with the experts
        stored as `quantization` says (e.g. `model.module.expert_quantization`)."""
        return cls(
            name=name or cfg.family,
            num_layers=cfg.num_moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            hidden_size=cfg.hidden_size,
            expert_intermediate_size=cfg.expert_intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            shared_expert_gate=cfg.shared_expert_gate,
            tie_word_embeddings=cfg.tie_word_embeddings,
            kv_lora_rank=cfg.kv_lora_rank,
            q_lora_rank=cfg.q_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            dense_layers=cfg.num_layers - cfg.num_moe_layers,
            dense_intermediate_size=cfg.dense_intermediate_size,
            attention_output_gate=cfg.attention_output_gate,
            **_linear_fields(cfg),
            expert_quantization=None if quantization is None else quantization.kind,
            quantization_group_size=None if quantization is None else quantization.group_size,
            expert_bias=cfg.swiglu_clamp is not None,
        )

    # -- parameter counts (biases and norms are below 0.1 % and left out) -------------------------------
    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size  # gate, up, down

    @property
    def attention_params(self) -> int:
        d, h = self.hidden_size, self.num_heads
        if self.kv_lora_rank:  # MLA: q (or its LoRA), kv down to latent + rope key, kv up per head, o
            r, p, v = self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
            q = (
                d * self.q_lora_rank + self.q_lora_rank * h * self.head_dim
                if self.q_lora_rank
                else d * h * self.head_dim
            )
            return q + d * (r + p) + r * h * (self.head_dim - p + v) + h * v * d
        q_and_o = (3 if self.attention_output_gate else 2) * d * h * self.head_dim
        k_and_v = 2 * d * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer: the q, k, v, z, b, a projections, the convolution and the output."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv = (2 * key_dim + value_dim) * self.linear_conv_kernel
        return (
            self.hidden_size * (2 * key_dim + 2 * value_dim + 2 * self.linear_num_value_heads)
            + conv
            + (value_dim * self.hidden_size)
        )

    @property
    def token_mixer_params(self) -> float:
        """Attention parameters of an MoE layer, averaged over the layer kinds (softmax and linear)."""
        share = self.linear_layers / self.num_layers
        return (1 - share) * self.attention_params + share * self.linear_attention_params

    @property
    def linear_state_bytes(self) -> int:
        """One linear layer's state per sequence: the float32 recurrent state (value heads x key dim x value
        dim) and the convolution's last K-1 inputs."""
        state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
        return state + max(0, self.linear_conv_kernel - 1) * conv_dim * self.bytes_per_param

    @property
    def score_flops(self) -> int:
        """FLOPs per (query, key) pair and layer: QK^T and PV over every head."""
        if self.kv_lora_rank:
            return 2 * self.num_heads * (self.head_dim + self.v_head_dim)
        return 4 * self.num_heads * self.head_dim

    @property
    def shared_params(self) -> int:
        if not self.shared_expert_intermediate_size:
            return 0
        gate = self.hidden_size if self.shared_expert_gate else 0
        return 3 * self.hidden_size * self.shared_expert_intermediate_size + gate

    @property
    def dense_layer_params(self) -> int:
        """Attention plus dense MLP of one dense layer."""
        return self.attention_params + 3 * self.hidden_size * self.dense_intermediate_size

    def launch_arguments(self, num_layers: int, num_experts: int) -> int:
        """About how many arrays the offload engine's step program takes: every routed expert's (a matrix's
        values and scales when quantized, gpt-oss's biases) and a dozen per layer besides."""
        per_expert = 3 * (1 if self.expert_quantization is None else 2) + (3 if self.expert_bias else 0)
        return num_layers * (num_experts * per_expert + 12) + 3

    def router_params(self, num_experts: int) -> int:
        return self.hidden_size * num_experts

    @property
    def total_params(self) -> int:
        """All parameters of the real model (a check of the preset against the published counts)."""
        per_layer = (
            self.token_mixer_params
            + self.router_params(self.num_experts)
            + self.shared_params
            + self.num_experts * self.expert_params
        )
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return round(self.num_layers * per_layer + self.dense_layers * self.dense_layer_params + embeddings)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as stored: what one host-to-device copy moves (quantized: values and
        scales of gate `[F, D]`, up `[F, D]` and down `[D, F]`; MXFP4: 4.25 bits per weight), plus its
        biases when it has them."""
        q = self.quantization
        d, f, size = self.hidden_size, self.expert_intermediate_size, self.bytes_per_param
        biases = (2 * f + d) * size if self.expert_bias else 0
        if q is None:
            return self.expert_params * self.bytes_per_param + biases
        return 2 * q.matrix_bytes(f, d, size) + q.matrix_bytes(d, f, size) + biases

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token in one layer (MLA: the latent and the shared rope key)."""
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.bytes_per_param
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def resident_bytes(self, num_layers: int, num_experts: int) -> int:
        """Weights that stay on the device whatever the policy: attention, routers, shared experts, dense
        layers, embedding and LM head, for `num_layers` MoE layers of `num_experts` experts."""
        per_layer = self.token_mixer_params + self.router_params(num_experts) + self.shared_params
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        dense = self.dense_layers * self.dense_layer_params
        return round((num_layers * per_layer + dense + embeddings) * self.bytes_per_param)


# Sizes from each model's published Hugging Face `config.json`.
# mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
# num_attention_heads 32, num_key_value_heads 8 (head_dim 128), num_local_experts 8, num_experts_per_tok 2,
# vocab_size 32000, tie_word_embeddings false. 46.7 B parameters (model card).
MIXTRAL_8X7B = ModelPreset(
    "Mixtral-8x7B",
    num_layers=32,
    num_experts=8,
    top_k=2,
    hidden_size=4096,
    expert_intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=32000,
)
# Qwen/Qwen1.5-MoE-A2.7B: hidden_size 2048, moe_intermediate_size 1408, shared_expert_intermediate_size 5632,
# num_hidden_layers 24 (decoder_sparse_step 1, no mlp_only_layers), num_attention_heads 16,
# num_key_value_heads 16 (head_dim 128), num_experts 60, num_experts_per_tok 4, vocab_size 151936,
# tie_word_embeddings false. 14.3 B parameters (model card).
QWEN15_MOE_A27B = ModelPreset(
    "Qwen1.5-MoE-A2.7B",
    num_layers=24,
    num_experts=60,
    top_k=4,
    hidden_size=2048,
    expert_intermediate_size=1408,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    vocab_size=151936,
    shared_expert_intermediate_size=5632,
)
# microsoft/Phi-3.5-MoE-instruct: hidden_size 4096, intermediate_size 6400, num_hidden_layers 32,
# num_attention_heads 32, num_key_value_heads 8 (head_dim 128), num_local_experts 16, num_experts_per_tok 2,
# vocab_size 32064, tie_word_embeddings false. 41.9 B parameters (model card).
PHI35_MOE = ModelPreset(
    "Phi-3.5-MoE",
    num_layers=32,
    num_experts=16,
    top_k=2,
    hidden_size=4096,
    expert_intermediate_size=6400,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=32064,
)

# Qwen/Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768, num_hidden_layers 48 (decoder_sparse_step
# 1, no mlp_only_layers), num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
# num_experts_per_tok 8, vocab_size 151936, tie_word_embeddings false. 30.5 B parameters (model card).
QWEN3_30B_A3B = ModelPreset(
    "Qwen3-30B-A3B",
    num_layers=48,
    num_experts=128,
    top_k=8,
    hidden_size=2048,
    expert_intermediate_size=768,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
)
# allenai/OLMoE-1B-7B-0924: hidden_size 2048, intermediate_size 1024 (per expert), num_hidden_layers 16,
# num_attention_heads 16, num_key_value_heads 16 (head_dim 128), num_experts 64, num_experts_per_tok 8,
# vocab_size 50304, tie_word_embeddings false. 6.9 B parameters (model card: 7 B total, 1 B active).
OLMOE_1B_7B = ModelPreset(
    "OLMoE-1B-7B",
    num_layers=16,
    num_experts=64,
    top_k=8,
    hidden_size=2048,
    expert_intermediate_size=1024,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    vocab_size=50304,
)
# deepseek-ai/DeepSeek-V2-Lite: hidden_size 2048, num_hidden_layers 27 with first_k_dense_replace 1 (dense
# intermediate_size 10944), moe_intermediate_size 1408, n_routed_experts 64, n_shared_experts 2,
# num_experts_per_tok 6, num_attention_heads 16, kv_lora_rank 512, q_lora_rank null, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128, vocab_size 102400, tie_word_embeddings false. 15.7 B parameters
# (model card: 15.7 B total, 2.4 B active).
DEEPSEEK_V2_LITE = ModelPreset(
    "DeepSeek-V2-Lite",
    num_layers=26,
    num_experts=64,
    top_k=6,
    hidden_size=2048,
    expert_intermediate_size=1408,
    num_heads=16,
    num_kv_heads=16,
    head_dim=192,
    vocab_size=102400,
    shared_expert_intermediate_size=2 * 1408,
    shared_expert_gate=False,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    v_head_dim=128,
    dense_layers=1,
    dense_intermediate_size=10944,
)

# The models people offload to one small GPU today (issue 55). Experts at the precision fmoe_jax stores them:
# gpt-oss's MXFP4 as published (4.25 bits per weight, with their bf16 biases); DeepSeek-V3's and Kimi-K2's
# FP8 is dequantized to bf16 by fmoe-convert (`dataclasses.replace(DEEPSEEK_V3, expert_quantization="int4")`
# for `--expert-quantization int4`). `num_layers` counts MoE layers only; dense first layers are
# `dense_layers`.
# openai/gpt-oss-20b config.json: hidden_size 2880, intermediate_size 2880, num_hidden_layers 24 (all MoE),
# num_local_experts 32, num_experts_per_tok 4, num_attention_heads 64, num_key_value_heads 8, head_dim 64,
# vocab_size 201088, tie_word_embeddings false, quantization_config mxfp4. 20.9 B parameters (model card).
GPT_OSS_20B = ModelPreset(
    "gpt-oss-20b",
    num_layers=24,
    num_experts=32,
    top_k=4,
    hidden_size=2880,
    expert_intermediate_size=2880,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=201088,
    expert_quantization="mxfp4",
    expert_bias=True,
)
# openai/gpt-oss-120b config.json: as gpt-oss-20b but num_hidden_layers 36 and num_local_experts 128.
# 116.8 B parameters (model card).
GPT_OSS_120B = dataclasses.replace(GPT_OSS_20B, name="gpt-oss-120b", num_layers=36, num_experts=128)
# deepseek-ai/DeepSeek-V3 config.json (inference/configs/config_671B.json alike): hidden_size 7168,
# num_hidden_layers 61 with first_k_dense_replace 3 (dense intermediate_size 18432), moe_intermediate_size
# 2048, n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8 (n_group 8, topk_group 4),
# num_attention_heads 128, kv_lora_rank 512, q_lora_rank 1536, qk_nope_head_dim 128, qk_rope_head_dim 64,
# v_head_dim 128, vocab_size 129280, tie_word_embeddings false. 671 B parameters without the multi-token-
# prediction module (model card). DeepSeek-R1 and V3.1 share these sizes.
DEEPSEEK_V3 = ModelPreset(
    "DeepSeek-V3",
    num_layers=58,
    num_experts=256,
    top_k=8,
    hidden_size=7168,
    expert_intermediate_size=2048,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,
    vocab_size=129280,
    shared_expert_intermediate_size=2048,
    shared_expert_gate=False,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    dense_layers=3,
    dense_intermediate_size=18432,
)
# moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, DeepSeek-V3's architecture): hidden_size 7168,
# num_hidden_layers 61 with first_k_dense_replace 1, moe_intermediate_size 2048, n_routed_experts 384,
# n_shared_experts 1, num_experts_per_tok 8, num_attention_heads 64, the same latent attention, vocab_size
# 163840. 1.04 T parameters (model card: 1 T total, 32 B activated).
KIMI_K2 = dataclasses.replace(
    DEEPSEEK_V3,
    name="Kimi-K2",
    num_layers=60,
    num_experts=384,
    num_heads=64,
    num_kv_heads=64,
    vocab_size=163840,
    dense_layers=1,
)
# zai-org/GLM-4.5-Air config.json: hidden_size 4096, num_hidden_layers 46 with first_k_dense_replace 1 (dense
# intermediate_size 10944), moe_intermediate_size 1408, n_routed_experts 128, n_shared_experts 1,
# num_experts_per_tok 8, num_attention_heads 96, num_key_value_heads 8, head_dim 128, vocab_size 151552,
# tie_word_embeddings false (q/k/v biases and RoPE on half of each head are below 0.1 % of the bytes).
# 106 B parameters (model card).
GLM_45_AIR = ModelPreset(
    "GLM-4.5-Air",
    num_layers=45,
    num_experts=128,
    top_k=8,
    hidden_size=4096,
    expert_intermediate_size=1408,
    num_heads=96,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151552,
    shared_expert_intermediate_size=1408,
    shared_expert_gate=False,
    dense_layers=1,
    dense_intermediate_size=10944,
)
# zai-org/GLM-4.5 config.json: hidden_size 5120, num_hidden_layers 92 with first_k_dense_replace 3 (dense
# intermediate_size 12288), moe_intermediate_size 1536, n_routed_experts 160, n_shared_experts 1,
# num_experts_per_tok 8, num_attention_heads 96, num_key_value_heads 8, head_dim 128, vocab_size 151552.
# 355 B parameters (model card; GLM-4.6 shares these sizes).
GLM_45 = dataclasses.replace(
    GLM_45_AIR,
    name="GLM-4.5",
    num_layers=89,
    num_experts=160,
    hidden_size=5120,
    expert_intermediate_size=1536,
    shared_expert_intermediate_size=1536,
    dense_layers=3,
    dense_intermediate_size=12288,
)
# Qwen/Qwen3-Next-80B-A3B: hidden_size 2048, num_hidden_layers 48 (every 4th full attention, the rest Gated
# DeltaNet), num_attention_heads 16, num_key_value_heads 2, head_dim 256 (RoPE on a quarter, output gate),
# linear_num_key_heads 16, linear_num_value_heads 32, linear key/value head dims 128, linear_conv_kernel_dim
# 4, num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512, shared_expert_intermediate_size 512
# (gated), vocab_size 151936, tie_word_embeddings false: transformers 5.23's Qwen3NextConfig defaults, which
# describe this checkpoint (its docstring), and THUDM/slime scripts/models/qwen3-next-80B-A3B.sh. 80 B
# parameters (model card: 80 B total, 3 B activated); its multi-token prediction layer is left out.
QWEN3_NEXT_80B_A3B = ModelPreset(
    "Qwen3-Next-80B-A3B",
    num_layers=48,
    num_experts=512,
    top_k=10,
    hidden_size=2048,
    expert_intermediate_size=512,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    vocab_size=151936,
    shared_expert_intermediate_size=512,
    attention_output_gate=True,
    linear_layers=36,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
)
# Qwen/Qwen3.5-35B-A3B (text model): hidden_size 2048, num_hidden_layers 40 (full_attention_interval 4),
# num_attention_heads 16, num_key_value_heads 2, head_dim 256, linear heads 16 key / 32 value of 128, conv 4,
# num_experts 256, num_experts_per_tok 8, moe_intermediate_size 512, shared_expert_intermediate_size 512,
# vocab_size 248320, tie_word_embeddings false (THUDM/slime scripts/models/qwen3.5-35B-A3B.sh; transformers
# 5.23's Qwen3_5MoeTextConfig defaults). 34.7 B parameters here; the model card's 35 B counts the vision
# tower.
QWEN35_35B_A3B = ModelPreset(
    "Qwen3.5-35B-A3B",
    num_layers=40,
    num_experts=256,
    top_k=8,
    hidden_size=2048,
    expert_intermediate_size=512,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    vocab_size=248320,
    shared_expert_intermediate_size=512,
    attention_output_gate=True,
    linear_layers=30,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
)
# Qwen/Qwen3.5-122B-A10B (text model): hidden_size 3072, num_hidden_layers 48 (12 full attention),
# num_attention_heads 32, num_key_value_heads 2, head_dim 256, linear heads 16 key / 64 value of 128, conv 4,
# num_experts 256, num_experts_per_tok 8, moe_intermediate_size 1024, shared_expert_intermediate_size 1024,
# vocab_size 248320 (its config.json as transcribed in public test configs, and apxml.com/models/
# qwen35-122b-a10b for the attention and expert sizes). 122 B parameters (model card).
QWEN35_122B_A10B = ModelPreset(
    "Qwen3.5-122B-A10B",
    num_layers=48,
    num_experts=256,
    top_k=8,
    hidden_size=3072,
    expert_intermediate_size=1024,
    num_heads=32,
    num_kv_heads=2,
    head_dim=256,
    vocab_size=248320,
    shared_expert_intermediate_size=1024,
    attention_output_gate=True,
    linear_layers=36,
    linear_num_key_heads=16,
    linear_num_value_heads=64,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
)

MODELS: dict[str, ModelPreset] = {
    "mixtral": MIXTRAL_8X7B,
    "qwen2_moe": QWEN15_MOE_A27B,
    "phimoe": PHI35_MOE,
    "qwen3_moe": QWEN3_30B_A3B,
    "olmoe": OLMOE_1B_7B,
    "deepseek_v2": DEEPSEEK_V2_LITE,
    "gpt_oss": GPT_OSS_20B,
    "deepseek_v3": DEEPSEEK_V3,
    "glm4_moe": GLM_45_AIR,
    "qwen3_next": QWEN3_NEXT_80B_A3B,
    "qwen3_5_moe": QWEN35_35B_A3B,
}  # by model family, as `RoutingTrace.meta["family"]` names it
# Every preset by its model's name (the families above have several sizes).
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        MIXTRAL_8X7B,
        QWEN15_MOE_A27B,
        PHI35_MOE,
        QWEN3_30B_A3B,
        OLMOE_1B_7B,
        DEEPSEEK_V2_LITE,
        GPT_OSS_20B,
        GPT_OSS_120B,
        DEEPSEEK_V3,
        KIMI_K2,
        GLM_45_AIR,
        GLM_45,
        QWEN3_NEXT_80B_A3B,
        QWEN35_35B_A3B,
        QWEN35_122B_A10B,
    )
}


def _linear_fields(cfg: Any) -> dict[str, Any]:
    """`ModelPreset`'s linear-attention fields from a `MoEConfig` (none for a model without linear layers)."""
    la = cfg.linear_attention
    if la is None:
        return {}
    return dict(
        linear_layers=sum(la.layers[i] for i in cfg.moe_layer_ids),
        linear_num_key_heads=la.num_key_heads,
        linear_num_value_heads=la.num_value_heads,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel=la.conv_kernel,
    )
