"""Per-family tables between Hugging Face tensor names and fmoe_jax parameter paths.

`load_model` (HF directories), the conversion CLI and the HF exporter all use these tables. Two HF layouts
are understood: the hub layout that `save_pretrained` writes (one tensor per expert matrix) and the fused
layout transformers 5 keeps in memory (`mlp.experts.gate_up_proj` `[J, 2F, D]`, `mlp.experts.down_proj`
`[J, D, F]`). Our matrices are stored `[out, in]` like HF's (see `models/layers.py` for why), so tensors are
copied as they are; only the fused layout is sliced per expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Literal

import numpy as np
from fmoe_jax.models.config import MoEConfig

Path = tuple[str | int, ...]
Transform = Literal["copy", "fused_gate", "fused_up", "fused_down"]
HFLayout = Literal["hub", "fused"]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where (part of) one HF tensor goes: our parameter `path`, of `shape`, via `transform`."""

    path: Path
    shape: tuple[int, ...]
    transform: Transform = "copy"
    expert: int = -1  # for fused transforms: which slice of the stacked tensor


@dataclasses.dataclass(frozen=True)
class HFTensor:
    key: str
    shape: tuple[int, ...]  # the shape HF stores
    targets: tuple[Target, ...]
    layer: int = -1  # decoder layer it belongs to (-1: embeddings, final norm, head)
    expert: int = -1  # routed expert it belongs to (hub layout; -1 otherwise)


def _moe_prefix(cfg: MoEConfig, layout: HFLayout) -> str:
    if layout == "fused" or cfg.family == "qwen2_moe":
        return "mlp"
    return "block_sparse_moe"


def _router_name(cfg: MoEConfig, layout: HFLayout) -> str:
    return "router" if (cfg.family == "phimoe" and layout == "fused") else "gate"


def _linear(key: str, path: Path, fan_in: int, fan_out: int, bias: bool, layer: int) -> list[HFTensor]:
    out = [
        HFTensor(
            f"{key}.weight",
            (fan_out, fan_in),
            (Target((*path, "weight"), (fan_out, fan_in)),),
            layer,
        )
    ]
    if bias:
        out.append(HFTensor(f"{key}.bias", (fan_out,), (Target((*path, "bias"), (fan_out,)),), layer))
    return out


def _norm(key: str, path: Path, cfg: MoEConfig, layer: int) -> list[HFTensor]:
    d = cfg.hidden_size
    out = [HFTensor(f"{key}.weight", (d,), (Target((*path, "weight"), (d,)),), layer)]
    if cfg.norm == "layer":
        out.append(HFTensor(f"{key}.bias", (d,), (Target((*path, "bias"), (d,)),), layer))
    return out


def _swiglu(
    key: str, path: Path, d: int, f: int, names: tuple[str, str, str], layer: int, expert: int = -1
) -> list[HFTensor]:
    """A SwiGLU MLP stored as three HF linears `names` = (gate, up, down)."""
    gate, up, down = names
    return [
        HFTensor(f"{key}.{gate}.weight", (f, d), (Target((*path, "gate"), (f, d)),), layer, expert),
        HFTensor(f"{key}.{up}.weight", (f, d), (Target((*path, "up"), (f, d)),), layer, expert),
        HFTensor(f"{key}.{down}.weight", (d, f), (Target((*path, "down"), (d, f)),), layer, expert),
    ]


def hf_tensors(cfg: MoEConfig, layout: HFLayout = "hub") -> list[HFTensor]:
    """Every tensor of a checkpoint of this config, in a streaming-friendly order (layer by layer)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    f = cfg.expert_intermediate_size
    tensors = [HFTensor("model.embed_tokens.weight", (v, d), (Target(("embed", "embedding"), (v, d)),))]
    expert_names = ("gate_proj", "up_proj", "down_proj") if cfg.family == "qwen2_moe" else ("w1", "w3", "w2")
    moe = _moe_prefix(cfg, layout)
    for i in range(cfg.num_layers):
        p, lp = f"model.layers.{i}", ("layers", i)
        tensors += _norm(f"{p}.input_layernorm", (*lp, "input_norm"), cfg, i)
        tensors += _linear(f"{p}.self_attn.q_proj", (*lp, "attn", "q_proj"), d, h * e, cfg.qkv_bias, i)
        tensors += _linear(f"{p}.self_attn.k_proj", (*lp, "attn", "k_proj"), d, k * e, cfg.qkv_bias, i)
        tensors += _linear(f"{p}.self_attn.v_proj", (*lp, "attn", "v_proj"), d, k * e, cfg.qkv_bias, i)
        tensors += _linear(f"{p}.self_attn.o_proj", (*lp, "attn", "o_proj"), h * e, d, cfg.o_bias, i)
        tensors += _norm(f"{p}.post_attention_layernorm", (*lp, "post_norm"), cfg, i)
        if not cfg.moe_layers[i]:
            tensors += _swiglu(
                f"{p}.mlp",
                (*lp, "mlp"),
                d,
                cfg.dense_intermediate_size,
                ("gate_proj", "up_proj", "down_proj"),
                i,
            )
            continue
        tensors += _linear(
            f"{p}.{moe}.{_router_name(cfg, layout)}", (*lp, "router"), d, cfg.num_experts, False, i
        )
        if cfg.shared_expert_intermediate_size:
            tensors += _swiglu(
                f"{p}.mlp.shared_expert",
                (*lp, "shared_expert"),
                d,
                cfg.shared_expert_intermediate_size,
                ("gate_proj", "up_proj", "down_proj"),
                i,
            )
            tensors += _linear(f"{p}.mlp.shared_expert_gate", (*lp, "shared_gate"), d, 1, False, i)
        if layout == "hub":
            for j in range(cfg.num_experts):
                tensors += _swiglu(f"{p}.{moe}.experts.{j}", ("experts", i, j), d, f, expert_names, i, j)
        else:
            j_all = range(cfg.num_experts)
            tensors.append(
                HFTensor(
                    f"{p}.mlp.experts.gate_up_proj",
                    (cfg.num_experts, 2 * f, d),
                    tuple(Target(("experts", i, j, "gate"), (f, d), "fused_gate", j) for j in j_all)
                    + tuple(Target(("experts", i, j, "up"), (f, d), "fused_up", j) for j in j_all),
                    i,
                )
            )
            tensors.append(
                HFTensor(
                    f"{p}.mlp.experts.down_proj",
                    (cfg.num_experts, d, f),
                    tuple(Target(("experts", i, j, "down"), (d, f), "fused_down", j) for j in j_all),
                    i,
                )
            )
    tensors += _norm("model.norm", ("final_norm",), cfg, -1)
    if not cfg.tie_word_embeddings:
        tensors += _linear("lm_head", ("lm_head",), d, v, cfg.lm_head_bias, -1)
    return tensors


def detect_layout(keys: Iterable[str]) -> HFLayout:
    """Fused if any tensor is a stacked `experts.gate_up_proj`, else hub."""
    return "fused" if any(key.endswith("experts.gate_up_proj") for key in keys) else "hub"


def apply_transform(array: np.ndarray, target: Target) -> np.ndarray:
    """HF tensor -> our parameter (a new contiguous array, or the array itself when it already is one)."""
    if target.transform == "copy":
        return np.ascontiguousarray(array)
    f = target.shape[0] if target.transform != "fused_down" else target.shape[1]
    sliced = {
        "fused_gate": lambda: array[target.expert, :f, :],
        "fused_up": lambda: array[target.expert, f:, :],
        "fused_down": lambda: array[target.expert],
    }[target.transform]()
    return np.ascontiguousarray(sliced)


def to_hf(cfg: MoEConfig, params: Mapping[Path, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters (flat, by path) -> HF hub-layout tensors, the inverse of the loading table."""
    out = {}
    for tensor in hf_tensors(cfg, "hub"):
        (target,) = tensor.targets
        out[tensor.key] = np.asarray(params[target.path])
    return out
