"""DeepSeek-V2 (`model_type: deepseek_v2`; V2-Lite and V2): multi-head latent attention (`models/mla.py`) with
YaRN, the first `first_k_dense_replace` layers dense, then routed experts plus always-on shared experts
(no gate), softmax routing with greedy or group-limited greedy top-k and `routed_scaling_factor`. Config
parsing and routing only; the layers are shared (`models/base.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .config import MoEConfig, common_fields, refuse_unsupported
from .moe import Routing


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(
        hf,
        {
            "scoring_func": "softmax",  # "sigmoid" is DeepSeek-V3's
            "topk_method": ("greedy", "group_limited_greedy"),  # "noaux_tc" is DeepSeek-V3's
        },
        "deepseek_v2",
    )
    group_limited = hf.get("topk_method", "greedy") == "group_limited_greedy"
    return MoEConfig(
        **mla_moe_fields(hf, "deepseek_v2"),
        router="deepseek",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        topk_method="group_limited_greedy" if group_limited else "greedy",
        n_group=(hf.get("n_group") or 1) if group_limited else 1,
        topk_group=(hf.get("topk_group") or 1) if group_limited else 1,
    )


def mla_moe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The `MoEConfig` fields DeepSeek-V2 and DeepSeek-V3 read from config.json alike: latent attention with
    YaRN, `first_k_dense_replace` dense layers, routed and shared experts, `routed_scaling_factor`, a float32
    router matmul; refuses what neither implements."""
    heads = hf["num_attention_heads"]
    refuse_unsupported(
        hf,
        {
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "moe_layer_freq": 1,
            # MLA has no KV heads: transformers expands the latent to every head and needs them equal.
            "num_key_value_heads": (None, heads),
        },
        family,
    )
    layers = hf["num_hidden_layers"]
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    fields = common_fields(hf, family, default_max_positions=2048, allow_yarn=True)
    fields.update(num_kv_heads=heads, head_dim=nope + rope)  # config.json's head_dim is the rope part
    return dict(
        **fields,
        num_experts=hf.get("n_routed_experts", hf.get("num_experts")),
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["moe_intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        sliding_windows=(None,) * layers,
        moe_layers=tuple(i >= hf.get("first_k_dense_replace", 0) for i in range(layers)),
        dense_intermediate_size=hf["intermediate_size"],
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=hf.get("v_head_dim", 128),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        router_matmul_float32=True,
    )


def deepseek_topk(logits: jax.Array, cfg: MoEConfig) -> Routing:
    """Softmax over all experts in float32; under "group_limited_greedy" only the experts of the `topk_group`
    groups with the best single expert stay eligible; top-k; then, as DeepSeek-V2's code, the weights are
    renormalised (`norm_topk_prob` and k > 1) or else multiplied by `routed_scaling_factor`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, J]
    scores = probs
    if cfg.topk_method == "group_limited_greedy":
        n, j = probs.shape
        best_in_group = jnp.max(probs.reshape(n, cfg.n_group, j // cfg.n_group), axis=-1)  # [N, G]
        _, groups = jax.lax.top_k(best_in_group, cfg.topk_group)  # [N, topk_group]
        eligible = jnp.any(jax.nn.one_hot(groups, cfg.n_group, dtype=jnp.bool_), axis=1)  # [N, G]
        scores = jnp.where(jnp.repeat(eligible, j // cfg.n_group, axis=1), probs, 0.0)
    weights, ids = jax.lax.top_k(scores, cfg.top_k)  # [N, k]
    if cfg.top_k > 1 and cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return Routing(probs=probs, ids=ids.astype(jnp.int32), weights=weights)


route = deepseek_topk
