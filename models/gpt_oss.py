"""gpt-oss (`model_type: gpt_oss`: gpt-oss-20b, gpt-oss-120b): grouped-query attention with q/k/v/o biases and
learned per-head sinks, layers alternating sliding-window and full attention as `layer_types` says, YaRN RoPE;
a router with a bias whose top-k logits are softmaxed; experts with biases and a clamped SwiGLU
(`swiglu_alpha`, `swiglu_limit`, the `(up + 1)` term: `models/moe.py`'s `ClampedSwiGLU`). Its checkpoints
store the experts in MXFP4 (`models/mxfp4.py`), which fmoe_jax keeps. Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, UnsupportedConfigError, common_fields
from .moe import Routing

LAYER_TYPES = {"sliding_attention", "full_attention"}


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]  # transformers' default: sliding first, then alternating
    unknown = sorted(set(types) - LAYER_TYPES)
    if unknown or len(types) != layers:
        raise UnsupportedConfigError(
            f"gpt_oss: layer_types must name {layers} layers, each one of {sorted(LAYER_TYPES)}; got "
            f"{len(types)} entries{f', unknown {unknown}' if unknown else ''}"
        )
    window = hf.get("sliding_window") or 128
    bias = bool(hf.get("attention_bias", True))
    return MoEConfig(
        **common_fields(hf, "gpt_oss", default_max_positions=131072, allow_yarn=True),
        num_experts=hf["num_local_experts"],
        top_k=hf.get("num_experts_per_tok") or hf["experts_per_token"],
        expert_intermediate_size=hf["intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="topk_softmax",
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        moe_layers=(True,) * layers,
        attention_sinks=True,
        router_bias=True,
        swiglu_clamp=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))),
    )


def topk_softmax(logits: jax.Array, cfg: MoEConfig) -> Routing:
    """The top-k logits, softmaxed among themselves; the expert-map probabilities are the softmax over all
    experts (the same order)."""
    logits = logits.astype(jnp.float32)  # [N, J]
    top, ids = jax.lax.top_k(logits, cfg.top_k)  # [N, k]
    return Routing(
        probs=jax.nn.softmax(logits, axis=-1), ids=ids.astype(jnp.int32), weights=jax.nn.softmax(top, axis=-1)
    )


route = topk_softmax
