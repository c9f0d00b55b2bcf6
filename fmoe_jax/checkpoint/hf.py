"""Reading Hugging Face checkpoint directories: `config.json`, safetensors shards, tensors in our layout.

Used by `fmoe_jax.load_model` (HF directories), the conversion CLI and its `verify`. Safetensors files are
read and written with the `safetensors` library, one tensor at a time; when it refuses a file, the header is
examined here so that the message names the file and the tensor at fault.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes  # registers bfloat16 with NumPy, which safetensors needs to return BF16 tensors
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from fmoe_jax.models import UnsupportedConfigError, config_from_hf
from fmoe_jax.models.config import MoEConfig
from fmoe_jax.models.quant import ExpertQuantization

from .keys import (
    HFTensor,
    Target,
    apply_transform,
    detect_layout,
    detect_prefix,
    hf_tensors,
    not_converted,
    param_dtype,
)
from .quantized import FP8, SourceQuantization, check_fp8_scales, fp8_scale_key

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
    "F8_E4M3": FP8,  # FP8 checkpoints (`checkpoint/quantized.py`), read as raw bytes
}
SAFETENSORS_CODES = {v: k for k, v in DTYPES.items()}
FLOAT_CODES = ("F32", "BF16", "F16", "F64")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's limit too


def _range(dtype: np.dtype) -> float:
    """The largest finite value of a floating-point dtype; 0 for integer storage (MXFP4 blocks, scales)."""
    try:
        return float(ml_dtypes.finfo(dtype).max)
    except ValueError:
        return 0.0


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or not what its config says."""


class SafetensorsFile:
    """One safetensors file, opened (and validated against its size) by the `safetensors` library.

    `entries` maps each tensor to (dtype, shape, begin, end), its byte range in the data section. Tensors
    are read on demand with `pread` rather than through a memory map: a file truncated while it is being
    read then fails with an error instead of killing the process with SIGBUS.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = safe_open(self.path, framework="numpy", backend="pread")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except SafetensorError as err:
            raise CheckpointError(_diagnose(self.path, str(err))) from None
        self.metadata = self._file.metadata() or {}
        with open(self.path, "rb") as f:
            self.data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        offset = 0  # the library has checked that the tensors tile the data section in this order
        for key in self._file.offset_keys():
            info = self._file.get_slice(key)
            code, shape = info.get_dtype(), tuple(info.get_shape())
            if code not in DTYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} is stored as {code}, which fmoe_jax does not read "
                    f"(it reads {', '.join(DTYPES)})"
                )
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[code].itemsize
            self.entries[key] = (DTYPES[code], shape, offset, offset + nbytes)
            offset += nbytes

    def read(self, key: str) -> np.ndarray:
        dtype, shape, begin, end = self.entries[key]
        if dtype == FP8:  # the safetensors library returns no FP8 NumPy arrays
            return self._read_raw(key, dtype, shape, begin, end)
        try:
            return self._file.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self.path}: cannot read tensor {key!r} ({err})") from None

    def _read_raw(self, key: str, dtype: np.dtype, shape: tuple, begin: int, end: int) -> np.ndarray:
        try:
            with open(self.path, "rb") as f:
                data = os.pread(f.fileno(), end - begin, self.data_start + begin)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot read tensor {key!r} ({err.strerror})") from None
        if len(data) != end - begin:
            raise CheckpointError(f"{self.path}: cannot read tensor {key!r} (the file was truncated)")
        return np.frombuffer(data, dtype).reshape(shape)


def _diagnose(path: Path, reason: str) -> str:
    """Why the safetensors library refused `path` (its `reason` names no tensor): the first header defect."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            return f"{path}: truncated safetensors file ({size} bytes, no header)"
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            return f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {size})"
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{path}: corrupt safetensors header ({err})"
    if not isinstance(header, dict):
        return f"{path}: corrupt safetensors header (not a JSON object)"
    header.pop("__metadata__", None)
    data_start, data_end = 8 + header_len, 8 + header_len
    for key, info in header.items():
        try:
            code = info["dtype"]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return f"{path}: corrupt header entry for tensor {key!r}: {info!r}"
        itemsize = DTYPES[code].itemsize if code in DTYPES else None
        if begin < 0 or (itemsize is not None and end - begin != int(np.prod(shape)) * itemsize):
            return f"{path}: tensor {key!r} has inconsistent offsets {begin}..{end} for shape {shape} {code}"
        if data_start + end > size:
            return (
                f"{path}: truncated: tensor {key!r} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        data_end = max(data_end, data_start + end)
    if data_end < size:
        return f"{path}: {size - data_end} bytes after the last tensor's data (not a valid safetensors file)"
    return f"{path}: not a valid safetensors file ({reason})"


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({err})") from None


class HFCheckpoint:
    """A Hugging Face model directory: config, and the tensors of its (possibly sharded) safetensors files.

    With `untie`, a config that ties the LM head to the embedding (`tie_word_embeddings`) is read as untied,
    so that the checkpoint's own `lm_head.weight` is the head (`hf_config` says so too); without it, such a
    tensor is refused unless it equals the embedding, since the tied config would ignore it.
    """

    def __init__(self, directory: str | os.PathLike, *, untie: bool = False):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.hf_config = read_json(self.dir / "config.json", "config.json")
        self.untied = bool(
            untie and isinstance(self.hf_config, dict) and self.hf_config.get("tie_word_embeddings")
        )
        if self.untied:
            self.hf_config = {**self.hf_config, "tie_word_embeddings": False}
        try:
            self.config: MoEConfig = config_from_hf(self.hf_config)
        except UnsupportedConfigError as err:
            raise UnsupportedConfigError(f"{self.dir}/config.json: {err}") from None
        except KeyError as err:
            raise CheckpointError(f"{self.dir}/config.json: required attribute {err} is missing") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{self.dir}/config.json: invalid config: {err}") from None
        self.quantization = SourceQuantization.from_config(
            self.hf_config, self.dir / "config.json", self.config.family
        )
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
        self.tensors: list[HFTensor] = hf_tensors(self.config, self.layout, detect_prefix(self.location))
        # {part: tensors} the checkpoint holds beside the language model, left out (a vision tower, ...)
        self.not_converted = not_converted(self.config, self.location)
        self._check_names_and_shapes()

    def _check_names_and_shapes(self) -> None:
        """Every tensor the config implies is present, with that shape, in a floating-point dtype (FP8 with
        its scales, when config.json declares them; MXFP4 experts as uint8 blocks and scales)."""
        expected = {t.key: t for t in self.tensors}
        missing = [k for k in expected if k not in self.location]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(
                f"{self.dir}: tensor(s) missing from the checkpoint: {', '.join(missing[:5])}{more}"
            )
        entries = {k: (*shard.entries[k][:2], shard.path) for k, shard in self.location.items()}
        scales, problem = check_fp8_scales(entries, self.quantization)
        if problem is not None:
            raise CheckpointError(problem)
        ignorable = ("rotary_emb.inv_freq",)
        # Multi-token-prediction layers (DeepSeek-V3, GLM-4.5) follow the last layer; decoding does not use
        # them. Parts a family's model leaves out (`keys.NOT_CONVERTED`) are noted, not refused.
        n, extra = self.config.num_layers, int(self.hf_config.get("num_nextn_predict_layers") or 0)
        mtp = tuple(f"model.layers.{i}." for i in range(n, n + extra))
        unexpected = [
            k
            for k in self.location
            if k not in expected
            and k not in scales
            and not k.endswith(ignorable)
            and not k.startswith(mtp)
            and not not_converted(self.config, [k])
        ]
        if self.config.tie_word_embeddings and "lm_head.weight" in unexpected:
            self._check_tied_head()
            unexpected = [k for k in unexpected if k != "lm_head.weight"]
        if unexpected:
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise CheckpointError(
                f"{self.dir}: unexpected tensor(s) for a {self.config.family} config: "
                f"{', '.join(unexpected[:5])}{more}"
            )
        floats = [DTYPES[code] for code in FLOAT_CODES] + ([FP8] if self.quantization.method == "fp8" else [])
        for key, tensor in expected.items():
            dtype, shape, _, _ = self.location[key].entries[key]
            if shape != tensor.shape:
                mxfp4 = " (MXFP4 holds 32 values in 16 bytes per block)" if key.endswith("_blocks") else ""
                raise CheckpointError(
                    f"{self.location[key].path}: tensor {key!r} has shape {shape}, "
                    f"config.json implies {tensor.shape}{mxfp4}"
                )
            if self.layout == "mxfp4" and key.endswith(("_blocks", "_scales")):
                if dtype != np.dtype(np.uint8):
                    raise CheckpointError(
                        f"{self.location[key].path}: MXFP4 tensor {key!r} is stored as {dtype}, not uint8"
                    )
                continue
            if dtype not in floats:
                raise CheckpointError(
                    f"{self.location[key].path}: tensor {key!r} is stored as {dtype} "
                    f"({SAFETENSORS_CODES[dtype]}), but the weights of a model must be floating point "
                    f"({', '.join(FLOAT_CODES)}); it would be cast, not converted. Save the checkpoint with "
                    "floating-point weights"
                )

    def _check_tied_head(self) -> None:
        """A checkpoint whose config ties the LM head to the embedding but that holds an `lm_head.weight`:
        a copy of the embedding is harmless; any other is refused, since which of the two is the head is
        not ours to guess (transformers uses `lm_head.weight`)."""
        embedding = next(t.key for t in self.tensors if t.targets[0].path == ("embed", "embedding"))
        head = self.read("lm_head.weight")
        if head.shape == self.location[embedding].entries[embedding][1] and np.array_equal(
            head, self.read(embedding)
        ):
            return
        raise CheckpointError(
            f"{self.location['lm_head.weight'].path}: tensor 'lm_head.weight' differs from {embedding!r}, "
            f"but {self.dir / 'config.json'} ties them (tie_word_embeddings: true), so it would be ignored. "
            "To use it as the LM head (as transformers does), convert with `fmoe-convert --untie` or set "
            "tie_word_embeddings to false in config.json; to use the embedding, remove the tensor"
        )

    @property
    def not_converted_note(self) -> str | None:
        """One line naming what the checkpoint holds that the model leaves out, or None."""
        if not self.not_converted:
            return None
        parts = ", ".join(f"{what} ({n} tensors)" for what, n in self.not_converted.items())
        return f"not converted: {parts}; fmoe_jax serves the language model only"

    @property
    def total_bytes(self) -> int:
        """Bytes of the tensors the model reads (what a conversion streams)."""
        return sum(self.tensor_bytes(t.key) for t in self.tensors)

    def tensor_bytes(self, key: str) -> int:
        _, _, begin, end = self.location[key].entries[key]
        return end - begin

    @property
    def expert_storage(self) -> ExpertQuantization | None:
        """How the checkpoint stores its routed experts, when they are to be kept so (MXFP4); else None."""
        return ExpertQuantization("mxfp4", 32) if self.layout == "mxfp4" else None

    def read(self, key: str) -> np.ndarray:
        """A tensor as stored, or (FP8) dequantized to float32 with its block scales."""
        value = self.location[key].read(key)
        if value.dtype == FP8:
            scale = fp8_scale_key(key)
            return self.quantization.dequantize(value, self.location[scale].read(scale))
        return value

    def params(
        self,
        dtype: np.dtype | None = None,
        *,
        layers: range | None = None,
        where: Callable[[HFTensor], bool] | None = None,
    ) -> Iterator[tuple[HFTensor, Target, np.ndarray]]:
        """Streams our parameters one HF tensor at a time, in the table's (layer by layer) order.

        Yields (source tensor, target, array in our layout and `dtype` or the stored dtype); `where`
        selects tensors (e.g. the conversion reads one layer at a time). Integer data (MXFP4 blocks and
        scales) keeps its type, and float32 parameters (`keys.param_dtype`) stay float32.
        """
        for tensor in self.tensors:
            if layers is not None and tensor.layer >= 0 and tensor.layer not in layers:
                continue
            if where is not None and not where(tensor):
                continue
            raw = self.read(tensor.key)
            for target in tensor.targets:
                value = apply_transform(raw, target)
                if dtype is not None and value.dtype.kind not in "iub":
                    value = self._cast(tensor.key, value, param_dtype(target.path, dtype))
                yield tensor, target, value
            del raw

    def _cast(self, key: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """`value` (of tensor `key`) as `dtype`; CheckpointError when finite values would become infinities
        (float16's range is +-65504: a trained weight may be beyond it)."""
        with np.errstate(over="ignore"):
            out = value.astype(dtype, copy=False)
        if out is value or ml_dtypes.finfo(dtype).max >= ml_dtypes.finfo(value.dtype).max:
            return out
        overflowed = ~np.isfinite(out) & np.isfinite(value)
        if overflowed.any():
            peak = float(np.max(np.abs(value[overflowed].astype(np.float64))))
            raise CheckpointError(
                f"{self.location[key].path}: tensor {key!r} holds values up to {peak:.6g} in magnitude, "
                f"beyond {np.dtype(dtype).name}'s range (+-{float(ml_dtypes.finfo(dtype).max):.6g}): cast, "
                "they would be infinities. Use bfloat16 or float32 instead"
            )
        return out

    def check_cast(self, dtype: np.dtype, *, poll: Callable[[], None] = lambda: None) -> None:
        """Reads every tensor once to check that casting it to `dtype` loses no value to infinity (only when
        `dtype` has a narrower range than some stored tensor); `params` checks the same as it streams."""
        narrower = {
            t.key for t in self.tensors if _range(dtype) < _range(self.location[t.key].entries[t.key][0])
        }
        for _ in self.params(dtype, where=lambda t: t.key in narrower) if narrower else ():
            poll()

    def stored_dtype(self) -> np.dtype:
        """The floating-point dtype most of the checkpoint's bytes are stored in, FP8 weights and MXFP4 or
        other integer data aside (bfloat16 when nothing else is left, as FP8 checkpoints are meant)."""
        floats = {DTYPES[code] for code in FLOAT_CODES}
        by_dtype: dict[np.dtype, int] = {}
        for shard in self.shards.values():
            for dtype, _, begin, end in shard.entries.values():
                if dtype in floats:
                    by_dtype[dtype] = by_dtype.get(dtype, 0) + end - begin
        return max(by_dtype, key=by_dtype.get) if by_dtype else DTYPES["BF16"]


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> int:
    """Writes a safetensors file with the `safetensors` library; returns the bytes written."""
    for key, value in tensors.items():
        if value.dtype not in SAFETENSORS_CODES:
            raise ValueError(f"tensor {key!r}: dtype {value.dtype} cannot be stored in safetensors")
    contiguous = {key: np.ascontiguousarray(value) for key, value in tensors.items()}
    save_file(contiguous, path, metadata=metadata or {"format": "pt"})
    return Path(path).stat().st_size
