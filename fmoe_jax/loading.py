"""`load_model`: from a Hugging Face directory, a converted fmoe_jax checkpoint, or a shipped model's name.

Returns a `Model`, the handle `generate` and `forward` take. Weights stream in one tensor at a time;
with an `OffloadConfig`, routed experts go to host memory and the offload engine serves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import numbers
import os
import threading
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fmoe_jax.checkpoint.hf import CheckpointError, HFCheckpoint
from fmoe_jax.models import MoECausalLM, MoEConfig, abstract_model, quant
from fmoe_jax.models.moe import Kernel
from fmoe_jax.models.quant import ExpertQuantization, expert_quantization, is_expert_matrix, quantized_params
from fmoe_jax.offload.config import OffloadConfig

from .engines import Engine
from .engines.resident import ResidentEngine

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


@dataclasses.dataclass
class Model:
    """A loaded model: its config, weights (an NNX module), tokenizer and the engine that serves it.

    Safe to share between threads: `generate` and `forward` hold the model for the whole call (`serving`),
    so calls on one model run one after another, and calls after `close()` raise.
    """

    config: MoEConfig
    module: MoECausalLM
    engine: Engine
    tokenizer: Any = None
    source: str = ""
    eos_token_ids: tuple[int, ...] = ()
    offload: Any = None
    _lock: Any = dataclasses.field(default_factory=threading.RLock, init=False, repr=False, compare=False)
    _closed: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @contextlib.contextmanager
    def serving(self) -> Iterator[Any]:
        """Holds the model for one call (other threads' calls wait) and yields its engine."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the model from {self.source} is closed; load it again to use it")
            yield self.engine

    @property
    def pad_token_id(self) -> int:
        cfg = self.config
        if cfg.pad_token_id is not None:
            return cfg.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def close(self) -> None:
        """Stops background threads of the offload policy and saves its state (once; waits for a call in
        progress). Later `generate` / `forward` calls raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shipped_models() -> list[str]:
    """Names `load_model` accepts in place of a path (models that ship inside the package)."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").exists())


def resolve(path_or_name: str | os.PathLike) -> Path:
    path = Path(path_or_name)
    if path.exists():
        return path
    if isinstance(path_or_name, str) and (SHIPPED_DIR / path_or_name / "config.json").exists():
        return SHIPPED_DIR / path_or_name
    names = ", ".join(shipped_models()) or "none"
    raise FileNotFoundError(
        f"{path_or_name!s} is neither an existing path nor a shipped model name (shipped: {names}). "
        "Hub checkpoints are not downloaded: pass a local directory (convert it with `fmoe-convert`)."
    )


def nest(flat: dict[tuple, Any]) -> dict:
    """{("a", 0, "b"): x} -> {"a": {0: {"b": x}}}, the pure-dict form NNX states use."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@functools.cache
def _abstract_split(
    cfg: MoEConfig, dtype: jnp.dtype, quantization: ExpertQuantization | None = None
) -> tuple[Any, Any]:
    """Graph and abstract state of a model (tracing the random init takes seconds for large models)."""
    return nnx.split(abstract_model(cfg, dtype=dtype, expert_quantization=quantization))


def assemble(
    cfg: MoEConfig, dtype: jnp.dtype, flat: dict[tuple, Any], quantization: ExpertQuantization | None = None
) -> MoECausalLM:
    """Builds the module from parameters by path (arrays already placed where they should live)."""
    graphdef, cached = _abstract_split(cfg, jnp.dtype(dtype), quantization)
    state = jax.tree.map(lambda leaf: leaf, cached)  # a fresh container: the cached one stays abstract
    expected = {tuple(p) for p, _ in nnx.to_flat_state(state)}
    if expected != set(flat):
        missing, extra = (
            sorted(map(str, expected - set(flat)))[:5],
            sorted(map(str, set(flat) - expected))[:5],
        )
        raise CheckpointError(f"parameters do not match the model: missing {missing}, unexpected {extra}")
    nnx.replace_by_pure_dict(state, nest(flat))
    return nnx.merge(graphdef, state)


def load_tokenizer_if_any(directory: Path):
    if not any(
        (directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:  # transformers raises many types; the user needs the file and the reason
        raise CheckpointError(
            f"{directory}: tokenizer files are present but could not be loaded: {err}"
        ) from err


def generation_eos(directory: Path, cfg: MoEConfig) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if path.exists():
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            return (value,) if isinstance(value, int) else tuple(value)
    return cfg.eos_token_ids


def _dtype_arg(dtype: Any, default: np.dtype) -> jnp.dtype:
    if dtype is None:
        return jnp.dtype(default)
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}") from None


def load_hf_params(
    ckpt: HFCheckpoint, dtype: jnp.dtype, place, quantization: ExpertQuantization | None = None
) -> dict[tuple, Any]:
    """Streams a HF checkpoint into {path: placed array}; `place(path, np_array)` puts one tensor. With
    `quantization`, each routed expert matrix is quantized (from its `dtype` cast) as it streams past."""
    flat = {}
    for _, target, value in ckpt.params(np.dtype(dtype)):
        if quantization is not None and is_expert_matrix(target.path):
            for path, part in quantized_params(target.path, value, quantization).items():
                flat[path] = place(path, part)
        else:
            flat[target.path] = place(target.path, value)
    return flat


QuantizationRequest = tuple[Any, Any]  # (expert_quantization, quantization_group_size) as the user gave them


def quantization_request(
    offload: Any, expert_quantization: str | None, quantization_group_size: int | None
) -> QuantizationRequest:
    """The quantization asked for, through `load_model`'s arguments or the `OffloadConfig` (not both
    differently). Checked here, before anything is read; the checkpoint's own setting is settled later."""
    asked = (expert_quantization, quantization_group_size)
    if offload is not None:
        config = (
            getattr(offload, "expert_quantization", None),
            getattr(offload, "quantization_group_size", None),
        )
        if asked != (None, None) and config != (None, None) and asked != config:
            raise ValueError(
                f"load_model(expert_quantization={asked[0]!r}, quantization_group_size={asked[1]!r}) "
                f"conflicts with the OffloadConfig's expert_quantization={config[0]!r}, "
                f"quantization_group_size={config[1]!r}; give the setting in one place"
            )
        asked = config if asked == (None, None) else asked
    quant.expert_quantization(*asked)  # an unknown kind or a bad group size fails now
    return asked


def expert_quantization_of(
    asked: QuantizationRequest, stored: ExpertQuantization | None, source: str = ""
) -> ExpertQuantization | None:
    """The experts' storage: as the checkpoint holds them, or as asked (a float checkpoint quantizes while
    loading). A quantized checkpoint loads only as itself: another kind or group size is an error; MXFP4
    is only ever kept, as a checkpoint publishes it."""
    kind, group_size = asked
    if stored is None:
        if kind == "mxfp4":
            raise ValueError(
                f"{source}: expert_quantization='mxfp4' keeps experts a checkpoint stores in MXFP4 (gpt-oss "
                "publishes them so); this checkpoint's experts are not, and fmoe_jax does not produce MXFP4: "
                "ask 'int8' or 'int4', or None"
            )
        return expert_quantization(kind, group_size)
    if kind is None and group_size is None:
        return stored
    if kind != stored.kind or (group_size is not None and group_size != stored.group_size):
        raise ValueError(
            f"{source}: the checkpoint stores its experts as {stored.kind} with quantization_group_size="
            f"{stored.group_size}, but expert_quantization={kind!r}, quantization_group_size={group_size!r} "
            f"was asked; load it with expert_quantization={stored.kind!r} (or None), or convert it again"
        )
    return stored


def check_load_arguments(offload: Any, kernel: Any) -> None:
    """TypeError / ValueError naming `offload` or `kernel` when `load_model` could not serve with them; the
    engines would otherwise fail later, at the first `generate`, with a raw error."""
    if offload is not None and not isinstance(offload, OffloadConfig):
        hint = f"fj.OffloadConfig(**{offload!r})" if isinstance(offload, dict) else "fj.OffloadConfig(...)"
        raise TypeError(
            f"offload must be None or an fmoe_jax.OffloadConfig, got {type(offload).__name__} "
            f"{offload!r:.80}; pass offload={hint:.100}"
        )
    if offload is not None:
        for name in ("cache_experts", "cache_bytes", "prefetch_distance", "max_inflight"):
            value = getattr(offload, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"OffloadConfig({name}=...) must be an int, got {value!r}")
    kernels = typing.get_args(Kernel)
    if kernel not in kernels:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, kernels))}, got {kernel!r}")


def load_model(
    path_or_name: str | os.PathLike,
    offload: Any = None,
    *,
    dtype: Any = None,
    kernel: Kernel = "auto",
    verify: bool = False,
    expert_quantization: str | None = None,
    quantization_group_size: int | None = None,
) -> Model:
    """Loads a model for `generate` / `forward`.

    Args:
      path_or_name: a Hugging Face model directory (safetensors), a directory written by `fmoe-convert`,
        or the name of a shipped model (see `shipped_models()`).
      offload: None for resident serving, or an `OffloadConfig` to keep routed experts in host memory.
      dtype: parameter dtype; defaults to the checkpoint's.
      kernel: expert-mixture kernel ("auto" picks per shape and backend).
      expert_quantization: None, "int8" or "int4": routed experts stored quantized (`models/quant.py`),
        quantized one at a time while loading unless the checkpoint already holds them so (then it must
        agree, or be left None). For offloading, `OffloadConfig(expert_quantization=...)` says the same.
        Experts a checkpoint publishes in MXFP4 (gpt-oss) load as stored ("mxfp4", or None).
      quantization_group_size: inputs sharing one scale (default 64; must divide the hidden size and the
        expert intermediate size).
      verify: for a converted checkpoint, compare every file's sha256 with its manifest before loading
        (reads the checkpoint once more); otherwise only the weights' sizes are compared, which catches
        files truncated or replaced since the conversion, and the small files beside them (config.json,
        tokenizer) are always hashed. A Hugging Face directory has no manifest; its safetensors headers
        are always checked against the files' sizes.
    Raises:
      TypeError: `offload` is not an `OffloadConfig`.
      CheckpointError: a file is missing, corrupt or differs from the manifest (the message names it).
      ValueError: an unknown kernel, an `OffloadConfig` budget that is not an int, an unknown quantization,
        a group size that does not divide an expert's input dimension,
        or a setting that conflicts with a quantized checkpoint's (the message names the values).
    """
    check_load_arguments(offload, kernel)
    asked = quantization_request(offload, expert_quantization, quantization_group_size)
    directory = resolve(path_or_name)
    from fmoe_jax.checkpoint import orbax_io  # local import: orbax is heavy and only needed here

    place = functools.partial(param_sharding, offload=offload)
    if orbax_io.is_converted(directory):
        cfg, dtype, flat, quantization = restore_converted(directory, place, dtype, verify, asked)
    else:
        cfg, dtype, flat, quantization = read_hf(directory, place, dtype, asked)
    return build(
        cfg,
        dtype,
        flat,
        offload,
        tokenizer=load_tokenizer_if_any(directory),
        source=str(directory),
        eos=generation_eos(directory, cfg),
        kernel=kernel,
        quantization=quantization,
    )


Loaded = tuple[MoEConfig, jnp.dtype, dict[tuple, Any], ExpertQuantization | None]  # what `build` takes


def read_hf(directory: Path, place: Any, dtype: Any, asked: QuantizationRequest) -> Loaded:
    """A Hugging Face directory's parameters, each streamed to `place(path)` (quantized when asked)."""
    ckpt = HFCheckpoint(directory)
    cfg = ckpt.config
    quantization = expert_quantization_of(asked, ckpt.expert_storage, str(directory))
    if quantization is not None:
        quantization.check_model(cfg.hidden_size, cfg.expert_intermediate_size)
    dtype = _dtype_arg(dtype, ckpt.stored_dtype())
    flat = load_hf_params(ckpt, dtype, lambda path, value: jax.device_put(value, place(path)), quantization)
    return cfg, dtype, flat, quantization


def restore_converted(
    directory: Path, place: Any, dtype: Any, verify: bool, asked: QuantizationRequest
) -> Loaded:
    """A directory written by `fmoe-convert`: the request settled against its manifest, then its parameters
    restored where `place(path)` says (`orbax_io.restore_params` checks the files)."""
    from fmoe_jax.checkpoint import orbax_io

    manifest, cfg, _ = orbax_io.open_converted(directory)
    quantization = expert_quantization_of(asked, manifest.quantization, str(directory))
    if quantization is not None:
        quantization.check_model(cfg.hidden_size, cfg.expert_intermediate_size)
    dtype = _dtype_arg(dtype, jnp.dtype(manifest.dtype))
    cfg, dtype, flat = orbax_io.restore_params(
        directory, sharding=place, dtype=dtype, verify=verify, quantization=quantization
    )
    return cfg, dtype, flat, quantization


def param_sharding(path: tuple, offload: Any) -> jax.sharding.Sharding:
    """Where a parameter lives: routed experts in pinned host memory when offloading, the rest on device."""
    memory = "pinned_host" if offload is not None and path[0] == "experts" else "device"
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=memory)


def build(
    cfg: MoEConfig,
    dtype: jnp.dtype,
    flat: dict[tuple, Any],
    offload: Any,
    *,
    tokenizer: Any,
    source: str,
    eos: tuple[int, ...],
    kernel: Kernel,
    quantization: ExpertQuantization | None = None,
) -> Model:
    """The `Model` for placed parameters (see `param_sharding`): resident, or served by the offload engine."""
    module = assemble(cfg, dtype, flat, quantization)
    if offload is None:
        engine = ResidentEngine(module, kernel=kernel)
    else:
        from .engines.offload import OffloadEngine

        engine = OffloadEngine(module, offload, kernel=kernel)
    return Model(cfg, module, engine, tokenizer, source, eos, offload)


def from_module(module: MoECausalLM, *, tokenizer: Any = None, kernel: Kernel = "auto") -> Model:
    """Wraps an in-memory module (e.g. fresh from training) as a resident `Model`."""
    return Model(
        module.config,
        module,
        ResidentEngine(module, kernel=kernel),
        tokenizer,
        "<memory>",
        module.config.eos_token_ids,
    )
