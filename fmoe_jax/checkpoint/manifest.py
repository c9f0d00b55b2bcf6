"""The manifest of a converted checkpoint (`fmoe_manifest.json`): what it holds, where it came from, and
the size and sha256 of every file, so that `fmoe-convert verify` can tell an intact checkpoint from one
whose files were altered or truncated. Written by `fmoe_jax.convert.cli`, read by `orbax_io` and `verify`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fmoe_jax.models.quant import ExpertQuantization

from .hf import CheckpointError

MANIFEST_NAME = "fmoe_manifest.json"
FORMAT_NAME = "fmoe-jax-orbax"
# 2: matrices stored [out, in] (version 1 stored them [in, out]); 3: routed experts stored quantized
# (`expert_quantization`). A checkpoint of float experts is still written as version 2, which earlier
# fmoe-jax releases read; one with quantized experts as 3, which they refuse by its version.
FORMAT_VERSION = 3
FLOAT_FORMAT_VERSION = 2
READABLE_VERSIONS = (2, 3)
HASH_CHUNK_BYTES = 8 << 20


class Interrupted(Exception):
    """Hashing was stopped because the conversion is being abandoned."""


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """Size in bytes and sha256 (hex) of one file."""

    size: int
    sha256: str


@dataclasses.dataclass
class Manifest:
    """Everything `load_model` and `verify` need to know about a converted checkpoint besides its config.

    `items` maps an orbax item (a subdirectory) to what it holds: `{"kind": "dense"}` or
    `{"kind": "experts", "layer": l}`, with its parameter bytes. `files` lists every output file (relative
    to the checkpoint directory, the manifest itself excepted); `source_files` the Hugging Face files read.
    `expert_quantization` is None (experts in `dtype`) or `{"kind": "int8" | "int4", "group_size": n}`;
    `bytes_per_expert` counts the experts as stored (values and scales).
    """

    family: str
    dtype: str
    num_layers: int
    num_experts: int
    moe_layers: list[int]
    bytes_per_expert: int
    param_bytes: int
    items: dict[str, dict[str, Any]]
    source_dir: str
    source_layout: str
    source_dtype: str
    source_files: dict[str, FileRecord]
    files: dict[str, FileRecord]
    converter: str
    created: str
    format: str = FORMAT_NAME
    format_version: int = FLOAT_FORMAT_VERSION
    expert_quantization: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.expert_quantization is not None:  # an unknown kind or group size raises here
            ExpertQuantization(**self.expert_quantization)

    @property
    def quantization(self) -> ExpertQuantization | None:
        q = self.expert_quantization
        return None if q is None else ExpertQuantization(q["kind"], q["group_size"])

    def write(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return path

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        raw = _load(path)
        if raw.get("format_version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{path}: format version {raw.get('format_version')!r}, this fmoe-jax reads versions "
                f"{' and '.join(map(str, READABLE_VERSIONS))}; convert the model again with this version"
            )
        try:
            raw["files"] = _records(raw["files"])
            raw["source_files"] = _records(raw["source_files"])
            manifest = cls(**raw)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt manifest ({err!r}); re-run fmoe-convert") from None
        return manifest

    def item_dirs(self, directory: Path) -> list[Path]:
        return [Path(directory) / name for name in self.items]


def _load(path: Path) -> dict[str, Any]:
    """The manifest's JSON object, once it is known to be an fmoe-jax manifest (of any version)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; {path.parent} is not a checkpoint written by fmoe-convert"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: corrupt manifest ({err}); re-run fmoe-convert") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(
            f"{path}: not an fmoe-jax manifest (format {found!r}, expected {FORMAT_NAME!r})"
        )
    return raw


def _records(raw: dict[str, Any]) -> dict[str, FileRecord]:
    return {name: FileRecord(**record) for name, record in raw.items()}


def listed_files(directory: Path) -> dict[str, FileRecord]:
    """The files the manifest in `directory` lists, if fmoe-convert wrote it (format version 1 to current).

    `fmoe-convert --overwrite` replaces only such a directory. Raises `CheckpointError` saying why not.
    """
    path = Path(directory) / MANIFEST_NAME
    raw = _load(path)
    version = raw.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {version!r}, this fmoe-convert writes versions 1 to {FORMAT_VERSION}"
        )
    try:
        return _records(raw["files"])
    except (KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: corrupt manifest, no valid file list ({err!r})") from None


def hash_file(
    path: Path, *, on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None
) -> FileRecord:
    """Size and sha256 of a file, read in chunks (hashlib releases the GIL, so this overlaps other work).

    `stop` being set aborts with `Interrupted` between chunks.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            try:
                chunk = f.read(HASH_CHUNK_BYTES)
            except OSError as err:  # a read error (EIO) names no file by itself
                raise OSError(err.errno, err.strerror, str(path)) from None
            if not chunk:
                break
            if stop is not None and stop.is_set():
                raise Interrupted(str(path))
            digest.update(chunk)
            size += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return FileRecord(size, digest.hexdigest())


def files_under(directory: Path) -> list[Path]:
    """Every regular file below `directory`, sorted (symlinks are not followed)."""
    return sorted(p for p in Path(directory).rglob("*") if p.is_file() and not p.is_symlink())


def check_files(
    directory: Path,
    files: dict[str, FileRecord],
    *,
    hashes: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> list[str]:
    """Compares files against their records (sizes only unless `hashes`); returns one line per problem."""
    problems = []
    for name, record in files.items():
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists it with {record.size} bytes)")
            continue
        size = path.stat().st_size
        if size != record.size:
            problems.append(f"{path}: {size} bytes, the manifest says {record.size} (truncated or altered)")
            if on_bytes is not None and hashes:
                on_bytes(record.size)
            continue
        if not hashes:
            continue
        actual = hash_file(path, on_bytes=on_bytes)
        if actual.sha256 != record.sha256:
            problems.append(f"{path}: sha256 {actual.sha256[:16]}... differs from the manifest's (altered)")
    return problems


def verify_files(
    directory: Path,
    files: dict[str, FileRecord],
    *,
    hashes: bool,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Raises `CheckpointError` naming the first file that differs from the manifest (see `check_files`)."""
    problems = check_files(directory, files, hashes=hashes, on_bytes=on_bytes)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}; the checkpoint changed since it was converted")
