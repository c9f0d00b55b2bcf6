"""The simulator's cost model: model-size presets (`ModelPreset`, `MODELS`) and a roofline time per stage
(`CostModel`) on a hardware preset (`offload/hardware.py`, whose names are re-exported here).

Read by `offload/simulator.py` (which advances its simulated clock by these times) and by benchmarks that
project a routing trace onto real hardware and real model sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from fmoe_jax.models.quant import ExpertQuantization, expert_quantization

from .hardware import (  # noqa: F401  (re-exported: the presets' old home)
    A100_SXM,
    DESKTOP_DDR4,
    DESKTOP_DDR5,
    H100_PCIE,
    H100_SXM,
    H200_SXM,
    HARDWARE,
    HOPPER_DECODE,
    HOSTS,
    JAX_COPY_LATENCY_S,
    PCIE4_EFFICIENCY,
    PCIE4_X16,
    PCIE5_EFFICIENCY,
    PCIE5_X16,
    PIECE_MIN_LATENCIES,
    RTX_3090,
    SERVER_8CH,
    SERVER_12CH,
    GiB,
    HardwarePreset,
    HostPreset,
)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPreset:
    """The sizes of a model that the cost model needs (gated-MLP experts; weights of `bytes_per_param`).

    Only byte and FLOP sizes are read by the simulator: the number of MoE layers, experts and top-k of a
    replay come from the routing trace, so a trace recorded on a small model replays "at real size" with
    these per-layer and per-expert sizes. `num_layers`, `num_experts` and `top_k` describe the real model
    (`num_layers` counts its MoE layers). Attention is grouped-query, or multi-head latent (DeepSeek-V2)
    when `kv_lora_rank > 0`; then `head_dim` is the query/key head (nope + rope part). Dense layers
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
    bytes_per_param: int = 2  # bf16
    expert_quantization: str | None = None  # None: experts in bytes_per_param too
    quantization_group_size: int | None = None  # default 64 when quantized

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
            expert_quantization=None if quantization is None else quantization.kind,
            quantization_group_size=None if quantization is None else quantization.group_size,
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
        q_and_o = 2 * d * h * self.head_dim
        k_and_v = 2 * d * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v

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

    def router_params(self, num_experts: int) -> int:
        return self.hidden_size * num_experts

    @property
    def total_params(self) -> int:
        """All parameters of the real model (a check of the preset against the published counts)."""
        per_layer = (
            self.attention_params
            + self.router_params(self.num_experts)
            + self.shared_params
            + self.num_experts * self.expert_params
        )
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + self.dense_layers * self.dense_layer_params + embeddings

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as stored: what one host-to-device copy moves (quantized: values and
        scales of gate `[F, D]`, up `[F, D]` and down `[D, F]`)."""
        q = self.quantization
        if q is None:
            return self.expert_params * self.bytes_per_param
        d, f, size = self.hidden_size, self.expert_intermediate_size, self.bytes_per_param
        return 2 * q.matrix_bytes(f, d, size) + q.matrix_bytes(d, f, size)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token in one layer (MLA: the latent and the shared rope key)."""
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.bytes_per_param
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def resident_bytes(self, num_layers: int, num_experts: int) -> int:
        """Weights that stay on the device whatever the policy: attention, routers, shared experts, dense
        layers, embedding and LM head, for `num_layers` MoE layers of `num_experts` experts."""
        per_layer = self.attention_params + self.router_params(num_experts) + self.shared_params
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        dense = self.dense_layers * self.dense_layer_params
        return (num_layers * per_layer + dense + embeddings) * self.bytes_per_param


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

MODELS: dict[str, ModelPreset] = {
    "mixtral": MIXTRAL_8X7B,
    "qwen2_moe": QWEN15_MOE_A27B,
    "phimoe": PHI35_MOE,
    "qwen3_moe": QWEN3_30B_A3B,
    "olmoe": OLMOE_1B_7B,
    "deepseek_v2": DEEPSEEK_V2_LITE,
}  # by model family, as `RoutingTrace.meta["family"]` names it


class CostModel:
    """Roofline seconds of each stage of an iteration, for a model preset on a hardware preset.

    Compute counts valid tokens only (no padding). Per MoE layer: the attention block with the router
    (weights + each row's KV cache read from device memory; projections and scores as FLOPs), then the
    routed experts (one grouped kernel per chunk: every cached expert's weights read once, 2 * 3 * D * F
    FLOPs per token routed to it), then the shared expert. Per iteration: the LM head for each active row's
    last token. Decode is thereby memory-bound and prefill compute-bound where the FLOPs dominate.
    """

    def __init__(self, model: ModelPreset, hardware: HardwarePreset, num_experts: int):
        self.model = model
        self.hardware = hardware
        self.num_experts = num_experts
        bp = model.bytes_per_param
        self._attention_params = model.attention_params + model.router_params(num_experts)
        self._attention_bytes = self._attention_params * bp
        self._score_flops = model.score_flops  # QK^T and PV per (query, key) pair

    def attention_s(self, new_tokens: np.ndarray, past_tokens: np.ndarray) -> float:
        """One layer's attention and router: `new_tokens` `[R]` tokens per active row, `past_tokens` `[R]`
        tokens each row already has in its KV cache."""
        m = self.model
        new = np.asarray(new_tokens, np.float64)
        past = np.asarray(past_tokens, np.float64)
        keys = float(np.sum(new * past + new * (new + 1) / 2))  # causal: query j sees past + j + 1 keys
        bytes_read = self._attention_bytes + float(np.sum(past + new)) * m.kv_bytes_per_token
        flops = 2 * float(new.sum()) * self._attention_params + self._score_flops * keys
        return self.hardware.attention_kernel_s + self.hardware.roofline_s(bytes_read, flops)

    def experts_s(self, tokens_per_expert: list[int]) -> float:
        """One chunk of routed experts, each with the given number of tokens routed to it."""
        m = self.model
        bytes_read = len(tokens_per_expert) * m.expert_bytes
        flops = 2.0 * m.expert_params * sum(tokens_per_expert)
        fixed = len(tokens_per_expert) * self.hardware.expert_kernel_s
        return fixed + self.hardware.roofline_s(bytes_read, flops)

    def expert_s(self, tokens: int) -> float:
        """One routed expert with `tokens` tokens (`experts_s` of one): the hybrid planner's `DeviceCost`."""
        return self.experts_s([tokens])

    def shared_s(self, tokens: int) -> float:
        """One layer's always-active shared expert (zero for models without one)."""
        m = self.model
        if not m.shared_params:
            return 0.0
        return self.hardware.expert_kernel_s + self.hardware.roofline_s(
            m.shared_params * m.bytes_per_param, 2.0 * m.shared_params * tokens
        )

    def head_s(self, rows: int) -> float:
        """The LM head for `rows` last tokens."""
        m = self.model
        params = m.vocab_size * m.hidden_size
        return self.hardware.roofline_s(params * m.bytes_per_param, 2.0 * params * rows)
