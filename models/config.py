"""The one model configuration every family is described by, and its checks.

Family modules (`mixtral.py`, `qwen2_moe.py`, `phimoe.py`) build a `MoEConfig` from a Hugging Face
`config.json`; shared layers, the engine and the offload runtime read only this dataclass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal

NormKind = Literal["rms", "layer"]
RouterKind = Literal["softmax_topk", "sparsemixer"]


class UnsupportedConfigError(ValueError):
    """A Hugging Face config asks for something fmoe_jax does not implement."""


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding settings.

    `kind="default"` is plain RoPE. `kind="longrope"` (Phi-3.5) rescales the inverse frequencies by
    `short_factor` while the sequence fits `original_max_position_embeddings` and by `long_factor`
    beyond it, and multiplies cos/sin by `short_mscale` / `long_mscale` accordingly.
    """

    theta: float
    kind: Literal["default", "longrope"] = "default"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float = 1.0
    long_mscale: float = 1.0
    original_max_position_embeddings: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class MoEConfig:
    """Architecture of a decoder-only MoE language model (all three supported families).

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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

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
        if self.rope.kind == "longrope" and len(self.rope.short_factor) != self.head_dim // 2:
            raise ValueError(
                f"longrope short_factor has {len(self.rope.short_factor)} entries, expected head_dim/2 = "
                f"{self.head_dim // 2}"
            )
        if self.rope.kind == "longrope" and len(self.rope.long_factor) != self.head_dim // 2:
            raise ValueError(
                f"longrope long_factor has {len(self.rope.long_factor)} entries, expected head_dim/2 = "
                f"{self.head_dim // 2}"
            )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts (the layers an expert map covers)."""
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rope_from_hf(hf: dict[str, Any], head_dim: int, *, allow_longrope: bool) -> RopeConfig:
    """RoPE settings from transformers-5 `rope_parameters` or the older `rope_theta` / `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
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
    if kind != "default":
        raise UnsupportedConfigError(f"rope type {kind!r} is not implemented (supported: default, longrope)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1.0 is not implemented")
    return RopeConfig(theta=float(theta))


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
    hf: dict[str, Any], family: str, *, default_max_positions: int, allow_longrope: bool = False
) -> dict[str, Any]:
    """The `MoEConfig` fields every family reads from config.json the same way: sizes, attention shape,
    RoPE, position limit, tied embeddings and special token ids."""
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        rope=rope_from_hf(hf, head_dim, allow_longrope=allow_longrope),
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
