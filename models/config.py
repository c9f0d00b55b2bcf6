"""The one model configuration every family is described by, and its checks.

Family modules (`mixtral.py`, `qwen2_moe.py`, `phimoe.py`, `qwen3_moe.py`, `olmoe.py`, `deepseek_v2.py`,
`deepseek_v3.py`, `glm4_moe.py`, `gpt_oss.py`, `qwen3_next.py`) build a `MoEConfig` from a Hugging Face
`config.json`; shared layers, the engine and the offload runtime read only this dataclass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Literal

# "rms_zero_centered": RMSNorm whose stored weight w scales by 1 + w (Qwen3-Next, Qwen3.5), in float32.
NormKind = Literal["rms", "layer", "rms_zero_centered"]
# "topk_softmax": softmax over the top-k logits (gpt-oss); "sigmoid_grouped": DeepSeek-V3's sigmoid scores,
# chosen with a correction bias within the best groups (DeepSeek-V3, Kimi-K2, GLM-4.5).
RouterKind = Literal["softmax_topk", "sparsemixer", "deepseek", "topk_softmax", "sigmoid_grouped"]
QKNorm = Literal["none", "head", "full"]
TopkMethod = Literal["greedy", "group_limited_greedy"]


class UnsupportedConfigError(ValueError):
    """A Hugging Face config asks for something fmoe_jax does not implement."""


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding settings.

    `kind="default"` is plain RoPE. `kind="longrope"` (Phi-3.5) rescales the inverse frequencies by
    `short_factor` while the sequence fits `original_max_position_embeddings` and by `long_factor`
    beyond it, and multiplies cos/sin by `short_mscale` / `long_mscale` accordingly. `kind="yarn"`
    (DeepSeek-V2) blends interpolated (`/ factor`) and original frequencies over a ramp between the
    dimensions that turn `beta_fast` and `beta_slow` times in `original_max_position_embeddings`, and
    multiplies cos/sin by `attention_factor`; it is static (the same at every length).
    """

    theta: float
    kind: Literal["default", "longrope", "yarn"] = "default"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float = 1.0
    long_mscale: float = 1.0
    original_max_position_embeddings: int = 0
    factor: float = 1.0  # yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: cos/sin scale
    mscale_all_dim: float = 0.0  # yarn: DeepSeek's attention softmax scale uses it (`yarn_mscale`)
    truncate: bool = True  # yarn: round the ramp's ends outwards to whole dimensions
    partial_rotary_factor: float = 1.0  # share of each head's dimensions rotated (GLM-4.5: the first half)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5-MoE; `models/gated_deltanet.py`).

    `layers[i]` is True where layer i mixes tokens by the gated delta rule (a recurrent state per head of
    `key_head_dim x value_head_dim` and a causal convolution of `conv_kernel` taps) instead of softmax
    attention. Queries and keys have `num_key_heads` heads, values `num_value_heads` (a multiple: each key
    head serves that many value heads in turn). `fused_projections`: Qwen3-Next projects q, k, v and the
    output gate z in one matrix interleaved per key head (`in_proj_qkvz`) and b, a in another (`in_proj_ba`);
    Qwen3.5 in four plain ones.
    """

    layers: tuple[bool, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool = False

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"linear attention: {name} must be positive, got {getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of linear_num_key_heads "
                f"({self.num_key_heads})"
            )

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True, slots=True)
class MoEConfig:
    """Architecture of a decoder-only MoE language model (every supported family).

    Attributes whose names follow the public API (`family`, `num_layers`, `num_experts`, `top_k`,
    `hidden_size`, `vocab_size`) are stable; the rest describe the math of each block.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    rope: RopeConfig
    max_position_embeddings: int
    norm: NormKind = "rms"
    norm_eps: float = 1e-6
    router: RouterKind = "softmax_topk"
    norm_topk_prob: bool = True
    router_jitter_noise: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    lm_head_bias: bool = False
    tie_word_embeddings: bool = False
    # Per layer: None for full attention, or the window length (keys with q_pos - k_pos >= window masked).
    sliding_windows: tuple[int | None, ...] = ()
    # Per layer: True where the MLP is a routed MoE block, False for a dense MLP (Qwen's mlp_only_layers).
    moe_layers: tuple[bool, ...] = ()
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen1.5-MoE scales its shared expert by sigmoid(x W), DeepSeek not
    # RMSNorm on queries and keys before RoPE: over each head's `head_dim` (Qwen3) or over the whole q / k
    # projection (OLMoE).
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv] after projection
    # Multi-head latent attention (DeepSeek-V2) when kv_lora_rank > 0: keys and values are decompressed from
    # a cached latent of kv_lora_rank plus one shared rotary key of qk_rope_head_dim; queries are projected
    # directly (q_lora_rank 0) or through a rank-q_lora_rank bottleneck. head_dim is then nope + rope.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek routing: experts in n_group groups, only the topk_group best groups (by their best expert)
    # eligible under "group_limited_greedy"; weights times routed_scaling_factor unless renormalised.
    topk_method: TopkMethod = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V2 computes the router's matmul in float32 (input and weight cast up); the others in the
    # model's dtype. Only bfloat16 / float16 models see the difference.
    router_matmul_float32: bool = False
    # Hybrid models: the Gated DeltaNet layers (None: every layer is softmax attention).
    linear_attention: LinearAttentionConfig | None = None
    # Qwen3-Next: q_proj also yields a gate per query dimension; attention's output is scaled by its sigmoid.
    attention_output_gate: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # gpt-oss: a learned logit per head that joins every softmax over keys (`attention_sinks`), a bias on the
    # router's logits, and experts with biases and the clamped SwiGLU `swiglu_alpha` / `swiglu_limit`
    # (`models/moe.py`'s `ClampedSwiGLU`; None: plain SwiGLU, no biases).
    attention_sinks: bool = False
    router_bias: bool = False
    swiglu_clamp: tuple[float, float] | None = None  # (swiglu_alpha, swiglu_limit)
    # DeepSeek-V3 / GLM-4.5: a float32 bias added to the sigmoid scores to choose experts, not to weight them.
    score_correction_bias: bool = False
    # MLA only: DeepSeek rotates adjacent pairs of the rotary dimensions (True) or halves (False).
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "expert_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.router == "sparsemixer" and self.top_k != 2:
            raise UnsupportedConfigError(
                f"sparsemixer routing is defined for top-2 only, got top_k={self.top_k}"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not all(self.moe_layers) and self.dense_intermediate_size <= 0:
            raise ValueError("dense layers need dense_intermediate_size > 0")
        self._check_attention()
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(
                f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts hold "
                f"fewer than top_k={self.top_k} experts"
            )

    def _check_attention(self) -> None:
        """Attention and positions (RoPE tables, latent attention, linear layers), and routing groups."""
        if self.rope.kind == "longrope" and len(self.rope.short_factor) != self.rope_dim // 2:
            raise ValueError(
                f"longrope short_factor has {len(self.rope.short_factor)} entries, expected head_dim/2 = "
                f"{self.rope_dim // 2}"
            )
        if self.rope.kind == "longrope" and len(self.rope.long_factor) != self.rope_dim // 2:
            raise ValueError(
                f"longrope long_factor has {len(self.rope.long_factor)} entries, expected head_dim/2 = "
                f"{self.rope_dim // 2}"
            )
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"clip_qkv must be positive or None, got {self.clip_qkv}")
        if self.is_mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"latent attention needs {name} > 0, got {getattr(self, name)}")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(
                    f"MLA head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                    f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})"
                )
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.linear_attention is not None and len(self.linear_attention.layers) != self.num_layers:
            raise ValueError(
                f"linear attention names {len(self.linear_attention.layers)} layers of {self.num_layers}"
            )
        if not self.is_mla and (self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim):
            raise ValueError(
                f"partial_rotary_factor {self.rope.partial_rotary_factor} of head_dim {self.head_dim} "
                f"rotates {self.rope_dim} dimensions; it must be a positive even number up to head_dim"
            )
        if self.router == "sigmoid_grouped" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(
                f"sigmoid_grouped routing ranks groups by their two best experts; {self.num_experts} experts "
                f"in n_group={self.n_group} groups leaves fewer than two per group"
            )

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions per head that RoPE rotates: `head_dim` times `partial_rotary_factor` (all of it but in
        GLM-4.5), or MLA's `qk_rope_head_dim`."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.rope.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is a Gated DeltaNet (linear attention) layer."""
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts (the layers an expert map covers)."""
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rope_from_hf(
    hf: dict[str, Any],
    head_dim: int,
    *,
    allow_longrope: bool = False,
    allow_yarn: bool = False,
    partial_rotary_factor: float | None = None,
) -> RopeConfig:
    """RoPE settings from transformers-5 `rope_parameters` or the older `rope_theta` / `rope_scaling`.

    `partial_rotary_factor`: for a family that rotates part of each head, its default when config.json does
    not say (GLM-4.5: 0.5); None for the others, which refuse any factor but 1."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if partial_rotary_factor is not None:
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", partial_rotary_factor))
        if kind != "default":
            raise UnsupportedConfigError(
                f"rope type {kind!r} with a partial rotary factor is not implemented"
            )
        return RopeConfig(theta=float(theta), partial_rotary_factor=float(partial))
    if kind in ("su", "longrope"):
        if not allow_longrope:
            raise UnsupportedConfigError(f"rope type {kind!r} is only implemented for phimoe")
        original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        if original is None:
            raise UnsupportedConfigError("longrope needs original_max_position_embeddings in config.json")
        for key in ("factor", "attention_factor"):
            if params.get(key) is not None:
                raise UnsupportedConfigError(
                    f"rope_scaling.{key} is not implemented for longrope (Phi-3.5 uses short/long_mscale)"
                )
        return RopeConfig(
            theta=float(theta),
            kind="longrope",
            short_factor=tuple(float(x) for x in params["short_factor"]),
            long_factor=tuple(float(x) for x in params["long_factor"]),
            short_mscale=float(params.get("short_mscale", 1.0)),
            long_mscale=float(params.get("long_mscale", 1.0)),
            original_max_position_embeddings=int(original),
        )
    if kind == "yarn":
        if not allow_yarn:
            raise UnsupportedConfigError(
                "rope type 'yarn' is only implemented for deepseek_v2, deepseek_v3 and gpt_oss"
            )
        return _yarn_from_hf(hf, params, float(theta))
    if kind != "default":
        raise UnsupportedConfigError(
            f"rope type {kind!r} is not implemented (supported: default, longrope for phimoe, yarn for "
            "deepseek_v2, deepseek_v3 and gpt_oss)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1.0 is not implemented")
    return RopeConfig(theta=float(theta))


YARN_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    }
)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_from_hf(hf: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """YaRN as transformers 5.23 and the DeepSeek-V2 code define it (defaults included)."""
    unknown = sorted(set(params) - YARN_KEYS)
    if unknown:
        raise UnsupportedConfigError(f"rope_scaling keys {unknown} are not implemented for yarn")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedConfigError(
            "yarn needs rope_scaling.original_max_position_embeddings in config.json"
        )
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        original_max_position_embeddings=int(original),
        factor=float(factor),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor),
        mscale_all_dim=float(mscale_all_dim or 0.0),
        truncate=bool(params.get("truncate", True)),
    )


def refuse_unsupported(hf: dict[str, Any], checks: dict[str, Any], family: str) -> None:
    """Raises `UnsupportedConfigError` naming every HF attribute whose value changes math we do not implement.

    `checks` maps an attribute name to the only value(s) we accept (a tuple means any of them); a missing
    attribute is fine.
    """
    bad = []
    for name, allowed in checks.items():
        if name not in hf:
            continue
        allowed_values = allowed if isinstance(allowed, tuple) else (allowed,)
        if hf[name] not in allowed_values:
            bad.append(f"{name}={hf[name]!r} (supported: {', '.join(repr(a) for a in allowed_values)})")
    if bad:
        raise UnsupportedConfigError(
            f"{family}: config.json asks for unimplemented behaviour: {'; '.join(bad)}"
        )


def common_fields(
    hf: dict[str, Any],
    family: str,
    *,
    default_max_positions: int,
    allow_longrope: bool = False,
    allow_yarn: bool = False,
    partial_rotary_factor: float | None = None,
) -> dict[str, Any]:
    """The `MoEConfig` fields every family reads from config.json the same way: sizes, attention shape,
    RoPE (`rope_from_hf`'s options), position limit, tied embeddings and special token ids."""
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = rope_from_hf(
        hf,
        head_dim,
        allow_longrope=allow_longrope,
        allow_yarn=allow_yarn,
        partial_rotary_factor=partial_rotary_factor,
    )
    return dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        rope=rope,
        max_position_embeddings=hf.get("max_position_embeddings", default_max_positions),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_identity(cfg: MoEConfig) -> str:
    """Names a model architecture for state saved about it (an fMoE store, a trained predictor, a routing
    trace): the family plus a hash of the config."""
    digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    return f"{cfg.family}-{digest[:16]}"
