"""Flax NNX models of the supported MoE families and the registry that builds them from HF configs.

`config_from_hf` reads a Hugging Face `config.json` dict; `build_model` / `abstract_model` instantiate
the shared `MoECausalLM` with the family's routing function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from . import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    phimoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)
from .base import DecoderLayer, MoECausalLM, RouteFn
from .config import MoEConfig, RopeConfig, UnsupportedConfigError, model_identity
from .layers import LayerCache, LayerKV, Layout, LinearState, init_kv_cache
from .moe import (
    Expert,
    ExpertWeights,
    ForcedRouting,
    Routing,
    expert_mixture,
    expert_parts,
    reference_mixture,
    sum_parts,
)
from .quant import ExpertQuantization, QuantizedMatrix, expert_quantization


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_from_hf: Callable[[dict[str, Any]], MoEConfig]
    route: RouteFn


FAMILIES: dict[str, Family] = {
    "mixtral": Family("mixtral", mixtral.config_from_hf, mixtral.route),
    "qwen2_moe": Family("qwen2_moe", qwen2_moe.config_from_hf, qwen2_moe.route),
    "phimoe": Family("phimoe", phimoe.config_from_hf, phimoe.route),
    "qwen3_moe": Family("qwen3_moe", qwen3_moe.config_from_hf, qwen3_moe.route),
    "olmoe": Family("olmoe", olmoe.config_from_hf, olmoe.route),
    "deepseek_v2": Family("deepseek_v2", deepseek_v2.config_from_hf, deepseek_v2.route),
    "deepseek_v3": Family("deepseek_v3", deepseek_v3.config_from_hf, deepseek_v3.route),
    "kimi_k2": Family("deepseek_v3", deepseek_v3.config_from_hf, deepseek_v3.route),  # Kimi-K2: V3's shape
    "glm4_moe": Family("glm4_moe", glm4_moe.config_from_hf, glm4_moe.route),
    "gpt_oss": Family("gpt_oss", gpt_oss.config_from_hf, gpt_oss.route),
    "qwen3_next": Family("qwen3_next", qwen3_next.config_from_hf, qwen3_next.route),
    "qwen3_5_moe": Family("qwen3_5_moe", qwen3_next.config_from_hf, qwen3_next.route),
}
# model_type of a checkpoint that holds a family's model under another name: Qwen3.5-MoE's text model alone.
ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}


def config_from_hf(hf: dict[str, Any]) -> MoEConfig:
    """Builds a `MoEConfig` from a Hugging Face `config.json` dict, refusing unknown families by name."""
    model_type = ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    if model_type not in FAMILIES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type].config_from_hf(hf)


def build_model(
    cfg: MoEConfig,
    *,
    dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
    expert_quantization: ExpertQuantization | None = None,
) -> MoECausalLM:
    """A randomly initialised model (training, tests); quantized experts are zeros until loaded."""
    return MoECausalLM(
        cfg,
        FAMILIES[cfg.family].route,
        dtype=dtype,
        rngs=nnx.Rngs(seed),
        expert_quantization=expert_quantization,
    )


def abstract_model(
    cfg: MoEConfig, *, dtype: jnp.dtype = jnp.float32, expert_quantization: ExpertQuantization | None = None
) -> MoECausalLM:
    """The model with `jax.ShapeDtypeStruct` leaves: the target structure checkpoint loaders fill in."""
    return nnx.eval_shape(lambda: build_model(cfg, dtype=dtype, expert_quantization=expert_quantization))


__all__ = [
    "FAMILIES",
    "DecoderLayer",
    "Expert",
    "ForcedRouting",
    "ExpertQuantization",
    "ExpertWeights",
    "Family",
    "LayerCache",
    "LayerKV",
    "Layout",
    "LinearState",
    "MoECausalLM",
    "MoEConfig",
    "QuantizedMatrix",
    "RopeConfig",
    "Routing",
    "UnsupportedConfigError",
    "abstract_model",
    "build_model",
    "config_from_hf",
    "expert_mixture",
    "expert_quantization",
    "expert_parts",
    "model_identity",
    "sum_parts",
    "init_kv_cache",
    "reference_mixture",
]
