"""The converted checkpoint format: one orbax item per layer's dense weights and per layer's experts.

`fmoe_jax.convert.cli` writes (`write_items`) and verifies (`read_items`) it; `fmoe_jax.load_model` calls
`is_converted` / `restore_params`, which restores experts one at a time straight into pinned host memory.

A checkpoint directory holds `fmoe_manifest.json` (see `manifest.py`), the Hugging Face `config.json`,
`generation_config.json` and tokenizer files, and one orbax PyTree item per subdirectory:
  `dense`               embedding, final norm, LM head (keyed by our parameter path, e.g. `embed/embedding`)
  `dense_layer_LLL`     layer L without its routed experts (`attn/q_proj/weight`, `router/weight`, ...)
  `experts_layer_LLL`   routed experts of MoE layer L (`expert_JJJ/{gate,up,down}`, `[out, in]`; quantized
                        checkpoints hold `expert_JJJ/{gate,up,down}/{values,scales}`, see `models/quant.py`)
so that neither writing nor restoring needs more than one layer in memory.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from fmoe_jax.models import MoEConfig, config_from_hf
from fmoe_jax.models.quant import ExpertQuantization, is_expert_matrix, quantized_params

from .hf import CheckpointError, HFCheckpoint, read_json
from .keys import HFTensor, hf_tensors, param_dtype
from .manifest import MANIFEST_NAME, Manifest, verify_files

DENSE_ITEM = "dense"
ParamPath = tuple[str | int, ...]
Placement = Callable[[ParamPath], jax.sharding.Sharding]  # where each parameter is restored to
ItemKey = tuple[str, ...]  # a leaf's key path inside an orbax item (strings only)
Expected = dict[str, dict[ItemKey, tuple[ParamPath, tuple[int, ...]]]]


def dense_layer_item(layer: int) -> str:
    return f"dense_layer_{layer:03d}"


def experts_item(layer: int) -> str:
    return f"experts_layer_{layer:03d}"


def expert_key(expert: int) -> str:
    return f"expert_{expert:03d}"


def is_converted(directory: str | Path) -> bool:
    """True for a directory written by `fmoe-convert` (it has a manifest; intact or not, loading will say)."""
    return (Path(directory) / MANIFEST_NAME).is_file()


def _reader() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))


def _writer() -> ocp.Checkpointer:
    # Zarr3 arrays in OCDBT, uncompressed: zstd costs more time than it saves on trained weights. Saving
    # is synchronous and nothing mutates the arrays meanwhile, so orbax's defensive copy of NumPy inputs
    # (a second copy of the whole item in memory, measured) is turned off.
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False, type_handler_registry=registry)
    )


def item_of(path: ParamPath) -> str:
    """The item a parameter is stored in."""
    if path[0] == "experts":
        return experts_item(int(path[1]))
    if path[0] == "layers":
        return dense_layer_item(int(path[1]))
    return DENSE_ITEM


def item_key(path: ParamPath) -> ItemKey:
    """Our parameter path -> its key inside its item (per-layer items drop the `(kind, layer)` prefix)."""
    if path[0] == "experts":
        _, _, expert, *names = path
        return (expert_key(int(expert)), *map(str, names))
    if path[0] == "layers":
        return tuple(str(k) for k in path[2:])
    return tuple(str(k) for k in path)


def item_of_tensor(tensor: HFTensor) -> str:
    """The item a HF tensor's parameters go to (all targets of one tensor share it)."""
    return item_of(tensor.targets[0].path)


def expected_items(cfg: MoEConfig, quantization: ExpertQuantization | None = None) -> Expected:
    """Item name -> {key in the item: (our parameter path, shape)}, in write order, from the key tables
    (`assemble` checks those against the model; tracing `abstract_model` here would cost seconds). With
    `quantization`, each routed expert matrix is its `values` and `scales` (biases stay as they are)."""
    items: Expected = {DENSE_ITEM: {}}
    for layer in range(cfg.num_layers):
        items[dense_layer_item(layer)] = {}
        if cfg.moe_layers[layer]:
            items[experts_item(layer)] = {}
    for tensor in hf_tensors(cfg, "hub"):
        for target in tensor.targets:
            path, shape = target.path, target.shape
            if quantization is not None and is_expert_matrix(path):
                for part, part_shape in (
                    ("values", quantization.values_shape(*shape)),
                    ("scales", quantization.scales_shape(*shape)),
                ):
                    items[item_of(path)][item_key((*path, part))] = ((*path, part), part_shape)
            else:
                items[item_of(path)][item_key(path)] = (path, shape)
    return items


def stored_dtype(path: ParamPath, dtype: np.dtype, quantization: ExpertQuantization | None) -> np.dtype:
    """The dtype a parameter is stored and restored in: a quantized expert's values keep their integer
    type, MXFP4 scales too; everything else (other scales included) is in the model's `dtype`, but for
    float32 parameters (`keys.param_dtype`)."""
    if quantization is not None and path[0] == "experts" and path[-1] == "values":
        return quantization.storage_dtype
    if quantization is not None and path[0] == "experts" and path[-1] == "scales":
        return quantization.scales_dtype(dtype)
    return param_dtype(path, dtype)


def _item_info(name: str, flat: dict[ItemKey, np.ndarray]) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": name.split("_layer_")[0], "arrays": len(flat)}
    if "_layer_" in name:
        info["layer"] = int(name.rsplit("_", 1)[1])
    info["bytes"] = sum(v.nbytes for v in flat.values())
    return info


def _nest(flat: dict[ItemKey, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return out


def _flatten(tree: Any, prefix: ItemKey = ()) -> dict[ItemKey, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[ItemKey, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, (*prefix, str(key))))
    return out


def _save(ckptr: ocp.Checkpointer, path: Path, flat: dict[ItemKey, np.ndarray]) -> None:
    try:
        ckptr.save(path.absolute(), args=ocp.args.PyTreeSave(_nest(flat)))
    except OSError:
        raise
    except Exception as err:  # tensorstore reports I/O failures (disk full, EIO) as ValueError / RuntimeError
        raise _os_error(err, path) from err


def _os_error(err: Exception, path: Path) -> OSError:
    """The OS error inside a tensorstore failure, for the item at `path`.

    Tensorstore's message runs to kilobytes (it embeds the whole store spec) and ends with
    `[os_error_code='28']` when the OS refused; the code alone says what happened (errno 28: no space left
    on device). Without a code, the first sentence before the spec is kept."""
    text = str(err)
    code = re.search(r"os_error_code='(\d+)'", text)
    if code is not None:
        return OSError(int(code[1]), os.strerror(int(code[1])), str(path))
    summary = text.split(" [tensorstore_spec=", 1)[0]
    summary = summary if len(summary) <= 300 else summary[:300] + "..."
    return OSError(errno.EIO, f"writing the orbax item failed: {summary}", str(path))


def write_items(
    ckpt: HFCheckpoint,
    out_dir: Path,
    dtype: np.dtype,
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_item: Callable[[str], None] = lambda name: None,
    quantization: ExpertQuantization | None = None,
) -> dict[str, dict[str, Any]]:
    """Streams a HF checkpoint into orbax items under `out_dir`; returns the manifest's `items`.

    Memory: the embedding/head item, then one layer (its dense part and its experts) at a time, each read,
    written, dropped. `on_bytes` gets the source bytes of each tensor read (progress); `on_item` the name
    of each item once it is on disk. With `quantization`, routed expert matrices are cast to `dtype` and
    quantized (values and scales), exactly as `load_model` quantizes a float checkpoint.
    """
    names = list(expected_items(ckpt.config))
    groups = [[DENSE_ITEM]] + [
        [n for n in names if n.endswith(f"_layer_{layer:03d}")] for layer in range(ckpt.config.num_layers)
    ]
    ckptr = _writer()
    items: dict[str, dict[str, Any]] = {}
    try:
        for group in groups:
            buffers: dict[str, dict[ItemKey, np.ndarray]] = {name: {} for name in group}
            for tensor, target, value in ckpt.params(dtype, where=lambda t, g=group: item_of_tensor(t) in g):
                if quantization is not None and is_expert_matrix(target.path):
                    for path, part in quantized_params(target.path, value, quantization).items():
                        buffers[item_of(path)][item_key(path)] = part
                else:
                    buffers[item_of(target.path)][item_key(target.path)] = value
                on_bytes(value.size * ckpt.location[tensor.key].entries[tensor.key][0].itemsize)
                del value
            for name in group:
                flat = buffers.pop(name)
                _save(ckptr, out_dir / name, flat)
                items[name] = _item_info(name, flat)
                del flat
                on_item(name)
    finally:
        ckptr.close()
    return items


def check_item(
    ckptr: ocp.Checkpointer, path: Path, expected: dict[ItemKey, tuple[ParamPath, tuple[int, ...]]]
) -> None:
    """Raises `CheckpointError` unless the item's metadata lists exactly the expected arrays and shapes."""
    try:
        tree = ckptr.metadata(path.absolute()).item_metadata.tree
    except Exception as err:  # orbax raises FileNotFoundError, ValueError, KeyError... for damaged items
        raise CheckpointError(f"{path}: not a readable orbax item ({type(err).__name__}: {err})") from None
    found = {key: tuple(meta.shape) for key, meta in _flatten(dict(tree)).items()}
    missing = sorted("/".join(k) for k in expected.keys() - found.keys())
    unexpected = sorted("/".join(k) for k in found.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(f"{path}: arrays missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, (_, shape) in expected.items():
        if found[key] != shape:
            raise CheckpointError(
                f"{path}: array {'/'.join(key)} has shape {found[key]}, the config implies {shape}"
            )


def _restore(
    ckptr: ocp.Checkpointer, path: Path, targets: dict[ItemKey, Any] | None, args: dict[ItemKey, Any]
) -> dict[ItemKey, Any]:
    """Restores an item (all of it when `targets` is None, else only the keys of `targets`)."""
    item = None if targets is None else _nest(targets)
    try:
        restored = ckptr.restore(
            path.absolute(),
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=_nest(args), partial_restore=item is not None
            ),
        )
    except Exception as err:  # tensorstore: truncated or altered data files surface as ValueError etc.
        raise CheckpointError(
            f"{path}: cannot restore ({type(err).__name__}: {err}); run `fmoe-convert verify` on it"
        ) from None
    return _flatten(restored)


def open_converted(directory: Path) -> tuple[Manifest, MoEConfig, Expected]:
    """Manifest, model config and expected items of a converted checkpoint, checked against each other.

    The files beside the orbax items (config.json, generation_config.json, the tokenizer's) are small and
    decide the model's output: their sha256 is checked against the manifest every time, so that an edit of
    the same size (a top-k, an epsilon) is refused, naming the file."""
    manifest = Manifest.read(directory)
    side = {n: r for n, r in manifest.files.items() if n.split("/", 1)[0] not in manifest.items}
    verify_files(directory, side, hashes=True)
    cfg = config_from_hf(read_json(directory / "config.json", "config.json"))
    expected = expected_items(cfg, manifest.quantization)
    if cfg.family != manifest.family or list(expected) != list(manifest.items):
        raise CheckpointError(
            f"{directory}: config.json ({cfg.family}, {len(expected)} items) does not match the manifest "
            f"({manifest.family}, {len(manifest.items)} items); convert the model again"
        )
    return manifest, cfg, expected


def _by_expert(entries: dict[ItemKey, Any]) -> list[dict[ItemKey, Any]]:
    groups: dict[str, dict[ItemKey, Any]] = {}
    for key, value in entries.items():
        groups.setdefault(key[0], {})[key] = value
    return [groups[k] for k in sorted(groups)]


def restore_params(
    directory: str | Path,
    *,
    sharding: Placement,
    dtype: Any = None,
    verify: bool = False,
    quantization: ExpertQuantization | None = None,
) -> tuple[MoEConfig, jnp.dtype, dict[ParamPath, jax.Array]]:
    """Restores every parameter where `sharding(path)` says it lives.

    First every file is checked against the manifest: its size, and with `verify` its sha256 (which reads
    the checkpoint once more). Dense items go where they are placed, one restore each; each routed expert
    is restored on its own straight into its sharding's memory (orbax places arrays with the target
    sharding's memory kind, `pinned_host` included; checked on CPU with jax 0.10.2), so loading never holds
    more than one expert in transit. Restoring as another `dtype` (default: the stored one) casts on the way
    in (a quantized expert's values keep their type). Experts stored quantized load as they are; with
    `quantization`, a float checkpoint's experts are restored to the host one at a time, quantized and
    placed. Returns (config, dtype, {path: array}).
    """
    directory = Path(directory)
    manifest, cfg, expected = open_converted(directory)
    stored = manifest.quantization
    verify_files(directory, manifest.files, hashes=verify)
    dtype = jnp.dtype(manifest.dtype if dtype is None else dtype)
    ckptr = _reader()
    flat: dict[ParamPath, jax.Array] = {}
    try:
        for name, entries in expected.items():
            check_item(ckptr, directory / name, entries)
            experts = name.startswith("experts_")
            for group in _by_expert(entries) if experts else [entries]:
                if experts and quantization is not None and stored is None:
                    flat.update(
                        _restore_quantizing(ckptr, directory / name, group, dtype, quantization, sharding)
                    )
                    continue
                targets, args = {}, {}
                for key, (path, shape) in group.items():
                    kind = stored_dtype(path, dtype, stored)
                    targets[key] = jax.ShapeDtypeStruct(shape, kind, sharding=sharding(path))
                    args[key] = ocp.ArrayRestoreArgs(sharding=sharding(path), global_shape=shape, dtype=kind)
                restored = _restore(ckptr, directory / name, targets, args)
                for key, (path, _) in group.items():
                    flat[path] = restored[key]
    finally:
        ckptr.close()
    return cfg, dtype, flat


def _restore_quantizing(
    ckptr: ocp.Checkpointer,
    path: Path,
    group: dict[ItemKey, tuple[ParamPath, tuple[int, ...]]],
    dtype: jnp.dtype,
    quantization: ExpertQuantization,
    sharding: Placement,
) -> dict[ParamPath, jax.Array]:
    """One float expert restored to the host in `dtype`, quantized, and placed (values and scales; its
    biases, if any, as they are)."""
    args = {key: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(dtype)) for key in group}
    targets = {key: np.zeros(shape, np.dtype(dtype)) for key, (_, shape) in group.items()}
    restored = _restore(ckptr, path, targets, args)
    out = {}
    for key, (param, _) in group.items():
        value = restored.pop(key)
        parts = quantized_params(param, value, quantization) if is_expert_matrix(param) else {param: value}
        for part_path, part in parts.items():
            out[part_path] = jax.device_put(part, sharding(part_path))
    return out


def read_items(directory: Path, expected: Expected) -> Iterator[tuple[str, dict[ParamPath, np.ndarray]]]:
    """Yields (item name, {path: host array as stored}) one item at a time (for `verify`)."""
    ckptr = _reader()
    try:
        for name, entries in expected.items():
            check_item(ckptr, directory / name, entries)
            args = {key: ocp.RestoreArgs(restore_type=np.ndarray) for key in entries}
            restored = _restore(ckptr, directory / name, None, args)
            yield name, {path: restored[key] for key, (path, _) in entries.items()}
    finally:
        ckptr.close()
