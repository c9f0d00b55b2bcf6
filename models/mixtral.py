"""Mixtral (`model_type: mixtral`): RMSNorm, GQA attention with RoPE, softmax top-k routing renormalised
over the chosen experts, SwiGLU experts, optional sliding window. Config parsing and routing only; the
layers are shared (`models/base.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, common_fields, refuse_unsupported
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}, "mixtral")
    layers = hf["num_hidden_layers"]
    return MoEConfig(
        **common_fields(hf, "mixtral", default_max_positions=32768),
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="softmax_topk",
        norm_topk_prob=True,
        sliding_windows=(hf.get("sliding_window"),) * layers,
        moe_layers=(True,) * layers,
    )


def softmax_topk(logits: jax.Array, cfg: MoEConfig) -> Routing:
    """Softmax over all experts in float32, top-k, renormalised over the chosen k when `norm_topk_prob`.

    Mixtral always renormalises; Qwen1.5-MoE (`models/qwen2_moe.py`) only when its config says so.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, J]
    weights, ids = jax.lax.top_k(probs, cfg.top_k)  # [N, k]
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(probs=probs, ids=ids.astype(jnp.int32), weights=weights)


route = softmax_topk
