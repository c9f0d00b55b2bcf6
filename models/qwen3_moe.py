"""Qwen3-MoE (`model_type: qwen3_moe`): GQA attention without biases whose queries and keys are RMS-normalised
per head before RoPE, softmax top-k routing over many small experts (renormalised when `norm_topk_prob`), no
shared expert, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say so. Config parsing and
routing only; the layers are shared (`models/base.py`).
"""

from __future__ import annotations

from typing import Any

from .config import MoEConfig, refuse_unsupported
from .mixtral import softmax_topk
from .qwen2_moe import qwen_moe_fields


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    # Qwen3-30B-A3B and -235B-A22B have no attention bias and no sliding window.
    refuse_unsupported(
        hf, {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}, "qwen3_moe"
    )
    layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    return MoEConfig(
        **qwen_moe_fields(hf, "qwen3_moe", num_experts),
        qk_norm="head",
        sliding_windows=(None,) * layers,
    )


route = softmax_topk
