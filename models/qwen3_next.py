"""Qwen3-Next (`model_type: qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`, its text model; `qwen3_5_moe_text`):
hybrid models whose layers are Gated DeltaNet linear attention (`models/gated_deltanet.py`) except every
`full_attention_interval`-th (by `layer_types`), which is grouped-query attention with an output gate,
per-head q/k norms and RoPE on the first quarter of each head; zero-centred RMSNorms; softmax top-k routing
over hundreds of small experts (renormalised: Qwen3-Next when `norm_topk_prob`, Qwen3.5 always) plus a
sigmoid-gated shared expert. Config parsing and routing only; the layers are shared (`models/base.py`).

Qwen3.5's checkpoints are vision-language models: the text model's config sits under `text_config` and its
tensors under `model.language_model.`; the vision tower is not part of this model (`convert/keys.py` leaves
it out).
Its multimodal RoPE (`mrope_section`) rotates text positions as plain RoPE does (a text token's three position
ids are equal), so text generation needs nothing more.
"""

from __future__ import annotations

from typing import Any

from .config import (
    LinearAttentionConfig,
    MoEConfig,
    UnsupportedConfigError,
    refuse_unsupported,
)
from .mixtral import softmax_topk
from .qwen2_moe import qwen_moe_fields

LAYER_KINDS = ("linear_attention", "full_attention")


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    """Qwen3-Next, or a Qwen3.5-MoE config (the whole vision-language one, or its text config alone)."""
    if hf.get("model_type") == "qwen3_next":
        return _hybrid_config(hf, "qwen3_next", fused_projections=True)
    text = hf.get("text_config", hf)  # qwen3_5_moe nests it; qwen3_5_moe_text is it
    if not isinstance(text, dict):
        raise UnsupportedConfigError(f"qwen3_5_moe: text_config must be an object, got {text!r}")
    # transformers' Qwen3.5 routers always renormalise; a config asking otherwise is not what it runs.
    only = {"norm_topk_prob": True, "mlp_only_layers": ((), []), "decoder_sparse_step": 1}
    refuse_unsupported(text, only, "qwen3_5_moe")
    shared = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # may sit at the top
    merged = {**text, **{k: hf[k] for k in shared if k in hf and k not in text}}
    return _hybrid_config({**merged, "norm_topk_prob": True}, "qwen3_5_moe", fused_projections=False)


def _hybrid_config(hf: dict[str, Any], family: str, *, fused_projections: bool) -> MoEConfig:
    refuse_unsupported(
        hf,
        {
            "hidden_act": "silu",
            "attention_bias": False,
            # transformers gates every full-attention layer whatever this says; fmoe_jax does what it runs
            "attn_output_gate": True,
            "mamba_ssm_dtype": ("float32", None),  # the recurrent state is kept in float32
        },
        family,
    )
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else "full_attention"
        for i in range(layers)
    ]
    unknown = sorted({k for k in kinds if k not in LAYER_KINDS})
    if unknown or len(kinds) != layers:
        raise UnsupportedConfigError(
            f"{family}: layer_types must name {layers} layers, each one of {LAYER_KINDS}; got "
            f"{len(kinds)} with {unknown or 'no'} unknown kinds"
        )
    # transformers' Qwen3-Next and Qwen3.5 rotate a quarter of each head when config.json does not say
    fields = qwen_moe_fields(hf, family, hf["num_experts"], partial_rotary_factor=0.25)
    fields.update(norm="rms_zero_centered")
    return MoEConfig(
        **fields,
        qk_norm="head",
        sliding_windows=(None,) * layers,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(hf.get("shared_expert_intermediate_size")),
        attention_output_gate=True,
        linear_attention=LinearAttentionConfig(
            layers=tuple(k == "linear_attention" for k in kinds),
            num_key_heads=hf.get("linear_num_key_heads", 16),
            num_value_heads=hf.get("linear_num_value_heads", 32),
            key_head_dim=hf.get("linear_key_head_dim", 128),
            value_head_dim=hf.get("linear_value_head_dim", 128),
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            fused_projections=fused_projections,
        ),
    )


route = softmax_topk
