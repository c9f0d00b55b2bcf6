"""DeepSeek-V3 (`model_type: deepseek_v3`: DeepSeek-V3, R1, V3.1; `kimi_k2`: Kimi-K2): DeepSeek-V2's latent
attention, dense first layers and shared experts (`deepseek_v2.mla_moe_fields`), with sigmoid routing:
experts are chosen by their sigmoid score plus a learned correction bias (`e_score_correction_bias`) among
the `topk_group` best of `n_group` groups (a group ranked by the sum of its two best corrected scores), and
weighted by their uncorrected scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
GLM-4.5 (`models/glm4_moe.py`) routes the same way. Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, refuse_unsupported
from .deepseek_v2 import mla_moe_fields
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "deepseek_v3")
    fields = {**mla_moe_fields(hf, "deepseek_v3"), **sigmoid_routing_fields(hf)}
    return MoEConfig(**fields, rope_interleave=bool(hf.get("rope_interleave", True)))


def sigmoid_routing_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The routing fields of DeepSeek-V3 and GLM-4.5 (transformers' defaults where config.json is silent)."""
    return dict(
        router="sigmoid_grouped",
        score_correction_bias=True,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        topk_method="group_limited_greedy",
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        router_matmul_float32=True,
    )


def sigmoid_topk(logits: jax.Array, cfg: MoEConfig, correction: jax.Array) -> Routing:
    """logits `[N, J]`, correction bias `[J]` float32 -> Routing (see the module docstring). The expert-map
    probabilities are the softmax of the logits, ordered as the sigmoid scores (a distribution over the
    experts, as every family's map is)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits)  # [N, J]
    choice = scores + correction.astype(jnp.float32)
    if cfg.n_group > 1:
        n, j = scores.shape
        per_group = j // cfg.n_group
        best_two, _ = jax.lax.top_k(choice.reshape(n, cfg.n_group, per_group), 2)
        _, groups = jax.lax.top_k(jnp.sum(best_two, axis=-1), cfg.topk_group)  # [N, topk_group]
        eligible = jnp.any(jax.nn.one_hot(groups, cfg.n_group, dtype=jnp.bool_), axis=1)  # [N, G]
        choice = jnp.where(jnp.repeat(eligible, per_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return Routing(probs=jax.nn.softmax(logits, axis=-1), ids=ids.astype(jnp.int32), weights=weights)


route = sigmoid_topk
