"""Phi-3.5-MoE (`model_type: phimoe`): LayerNorm with bias, optional attention and LM-head biases,
LongRoPE, and sparsemixer top-2 routing (its inference path). Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, common_fields, refuse_unsupported
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu"}, "phimoe")
    layers = hf["num_hidden_layers"]
    bias = bool(hf.get("attention_bias", False))
    return MoEConfig(
        **common_fields(hf, "phimoe", default_max_positions=4096 * 32, allow_longrope=True),
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        norm="layer",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="sparsemixer",
        router_jitter_noise=float(hf.get("router_jitter_noise", 0.01)),
        qkv_bias=bias,
        o_bias=bias,
        lm_head_bias=bool(hf.get("lm_head_bias", False)),
        sliding_windows=(hf.get("sliding_window"),) * layers,
        moe_layers=(True,) * layers,
    )


def _masked_softmax_pick(scores: jax.Array, candidates: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """One sparsemixer round: the best of `candidates` and its weight among the logits within `2 * eps`
    (relative) of it. scores, candidates `[N, J]` float32 -> (ids `[N]`, weights `[N]`)."""
    best = jnp.max(candidates, axis=-1, keepdims=True)
    ids = jnp.argmax(candidates, axis=-1)
    factor = jnp.maximum(jnp.abs(scores), best)
    far = (best - scores) / factor > 2 * eps
    gates = jax.nn.softmax(jnp.where(far, -jnp.inf, candidates), axis=-1)
    return ids, jnp.take_along_axis(gates, ids[:, None], axis=-1)[:, 0]


def sparsemixer(logits: jax.Array, cfg: MoEConfig) -> Routing:
    """Inference path of sparsemixer (top-2): the first expert is the argmax, weighted by a softmax over
    the logits close to it; the second is the argmax of the rest, weighted likewise. The expert-map
    probabilities are the plain softmax over all experts."""
    scores = logits.astype(jnp.float32)  # [N, J]
    eps = cfg.router_jitter_noise
    first, w1 = _masked_softmax_pick(scores, scores, eps)
    rest = jnp.where(jax.nn.one_hot(first, scores.shape[-1], dtype=bool), -jnp.inf, scores)
    second, w2 = _masked_softmax_pick(scores, rest, eps)
    ids = jnp.stack([first, second], axis=-1).astype(jnp.int32)
    return Routing(probs=jax.nn.softmax(scores, axis=-1), ids=ids, weights=jnp.stack([w1, w2], axis=-1))


route = sparsemixer
