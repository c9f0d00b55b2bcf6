"""Per-family tables between Hugging Face tensor names and fmoe_jax parameter paths.

`load_model` (HF directories), the conversion CLI and the HF exporter all use these tables. Two HF layouts
are understood: the hub layout that `save_pretrained` writes (one tensor per expert matrix) and the fused
layout transformers 5 keeps in memory (`mlp.experts.gate_up_proj` `[J, 2F, D]`, `mlp.experts.down_proj`
`[J, D, F]`). Our matrices are stored `[out, in]` like HF's (see `models/layers.py` for why), so tensors are
copied as they are; only the fused layout is sliced per expert. gpt-oss publishes its own fused layout
(`gate_up_proj` `[J, D, 2F]` `[in, out]` with gate and up interleaved, biases beside), or the same experts in
MXFP4 (`*_blocks`, `*_scales`: the "mxfp4" layout, `models/mxfp4.py`), sliced per expert as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Literal

import numpy as np

from fmoe_jax.models.config import MoEConfig

Path = tuple[str | int, ...]
Transform = Literal[
    "copy",
    "fused_gate",
    "fused_up",
    "fused_down",
    "expert",  # one expert's slice of a stacked tensor
    "expert_even_rows",  # its rows 0, 2, 4, ... (gpt-oss: the gate's, gate and up interleaved)
    "expert_odd_rows",  # rows 1, 3, 5, ... (the up projection's)
    "expert_even_columns_t",  # columns 0, 2, ... of an `[in, out]` slice, transposed to `[out, in]`
    "expert_odd_columns_t",
    "expert_t",  # the slice transposed
]
HFLayout = Literal["hub", "fused", "mxfp4"]


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


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class HubNames:
    """How a family names its MoE block in the hub layout."""

    moe: str  # the module holding the router (`gate`) and the routed experts
    expert: tuple[str, str, str]  # a routed expert's gate, up and down linears
    shared: str = ""  # the shared expert's module (its gate, if any, is `mlp.shared_expert_gate`)


HUB_NAMES = {
    "mixtral": HubNames("block_sparse_moe", ("w1", "w3", "w2")),
    "phimoe": HubNames("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_expert"),
    "qwen3_moe": HubNames("mlp", GATE_UP_DOWN),
    "olmoe": HubNames("mlp", GATE_UP_DOWN),
    "deepseek_v2": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_experts"),
    "deepseek_v3": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_experts"),
    "glm4_moe": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_experts"),
    "gpt_oss": HubNames("mlp", GATE_UP_DOWN),  # its router and experts: `_gpt_oss_moe`
    "qwen3_next": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_expert"),
    "qwen3_5_moe": HubNames("mlp", GATE_UP_DOWN, "mlp.shared_expert"),
}
# Tensors a family's checkpoints hold beside the language model, which fmoe_jax does not run (by key prefix):
# the loaders leave them out and the conversion says so in one line.
NOT_CONVERTED = {
    "qwen3_next": {"mtp.": "multi-token prediction head"},
    "qwen3_5_moe": {"mtp.": "multi-token prediction head", "model.visual.": "vision tower"},
}
# Where a vision-language checkpoint (Qwen3.5's) keeps the language model's tensors, instead of `model.`.
LANGUAGE_MODEL_PREFIX = "model.language_model."


def _moe_prefix(cfg: MoEConfig, layout: HFLayout) -> str:
    return "mlp" if layout == "fused" else HUB_NAMES[cfg.family].moe


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


def _vector(key: str, path: Path, size: int, layer: int) -> HFTensor:
    """A norm weight of `size` that is not the hidden size (q/k norms, MLA's latent norms)."""
    return HFTensor(f"{key}.weight", (size,), (Target((*path, "weight"), (size,)),), layer)


def _linear_attention(cfg: MoEConfig, key: str, i: int) -> list[HFTensor]:
    """Layer i's Gated DeltaNet (`models/gated_deltanet.py`): its projections (Qwen3-Next's two fused ones or
    Qwen3.5's four), the convolution `[C, 1, K]`, the decay parameters, the gated norm and the output."""
    la, d, path = cfg.linear_attention, cfg.hidden_size, ("layers", i, "attn")
    h, value_dim = la.num_value_heads, la.num_value_heads * la.value_head_dim
    qkv = la.conv_dim
    if la.fused_projections:
        projections = {"in_proj_qkvz": qkv + value_dim, "in_proj_ba": 2 * h}
    else:
        projections = {"in_proj_qkv": qkv, "in_proj_z": value_dim, "in_proj_b": h, "in_proj_a": h}
    out = []
    for name, size in projections.items():
        out += _linear(f"{key}.{name}", (*path, name), d, size, False, i)
    conv = (la.conv_dim, 1, la.conv_kernel)
    out.append(HFTensor(f"{key}.conv1d.weight", conv, (Target((*path, "conv_weight"), conv),), i))
    for name in ("dt_bias", "A_log"):
        out.append(HFTensor(f"{key}.{name}", (h,), (Target((*path, name), (h,)),), i))
    out.append(_vector(f"{key}.norm", (*path, "norm"), la.value_head_dim, i))
    return out + _linear(f"{key}.out_proj", (*path, "out_proj"), value_dim, d, False, i)


def _attention(cfg: MoEConfig, i: int, prefix: str = "model.") -> list[HFTensor]:
    """Layer i's attention: grouped-query (with the optional q/k norms and output gate), multi-head latent
    (MLA), or a hybrid model's linear attention."""
    d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.is_linear(i):
        return _linear_attention(cfg, f"{prefix}layers.{i}.linear_attn", i)
    key, path = f"{prefix}layers.{i}.self_attn", ("layers", i, "attn")
    if cfg.is_mla:
        n, p, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        out = []
        if cfg.q_lora_rank:
            out += _linear(f"{key}.q_a_proj", (*path, "q_a_proj"), d, cfg.q_lora_rank, False, i)
            out.append(_vector(f"{key}.q_a_layernorm", (*path, "q_a_norm"), cfg.q_lora_rank, i))
            out += _linear(f"{key}.q_b_proj", (*path, "q_b_proj"), cfg.q_lora_rank, h * (n + p), False, i)
        else:
            out += _linear(f"{key}.q_proj", (*path, "q_proj"), d, h * (n + p), False, i)
        out += _linear(f"{key}.kv_a_proj_with_mqa", (*path, "kv_a_proj"), d, r + p, False, i)
        out.append(_vector(f"{key}.kv_a_layernorm", (*path, "kv_a_norm"), r, i))
        out += _linear(f"{key}.kv_b_proj", (*path, "kv_b_proj"), r, h * (n + v), False, i)
        return out + _linear(f"{key}.o_proj", (*path, "o_proj"), h * v, d, False, i)
    q_out = h * e * (2 if cfg.attention_output_gate else 1)
    out = _linear(f"{key}.q_proj", (*path, "q_proj"), d, q_out, cfg.qkv_bias, i)
    out += _linear(f"{key}.k_proj", (*path, "k_proj"), d, k * e, cfg.qkv_bias, i)
    out += _linear(f"{key}.v_proj", (*path, "v_proj"), d, k * e, cfg.qkv_bias, i)
    out += _linear(f"{key}.o_proj", (*path, "o_proj"), h * e, d, cfg.o_bias, i)
    if cfg.attention_sinks:
        out.append(HFTensor(f"{key}.sinks", (h,), (Target((*path, "sinks"), (h,)),), i))
    if cfg.qk_norm != "none":
        q_dim, k_dim = (e, e) if cfg.qk_norm == "head" else (h * e, k * e)
        out.append(_vector(f"{key}.q_norm", (*path, "q_norm"), q_dim, i))
        out.append(_vector(f"{key}.k_norm", (*path, "k_norm"), k_dim, i))
    return out


def hf_tensors(cfg: MoEConfig, layout: HFLayout = "hub", prefix: str = "model.") -> list[HFTensor]:
    """Every tensor of a checkpoint of this config, in a streaming-friendly order (layer by layer); `prefix`:
    where the language model's tensors are (`LANGUAGE_MODEL_PREFIX` in a vision-language checkpoint)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    f = cfg.expert_intermediate_size
    tensors = [HFTensor(f"{prefix}embed_tokens.weight", (v, d), (Target(("embed", "embedding"), (v, d)),))]
    names = HUB_NAMES[cfg.family]
    moe = _moe_prefix(cfg, layout)
    for i in range(cfg.num_layers):
        p, lp = f"{prefix}layers.{i}", ("layers", i)
        tensors += _norm(f"{p}.input_layernorm", (*lp, "input_norm"), cfg, i)
        tensors += _attention(cfg, i, prefix)
        tensors += _norm(f"{p}.post_attention_layernorm", (*lp, "post_norm"), cfg, i)
        if cfg.family == "gpt_oss":
            tensors += _gpt_oss_moe(cfg, i, layout)
            continue
        if not cfg.moe_layers[i]:
            tensors += _swiglu(
                f"{p}.mlp",
                (*lp, "mlp"),
                d,
                cfg.dense_intermediate_size,
                GATE_UP_DOWN,
                i,
            )
            continue
        router = f"{p}.{moe}.{_router_name(cfg, layout)}"
        tensors += _linear(router, (*lp, "router"), d, cfg.num_experts, False, i)
        if cfg.score_correction_bias:
            j = cfg.num_experts
            target = Target((*lp, "score_correction"), (j,))
            tensors.append(HFTensor(f"{router}.e_score_correction_bias", (j,), (target,), i))
        if cfg.shared_expert_intermediate_size:
            tensors += _swiglu(
                f"{p}.{names.shared}",
                (*lp, "shared_expert"),
                d,
                cfg.shared_expert_intermediate_size,
                GATE_UP_DOWN,
                i,
            )
        if cfg.shared_expert_gate:
            tensors += _linear(f"{p}.mlp.shared_expert_gate", (*lp, "shared_gate"), d, 1, False, i)
        if layout == "hub":
            for j in range(cfg.num_experts):
                tensors += _swiglu(f"{p}.{moe}.experts.{j}", ("experts", i, j), d, f, names.expert, i, j)
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
    tensors += _norm(f"{prefix}norm", ("final_norm",), cfg, -1)
    if not cfg.tie_word_embeddings:
        tensors += _linear("lm_head", ("lm_head",), d, v, cfg.lm_head_bias, -1)
    return tensors


def _gpt_oss_moe(cfg: MoEConfig, i: int, layout: HFLayout) -> list[HFTensor]:
    """gpt-oss's router (with a bias) and its experts, stacked per layer: float (`gate_up_proj` `[J, D, 2F]`,
    gate and up interleaved along 2F, `down_proj` `[J, F, D]`, both `[in, out]`), or MXFP4 blocks and scales
    (rows `[out]` in the checkpoint's order, `models/mxfp4.py`), each with its biases."""
    d, f, n = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    p, j_all = f"model.layers.{i}.mlp", range(n)
    tensors = _linear(f"{p}.router", ("layers", i, "router"), d, n, True, i)

    def stacked(key: str, shape: tuple[int, ...], parts: list[tuple[tuple, tuple, str]]) -> HFTensor:
        targets = tuple(
            Target(("experts", i, j, *names), part_shape, transform, j)
            for names, part_shape, transform in parts
            for j in j_all
        )
        return HFTensor(f"{p}.experts.{key}", (n, *shape), targets, i)

    if layout == "mxfp4":
        blocks, scales = (d // 32, 16), (d // 32,)
        tensors += [
            stacked(
                "gate_up_proj_blocks",
                (2 * f, *blocks),
                [
                    (("gate", "values"), (f, d // 2), "expert_even_rows"),
                    (("up", "values"), (f, d // 2), "expert_odd_rows"),
                ],
            ),
            stacked(
                "gate_up_proj_scales",
                (2 * f, *scales),
                [
                    (("gate", "scales"), (f, d // 32), "expert_even_rows"),
                    (("up", "scales"), (f, d // 32), "expert_odd_rows"),
                ],
            ),
            stacked("down_proj_blocks", (d, f // 32, 16), [(("down", "values"), (d, f // 2), "expert")]),
            stacked("down_proj_scales", (d, f // 32), [(("down", "scales"), (d, f // 32), "expert")]),
        ]
    else:
        tensors += [
            stacked(
                "gate_up_proj",
                (d, 2 * f),
                [(("gate",), (f, d), "expert_even_columns_t"), (("up",), (f, d), "expert_odd_columns_t")],
            ),
            stacked("down_proj", (f, d), [(("down",), (d, f), "expert_t")]),
        ]
    return tensors + [
        stacked(
            "gate_up_proj_bias",
            (2 * f,),
            [(("gate_bias",), (f,), "expert_even_rows"), (("up_bias",), (f,), "expert_odd_rows")],
        ),
        stacked("down_proj_bias", (d,), [(("down_bias",), (d,), "expert")]),
    ]


# Parameters kept in float32 whatever the model's dtype: DeepSeek-V3's score-correction bias (its checkpoints
# and transformers keep it so; it decides near-ties between experts).
FLOAT32_PARAMS = ("score_correction",)


def param_dtype(path: Path, dtype: np.dtype) -> np.dtype:
    """The dtype a float parameter is held in: the model's `dtype`, or float32 for `FLOAT32_PARAMS`."""
    return np.dtype(np.float32) if path[-1] in FLOAT32_PARAMS else np.dtype(dtype)


def detect_layout(keys: Iterable[str]) -> HFLayout:
    """MXFP4 if any tensor is a stacked `experts.gate_up_proj_blocks`; fused if any is a stacked
    `experts.gate_up_proj`; else hub."""
    keys = list(keys)
    if any(key.endswith("experts.gate_up_proj_blocks") for key in keys):
        return "mxfp4"
    return "fused" if any(key.endswith("experts.gate_up_proj") for key in keys) else "hub"


def detect_prefix(keys: Iterable[str]) -> str:
    """`LANGUAGE_MODEL_PREFIX` if the checkpoint keeps its language model there (a vision-language model's),
    else `model.`."""
    return LANGUAGE_MODEL_PREFIX if any(k.startswith(LANGUAGE_MODEL_PREFIX) for k in keys) else "model."


def not_converted(cfg: MoEConfig, keys: Iterable[str]) -> dict[str, int]:
    """{what: how many tensors} of `keys` that belong to parts of the checkpoint the family's model leaves out
    (`NOT_CONVERTED`)."""
    parts = NOT_CONVERTED.get(cfg.family, {})
    counts: dict[str, int] = {}
    for key in keys:
        what = next((name for prefix, name in parts.items() if key.startswith(prefix)), None)
        if what is not None:
            counts[what] = counts.get(what, 0) + 1
    return counts


def apply_transform(array: np.ndarray, target: Target) -> np.ndarray:
    """HF tensor -> our parameter (a new contiguous array, or the array itself when it already is one)."""
    if target.transform == "copy":
        return np.ascontiguousarray(array)
    f = target.shape[0] if target.transform != "fused_down" else target.shape[1]
    j = target.expert
    sliced = {
        "fused_gate": lambda: array[j, :f, :],
        "fused_up": lambda: array[j, f:, :],
        "fused_down": lambda: array[j],
        "expert": lambda: array[j],
        "expert_even_rows": lambda: array[j, 0::2],
        "expert_odd_rows": lambda: array[j, 1::2],
        "expert_even_columns_t": lambda: array[j][:, 0::2].T,
        "expert_odd_columns_t": lambda: array[j][:, 1::2].T,
        "expert_t": lambda: array[j].T,
    }[target.transform]()
    return np.ascontiguousarray(sliced).reshape(target.shape)


def to_hf(cfg: MoEConfig, params: Mapping[Path, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters (flat, by path) -> HF hub-layout tensors, the inverse of the loading table."""
    if cfg.family == "gpt_oss":
        raise ValueError("exporting gpt_oss to Hugging Face tensors is not implemented (fused experts)")
    out = {}
    for tensor in hf_tensors(cfg, "hub"):
        (target,) = tensor.targets
        out[tensor.key] = np.asarray(params[target.path])
    return out
