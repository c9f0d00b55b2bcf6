"""Phi-3.5-MoE (`model_type: phimoe`): LayerNorm with bias, optional attention and LM-head biases,
LongRoPE, and sparsemixer top-2 routing (its inference path). Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, eos_ids, refuse_unsupported, rope_from_hf
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu"}, "phimoe")
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    return MoEConfig(
        family="phimoe",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        rope=rope_from_hf(hf, head_dim, allow_longrope=True),
        max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32),
        norm="layer",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="sparsemixer",
        router_jitter_noise=float(hf.get("router_jitter_noise", 0.01)),
        qkv_bias=bias,
        o_bias=bias,
        lm_head_bias=bool(hf.get("lm_head_bias", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        sliding_windows=(hf.get("sliding_window"),) * layers,
        moe_layers=(True,) * layers,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
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
