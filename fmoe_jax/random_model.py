"""`random_model`: a model with random weights at a real model's dimensions, built in memory (no checkpoint).

For live runs at real sizes on recorded routing (`generate(..., forced_routing=trace)`,
`benchmarks/live_replay.py`): what a step costs depends on the weights' sizes and precision, not on their
values. Takes a `ModelPreset` (`fmoe_jax.offload.model_presets`) or a Hugging Face config dict, all its
layers or fewer, optionally narrower (`width_scale`) so that it fits a small machine; routed experts in
bf16, int8, int4 or (gpt-oss) MXFP4, put one expert at a time into pinned host memory when offloading, as
`load_model` puts a checkpoint's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fmoe_jax.models import abstract_model, config_from_hf
from fmoe_jax.models.moe import Kernel
from fmoe_jax.models.quant import expert_quantization as make_quantization
from fmoe_jax.offload.model_presets import ModelPreset

from .loading import Model, build, check_load_arguments, param_sharding

# MXFP4's per-block exponent (E8M0, bias 127): 2**-7 puts the FP4 values (up to 6) near N(0, 0.02)'s range.
MXFP4_SCALE = 120
# Standard deviations of uniformly random int4 / int8 values, so that values x scale have about `std`'s.
UNIFORM_STD = {"int4": 4.6, "int8": 73.9}


def preset_hf_config(preset: ModelPreset) -> dict[str, Any]:
    """A Hugging Face config of the preset's dimensions: gpt-oss's (experts with biases) or Mixtral's (plain
    grouped-query attention and routed experts). Other architectures (shared experts, latent attention,
    linear layers, dense layers) have fields a preset does not hold: pass their config.json instead."""
    if (
        preset.shared_expert_intermediate_size
        or preset.kv_lora_rank
        or preset.linear_layers
        or preset.dense_layers
        or preset.attention_output_gate
    ):
        raise ValueError(
            f"random_model builds presets of gpt-oss's or Mixtral's architecture; {preset.name!r} has shared "
            "experts, latent attention, linear or dense layers: pass its Hugging Face config.json as a dict"
        )
    common = dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.expert_intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        num_local_experts=preset.num_experts,
        num_experts_per_tok=preset.top_k,
        tie_word_embeddings=preset.tie_word_embeddings,
    )
    if preset.expert_bias:
        return dict(common, model_type="gpt_oss", sliding_window=128, max_position_embeddings=131072)
    return dict(common, model_type="mixtral", max_position_embeddings=32768, rope_theta=1e6)


def shrunk_hf_config(hf: dict[str, Any], *, layers: int | None = None, width_scale: float = 1.0) -> dict:
    """`hf` with its first `layers` layers and its widths times `width_scale` (hidden and intermediate sizes
    rounded to multiples of 64, which quantization groups and MXFP4 blocks need; attention heads scaled with
    the head size kept, a multiple of the key-value heads; the vocabulary scaled too, rounded to 128, so that
    the LM head keeps its share of a step)."""
    out = dict(hf)
    if layers is not None:
        if not 1 <= layers <= hf["num_hidden_layers"]:
            raise ValueError(f"layers must be in [1, {hf['num_hidden_layers']}] (the model's), got {layers}")
        out["num_hidden_layers"] = layers
        if hf.get("layer_types"):
            out["layer_types"] = hf["layer_types"][:layers]
    if not 0 < width_scale <= 1:
        raise ValueError(f"width_scale must be in (0, 1], got {width_scale}")
    if width_scale != 1:
        head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        out["head_dim"] = head
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            if key in hf:
                out[key] = max(64, round(hf[key] * width_scale / 64) * 64)
        kv = max(1, round((hf.get("num_key_value_heads") or hf["num_attention_heads"]) * width_scale))
        out["num_key_value_heads"] = kv
        out["num_attention_heads"] = max(kv, round(hf["num_attention_heads"] * width_scale / kv) * kv)
        out["vocab_size"] = max(256, round(hf["vocab_size"] * width_scale / 128) * 128)
    return out


def random_model(
    source: ModelPreset | dict[str, Any],
    offload: Any = None,
    *,
    layers: int | None = None,
    width_scale: float = 1.0,
    expert_quantization: str | None = None,
    quantization_group_size: int | None = None,
    dtype: Any = jnp.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    kernel: Kernel = "auto",
) -> Model:
    """A `Model` with random weights at `source`'s dimensions, served as `load_model` serves a checkpoint.

    Args:
      source: a `ModelPreset` (gpt-oss's or Mixtral's architecture, `preset_hf_config`) or a Hugging Face
        config dict (any supported family).
      offload: None (resident) or an `OffloadConfig`: routed experts then live in pinned host memory.
      layers: keep the first `layers` layers (default all); width_scale: narrower, see `shrunk_hf_config`.
      expert_quantization: routed experts as "int8", "int4", "mxfp4" (gpt-oss only) or "none" (`dtype`);
        None: the `OffloadConfig`'s, else the preset's own (gpt-oss: MXFP4), else `dtype`.
      dtype: every other weight's dtype (bf16, as models ship).
      seed, std: weights are N(0, std) (quantized experts: uniform codes with scales of about that spread),
        norms ones, biases zeros.
    """
    check_load_arguments(offload, kernel)
    hf = preset_hf_config(source) if isinstance(source, ModelPreset) else dict(source)
    cfg = config_from_hf(shrunk_hf_config(hf, layers=layers, width_scale=width_scale))
    kind = expert_quantization
    if kind is None and offload is not None:
        kind, quantization_group_size = offload.expert_quantization, offload.quantization_group_size
    if kind is None and isinstance(source, ModelPreset):
        kind = source.expert_quantization
    kind = None if kind == "none" else kind
    if kind == "mxfp4" and cfg.swiglu_clamp is None:
        raise ValueError(
            f"expert_quantization='mxfp4' is gpt-oss's format; {cfg.family} experts take int8/int4"
        )
    quantization = make_quantization(kind, quantization_group_size)
    if quantization is not None:
        quantization.check_model(cfg.hidden_size, cfg.expert_intermediate_size)
    dtype = jnp.dtype(dtype)
    state = nnx.state(abstract_model(cfg, dtype=dtype, expert_quantization=quantization))
    rng = np.random.default_rng(seed)
    flat = {}
    for path, leaf in nnx.to_flat_state(state):
        spec = leaf.get_value()
        value = _random_leaf(path, spec.shape, np.dtype(spec.dtype), cfg, kind, std, rng)
        flat[tuple(path)] = jax.device_put(value, param_sharding(tuple(path), offload))
    name = source.name if isinstance(source, ModelPreset) else hf.get("model_type", "model")
    source_name = (
        f"<random {name}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, experts {kind or dtype}>"
    )
    return build(
        cfg,
        dtype,
        flat,
        offload,
        tokenizer=None,
        source=source_name,
        eos=cfg.eos_token_ids,
        kernel=kernel,
        quantization=quantization,
    )


def _random_leaf(
    path: tuple, shape: tuple, dtype: np.dtype, cfg: Any, kind: str | None, std: float, rng: Any
) -> np.ndarray:
    """One parameter's random value (see `random_model`), by its name and dtype."""
    name = path[-1]
    if dtype == np.uint8 and name == "scales":  # MXFP4's block exponents
        return np.full(shape, MXFP4_SCALE, np.uint8)
    if np.issubdtype(dtype, np.integer):  # quantized codes (int4 packed two per byte, int8, MXFP4)
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if name == "scales":
        return np.full(shape, std / UNIFORM_STD[kind], dtype)
    if any("norm" in str(k) for k in path):
        centred = cfg.norm == "rms_zero_centered" and "linear_attn" not in map(str, path)
        return np.full(shape, 0.0 if centred else 1.0, dtype)
    if str(name).endswith("bias") or name in ("sinks", "score_correction"):
        return np.zeros(shape, dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)
