"""Mixtral (`model_type: mixtral`): RMSNorm, GQA attention with RoPE, softmax top-k routing renormalised
over the chosen experts, SwiGLU experts, optional sliding window. Config parsing and routing only; the
layers are shared (`models/base.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, eos_ids, refuse_unsupported, rope_from_hf
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}, "mixtral")
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return MoEConfig(
        family="mixtral",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        rope=rope_from_hf(hf, head_dim, allow_longrope=False),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="softmax_topk",
        norm_topk_prob=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        sliding_windows=(hf.get("sliding_window"),) * layers,
        moe_layers=(True,) * layers,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
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
