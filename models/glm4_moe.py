"""GLM-4.5 (`model_type: glm4_moe`: GLM-4.5, 4.6, 4.5-Air): grouped-query attention with q/k/v biases, RoPE on
the first `partial_rotary_factor` of each head, optional per-head q/k norms (`use_qk_norm`), the first
`first_k_dense_replace` layers dense, then routed experts with DeepSeek-V3's sigmoid routing
(`deepseek_v3.sigmoid_topk`) plus always-on shared experts. Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

from .config import MoEConfig, common_fields, refuse_unsupported
from .deepseek_v3 import sigmoid_routing_fields, sigmoid_topk

# transformers' Glm4MoeConfig rotates half of each head when config.json does not say.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(
        hf, {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "glm4_moe"
    )
    layers = hf["num_hidden_layers"]
    return MoEConfig(
        **common_fields(
            hf, "glm4_moe", default_max_positions=131072, partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR
        ),
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["moe_intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="head" if hf.get("use_qk_norm") else "none",
        sliding_windows=(None,) * layers,
        moe_layers=tuple(i >= hf.get("first_k_dense_replace", 1) for i in range(layers)),
        dense_intermediate_size=hf["intermediate_size"],
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        **sigmoid_routing_fields(hf),
    )


route = sigmoid_topk
