"""OLMoE (`model_type: olmoe`): GQA attention whose queries and keys are RMS-normalised over the whole
projection (all heads together) before RoPE, then clamped to `clip_qkv` if set (values too); softmax top-k
routing, renormalised only when `norm_topk_prob` (OLMoE-1B-7B: not); no shared expert. Config parsing and
routing only; the layers are shared (`models/base.py`).
"""

from __future__ import annotations

from typing import Any

from .config import MoEConfig, UnsupportedConfigError, common_fields, refuse_unsupported
from .mixtral import softmax_topk


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    refuse_unsupported(hf, {"hidden_act": "silu", "attention_bias": False}, "olmoe")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, head_dim):
        # transformers sizes OLMoE's k_norm by hidden_size / heads whatever head_dim says.
        raise UnsupportedConfigError(
            f"olmoe: config.json asks for unimplemented behaviour: head_dim={hf['head_dim']!r} "
            f"(supported: hidden_size / num_attention_heads = {head_dim})"
        )
    layers = hf["num_hidden_layers"]
    clip = hf.get("clip_qkv")
    return MoEConfig(
        **common_fields(hf, "olmoe", default_max_positions=4096),
        num_experts=hf.get("num_experts", hf.get("num_local_experts")),
        top_k=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        router="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
        sliding_windows=(None,) * layers,
        moe_layers=(True,) * layers,
    )


route = softmax_topk
