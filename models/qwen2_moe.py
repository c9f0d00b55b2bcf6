"""Qwen1.5-MoE (`model_type: qwen2_moe`): q/k/v biases, softmax top-k routing (renormalised only when
`norm_topk_prob`), an always-on shared expert scaled by a sigmoid gate, and dense MLP layers where
`mlp_only_layers` / `decoder_sparse_step` say so. Config parsing and routing only.
"""

from __future__ import annotations

from typing import Any

from .config import MoEConfig, common_fields, refuse_unsupported
from .mixtral import softmax_topk


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu"}, "qwen2_moe")
    layers = hf["num_hidden_layers"]
    num_experts = hf["num_experts"]
    windows: tuple[int | None, ...] = (None,) * layers
    if hf.get("use_sliding_window"):
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        windows = tuple(hf["sliding_window"] if t == "sliding_attention" else None for t in types)
    return MoEConfig(
        **qwen_moe_fields(hf, "qwen2_moe", num_experts),
        qkv_bias=bool(hf.get("qkv_bias", True)),
        sliding_windows=windows,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(hf.get("shared_expert_intermediate_size")),
    )


def qwen_moe_fields(hf: dict[str, Any], family: str, num_experts: int, **rope: Any) -> dict[str, Any]:
    """The `MoEConfig` fields the Qwen MoE families read from config.json alike: `common_fields` (`rope`: its
    RoPE options), softmax top-k routing over `num_experts` experts, RMS norms, and dense MLP layers where
    `sparse_layers` says."""
    return dict(
        **common_fields(hf, family, default_max_positions=32768, **rope),
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["moe_intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        router="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layers(hf, num_experts),
        dense_intermediate_size=hf.get("intermediate_size", 0),
    )


def sparse_layers(hf: dict[str, Any], num_experts: int) -> tuple[bool, ...]:
    """Per layer, True for a routed MoE block: not in `mlp_only_layers` and every `decoder_sparse_step`-th
    layer (Qwen1.5-MoE and Qwen3-MoE alike)."""
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    return tuple(
        i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])
    )


route = softmax_topk
