"""The expert-map store's files and its offline construction: `save` / `load` (one .npz with a JSON header,
written atomically, refused when built for another model), `check_writable` (refuses a path `save` could not
write, before any serving), `open_store` (the fmoe policy's store at `bind`) and `store_from_traces` (a store
built from recorded routing: offline mode). `ExpertMapStore.save`, `.load` and `.check_writable` call these.
"""

from __future__ import annotations

import collections
import json
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...files import unwritable, write_atomically

if TYPE_CHECKING:
    from .store import ExpertMapStore

# Rows per `add` when loading, so that loading never holds more than one chunk of temporaries.
_LOAD_CHUNK = 4096
_FORMAT = "fmoe-expert-map-store"
_VERSION = 1
SHAPE_FIELDS = ("num_layers", "num_experts", "embed_dim", "prefetch_distance")


def save(store: ExpertMapStore, path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Writes the stored maps to one .npz with a JSON header, atomically.

    `meta` says what the maps belong to (at least the model identity, e.g.
    {"model": "mistralai/Mixtral-8x7B-v0.1"}); it must be JSON-serialisable. L, J, H and d are written from
    the store itself. The file is written next to `path` and renamed over it, so a crash never leaves a
    half-written store behind.
    """
    clash = sorted(set(meta) & set(SHAPE_FIELDS + ("capacity", "size")))
    if clash:
        raise ValueError(f"meta must not set {clash}: the store writes these fields itself.")
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        **{name: getattr(store, name) for name in SHAPE_FIELDS},
        "capacity": store.capacity,
        "size": len(store),
        "meta": meta,
    }
    try:
        header_text = json.dumps(header, default=_json_default)
    except TypeError as err:
        raise ValueError(f"meta must be JSON-serialisable: {err}") from err
    extra = {f"attachment_{name}": np.asarray(a) for name, a in store.attachments.items()}
    write_atomically(
        path,
        lambda f: np.savez(f, header=np.array(header_text), embeds=store.embeds, maps=store.maps, **extra),
    )


def check_writable(path: str | os.PathLike) -> None:
    """Refuses, before any serving, a store path that `save` could not write at the end: a directory, a
    missing parent folder, or a folder this process may not write to."""
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(
            f"store_path {path}: {problem}; the learned store is saved there at close, so it must name a "
            "file in a folder this process can write."
        )


def load(
    cls: type[ExpertMapStore],
    path: str | os.PathLike,
    expected_meta: dict[str, Any],
    *,
    capacity: int | None,
    sketch_dim: int | None,
    rerank: int,
) -> ExpertMapStore:
    """Reads a store written by `save`, refusing one built for another model.

    `expected_meta` must give num_layers, num_experts, embed_dim and prefetch_distance, plus the fields the
    caller identifies the model by (e.g. "model"); every field it gives must equal the file's, otherwise
    ValueError names each mismatched field. `capacity` defaults to the saved one; `sketch_dim` and
    `rerank` are search settings, not part of the file.
    """
    missing = [name for name in SHAPE_FIELDS if name not in expected_meta]
    if missing:
        raise ValueError(f"expected_meta must give {missing} to check the store at {path} against.")
    header, embeds, maps, attachments = _read(path)
    _check_meta(path, header, expected_meta)
    store = cls(
        capacity=header["capacity"] if capacity is None else capacity,
        **{name: header[name] for name in SHAPE_FIELDS},
        sketch_dim=sketch_dim,
        rerank=rerank,
    )
    size = header["size"]
    expected_maps = (size, store.num_layers, store.num_experts)
    if embeds.shape != (size, store.embed_dim) or maps.shape != expected_maps:
        raise ValueError(
            f"{path} is corrupt: header says {size} maps, arrays are {embeds.shape} and {maps.shape}."
        )
    if size > store.capacity:
        raise ValueError(
            f"{path} holds {size} maps, more than capacity={store.capacity}; pass capacity >= {size}."
        )
    for start in range(0, size, _LOAD_CHUNK):
        store.add(embeds[start : start + _LOAD_CHUNK], maps[start : start + _LOAD_CHUNK])
    store.attachments = attachments
    return store


def _read(path: str | os.PathLike) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """A store file's header, embeddings, maps and attachments; a clear error for anything else."""
    if Path(path).is_dir():
        raise ValueError(f"expert map store {path} is a directory; store_path must name a file.")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "header" not in data:
                raise ValueError("it has no header")
            header = json.loads(str(data["header"]))
            embeds, maps = data["embeds"], data["maps"]
            attachments = {
                name.removeprefix("attachment_"): data[name]
                for name in data.files
                if name.startswith("attachment_")
            }
        if not isinstance(header, dict) or not isinstance(header.get("meta"), dict):
            raise ValueError("its header is not a store header")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"expert map store {path} cannot be read ({err}): it is not a file written by "
            "ExpertMapStore.save, or it is damaged. Delete it or point store_path elsewhere."
        ) from None
    if header.get("format") != _FORMAT or header.get("version") != _VERSION:
        raise ValueError(
            f"{path} has format {header.get('format')!r} version {header.get('version')!r}; "
            f"expected {_FORMAT!r} version {_VERSION}."
        )
    return header, embeds, maps, attachments


def _check_meta(path: str | os.PathLike, header: dict[str, Any], expected_meta: dict[str, Any]) -> None:
    saved_meta = header["meta"]
    mismatched = []
    for name, expected in expected_meta.items():
        saved = header[name] if name in SHAPE_FIELDS else saved_meta.get(name, "<absent>")
        if saved != json.loads(json.dumps(expected, default=_json_default)):
            mismatched.append(f"{name}: file has {saved!r}, expected {expected!r}")
    if mismatched:
        raise ValueError(
            f"expert map store {path} was built for a different model or setting "
            f"({'; '.join(mismatched)}). Point the store path elsewhere or delete the file to start "
            f"an empty store."
        )


def open_store(
    store: ExpertMapStore | None, path: str | None, ctx: Any, capacity: int, embed_dim: int
) -> ExpertMapStore:
    """The fmoe policy's store for the model of `ctx` (a `PolicyContext`): `store` as given, else loaded from
    `path`, else new with `capacity` maps. Refuses one of another shape, and a `path` the policy's `close`
    could not save to (now, not after serving)."""
    from .store import ExpertMapStore

    distance = min(ctx.prefetch_distance, ctx.num_layers)
    if path:
        ExpertMapStore.check_writable(path)
    if store is None and path and os.path.exists(path):
        shape = dict(num_layers=ctx.num_layers, num_experts=ctx.num_experts, embed_dim=embed_dim)
        meta = {"model": ctx.model_id, **shape, "prefetch_distance": distance}
        store = ExpertMapStore.load(path, meta, capacity=capacity)
    if store is None:
        store = ExpertMapStore(
            capacity=capacity,
            num_layers=ctx.num_layers,
            num_experts=ctx.num_experts,
            embed_dim=embed_dim,
            prefetch_distance=distance,
        )
    if (store.num_layers, store.num_experts, store.embed_dim) != (ctx.num_layers, ctx.num_experts, embed_dim):
        raise ValueError(
            f"expert-map store has L={store.num_layers}, J={store.num_experts}, H={store.embed_dim}; the "
            f"model needs L={ctx.num_layers}, J={ctx.num_experts}, H={embed_dim}"
        )
    return store


def store_from_traces(
    traces: Iterable[Any], *, capacity: int, prefetch_distance: int, followers: int = 0
) -> ExpertMapStore:
    """Offline mode: an expert-map store built from recorded routing traces (`RoutingTrace`s).

    Every token of every iteration contributes its embedding and its expert map, in trace order; with
    `followers` > 0 each map is also recorded as a follower of its request's previous `followers` tokens
    (`ExpertMapStore.add_future`, what the policy links online: the reuse hint's source). Routing
    recorded elsewhere without embeddings (`RoutingTrace.from_external`, `embed_dim` 0) gives a store of
    zero embeddings, one column wide, as the policy keeps online: trajectory matching alone
    (`semantic=False`) uses it.
    """
    from .store import ExpertMapStore

    traces = list(traces)
    meta = traces[0].meta
    store = ExpertMapStore(
        capacity=capacity,
        num_layers=meta["num_layers"],
        num_experts=meta["num_experts"],
        embed_dim=meta["embed_dim"] or 1,
        prefetch_distance=min(prefetch_distance, meta["num_layers"]),
    )
    for t, trace in enumerate(traces):
        for r, request in enumerate(trace.requests):
            recent: collections.deque[int] = collections.deque(maxlen=max(followers, 1))
            for i, it in enumerate(request.iterations):
                if it.probs is None:
                    raise ValueError(
                        f"store_from_traces: trace {t} request {r} iteration {i} has no router probabilities"
                    )
                embeds = it.embeds
                if embeds is None:
                    if meta["embed_dim"]:
                        raise ValueError(
                            f"store_from_traces: trace {t} request {r} iteration {i} has no embeddings, "
                            f"though the trace's embed_dim is {meta['embed_dim']}"
                        )
                    embeds = np.zeros((it.num_tokens, 1), np.float32)
                slots = store.add(embeds, it.probs)
                if followers:
                    for slot, token_map in zip(slots.tolist(), it.probs, strict=True):
                        if recent:
                            later = np.repeat(token_map[None], len(recent), 0)
                            store.add_future(np.fromiter(recent, np.int64), later)
                        recent.append(slot)
    return store


def _json_default(value: Any) -> Any:
    """Lets NumPy scalars (e.g. a config's np.int64) into the JSON header."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
