"""Reading Hugging Face checkpoint directories: `config.json`, safetensors shards, tensors in our layout.

Used by `fmoe_jax.load_model` (HF directories), the conversion CLI and its `verify`. Safetensors files are
parsed here (the format is an 8-byte header length, a JSON header, raw little-endian data) so that every
defect is reported with the file and tensor it concerns, bfloat16 reads into NumPy through ml_dtypes, and
tensors stream one at a time without loading a shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from fmoe_jax.models import UnsupportedConfigError, config_from_hf
from fmoe_jax.models.config import MoEConfig

from .keys import HFTensor, Target, apply_transform, detect_layout, hf_tensors

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
SAFETENSORS_CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or not what its config says."""


class SafetensorsFile:
    """Header of one safetensors file, validated against the file's size; tensors are read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(
                        f"{self.path}: truncated safetensors file ({size} bytes, no header)"
                    )
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(
                        f"{self.path}: corrupt safetensors header (declares {header_len} header bytes, "
                        f"file has {size})"
                    )
                header = json.loads(f.read(header_len))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + header_len
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{self.path}: corrupt header entry for tensor {key!r}: {info!r}"
                ) from None
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or begin < 0:
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} has inconsistent offsets {begin}..{end} "
                    f"for shape {shape} {info['dtype']}"
                )
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {key!r} ends at byte {self.data_start + end} "
                    f"but the file has {size} bytes"
                )
            self.entries[key] = (dtype, shape, begin, end)

    def read(self, key: str) -> np.ndarray:
        dtype, shape, begin, end = self.entries[key]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            buf = f.read(end - begin)
        if len(buf) != end - begin:
            raise CheckpointError(f"{self.path}: truncated while reading tensor {key!r}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({err})") from None


class HFCheckpoint:
    """A Hugging Face model directory: config, and the tensors of its (possibly sharded) safetensors files."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.hf_config = read_json(self.dir / "config.json", "config.json")
        try:
            self.config: MoEConfig = config_from_hf(self.hf_config)
        except UnsupportedConfigError as err:
            raise UnsupportedConfigError(f"{self.dir}/config.json: {err}") from None
        except KeyError as err:
            raise CheckpointError(f"{self.dir}/config.json: required attribute {err} is missing") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{self.dir}/config.json: invalid config: {err}") from None
        index_path = self.dir / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = read_json(index_path, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no 'weight_map' object")
            shard_names = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").exists():
            weight_map, shard_names = None, ["model.safetensors"]
        else:
            raise CheckpointError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors checkpoints are supported)"
            )
        missing = [name for name in shard_names if not (self.dir / name).exists()]
        if missing:
            raise CheckpointError(
                f"{self.dir}: shard(s) named in the index are missing: {', '.join(missing)}"
            )
        self.shards = {name: SafetensorsFile(self.dir / name) for name in shard_names}
        self.location: dict[str, SafetensorsFile] = {}
        for shard in self.shards.values():
            for key in shard.entries:
                self.location[key] = shard
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self.shards[name].entries:
                    raise CheckpointError(f"{self.dir / name}: index says it holds {key!r}, but it does not")
        self.layout = detect_layout(self.location)
        self.tensors: list[HFTensor] = hf_tensors(self.config, self.layout)
        self._check_names_and_shapes()

    def _check_names_and_shapes(self) -> None:
        expected = {t.key: t for t in self.tensors}
        missing = [k for k in expected if k not in self.location]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(
                f"{self.dir}: tensor(s) missing from the checkpoint: {', '.join(missing[:5])}{more}"
            )
        ignorable = ("rotary_emb.inv_freq",)
        unexpected = [k for k in self.location if k not in expected and not k.endswith(ignorable)]
        if self.config.tie_word_embeddings:
            unexpected = [k for k in unexpected if k != "lm_head.weight"]
        if unexpected:
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise CheckpointError(
                f"{self.dir}: unexpected tensor(s) for a {self.config.family} config: "
                f"{', '.join(unexpected[:5])}{more}"
            )
        for key, tensor in expected.items():
            shape = self.location[key].entries[key][1]
            if shape != tensor.shape:
                raise CheckpointError(
                    f"{self.location[key].path}: tensor {key!r} has shape {shape}, "
                    f"config.json implies {tensor.shape}"
                )

    @property
    def total_bytes(self) -> int:
        return sum(
            end - begin for shard in self.shards.values() for _, _, begin, end in shard.entries.values()
        )

    def tensor_bytes(self, key: str) -> int:
        _, _, begin, end = self.location[key].entries[key]
        return end - begin

    def read(self, key: str) -> np.ndarray:
        return self.location[key].read(key)

    def params(
        self,
        dtype: np.dtype | None = None,
        *,
        layers: range | None = None,
        where: Callable[[HFTensor], bool] | None = None,
    ) -> Iterator[tuple[HFTensor, Target, np.ndarray]]:
        """Streams our parameters one HF tensor at a time, in the table's (layer by layer) order.

        Yields (source tensor, target, array in our layout and `dtype` or the stored dtype); `where`
        selects tensors (e.g. the conversion reads one layer at a time).
        """
        for tensor in self.tensors:
            if layers is not None and tensor.layer >= 0 and tensor.layer not in layers:
                continue
            if where is not None and not where(tensor):
                continue
            raw = self.read(tensor.key)
            for target in tensor.targets:
                value = apply_transform(raw, target)
                yield tensor, target, value if dtype is None else value.astype(dtype, copy=False)
            del raw

    def stored_dtype(self) -> np.dtype:
        """The dtype most of the checkpoint's bytes are stored in."""
        by_dtype: dict[np.dtype, int] = {}
        for shard in self.shards.values():
            for dtype, _, begin, end in shard.entries.values():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + end - begin
        return max(by_dtype, key=by_dtype.get)


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> int:
    """Writes a safetensors file (tensors in the given order); returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, value in tensors.items():
        if value.dtype not in SAFETENSORS_CODES:
            raise ValueError(f"tensor {key!r}: dtype {value.dtype} cannot be stored in safetensors")
        header[key] = {
            "dtype": SAFETENSORS_CODES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + value.nbytes],
        }
        offset += value.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for value in tensors.values():
            f.write(np.ascontiguousarray(value).tobytes())
    return 8 + len(raw) + offset
