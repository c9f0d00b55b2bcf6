"""Quantized Hugging Face checkpoints: the `quantization_config` methods fmoe_jax reads, and their checks.

`checkpoint/hf.py`'s `HFCheckpoint` asks `SourceQuantization.from_config` what config.json declares, and reads
through it. Two methods, as the models people offload publish them:
- `fp8` with `weight_block_size` (DeepSeek-V3 / R1 / V3.1, Kimi-K2, GLM-4.5-FP8): e4m3 weights, each
  `[bo, bi]` block times a float32 `weight_scale_inv`; dequantized while streaming (to the conversion's dtype,
  or then into int8 / int4 experts), since nothing here computes in FP8.
- `mxfp4` (gpt-oss): routed experts as `*_blocks` / `*_scales`, kept as published (`models/mxfp4.py`).
Any other method is refused by name: reading its tensors as plain weights would make a different model.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from fmoe_jax.models import UnsupportedConfigError

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
METHODS = ("fp8", "mxfp4")


@dataclasses.dataclass(frozen=True)
class SourceQuantization:
    """What config.json's `quantization_config` declares: no method, `fp8` (with its `[rows, columns]`
    block) or `mxfp4`."""

    method: str | None = None
    block: tuple[int, int] = (0, 0)

    @classmethod
    def from_config(cls, hf_config: dict[str, Any], path: Path, family: str) -> SourceQuantization:
        """Raises `UnsupportedConfigError` (naming `path`) for a method or a setting not implemented here."""
        q = hf_config.get("quantization_config")
        if not q:
            return cls()
        method = q.get("quant_method") if isinstance(q, dict) else None
        supported = "fp8 with weight_block_size (dequantized), mxfp4 experts of gpt_oss (kept as published)"
        if method not in METHODS:
            raise UnsupportedConfigError(
                f"{path}: quantization_config.quant_method {method!r} is not supported (fmoe_jax reads "
                f"{supported}); convert from the unquantized checkpoint"
            )
        if method == "mxfp4":
            if family != "gpt_oss":
                raise UnsupportedConfigError(f"{path}: quantization_config mxfp4 is read for gpt_oss only")
            return cls("mxfp4")
        block = q.get("weight_block_size")
        fmt = q.get("fmt", "e4m3")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise UnsupportedConfigError(
                f"{path}: quantization_config fp8 without a weight_block_size [rows, columns] (per-tensor or "
                f"per-channel FP8) is not supported; got weight_block_size={block!r}"
            )
        if fmt != "e4m3":
            raise UnsupportedConfigError(f"{path}: quantization_config fp8 fmt {fmt!r} is not supported")
        return cls("fp8", (int(block[0]), int(block[1])))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The `weight_scale_inv` shape of an FP8 `[out, in]` weight: one scale per (partial) block."""
        out, fan_in = shape
        return (math.ceil(out / self.block[0]), math.ceil(fan_in / self.block[1]))

    def dequantize(self, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """FP8 `[out, in]` times each block's scale, in float32 (what DeepSeek's own cast to bf16 computes
        before rounding once)."""
        out, fan_in = weight.shape
        rows, cols = self.block
        full = np.repeat(np.repeat(scale.astype(np.float32), rows, axis=0)[:out], cols, axis=1)[:, :fan_in]
        return weight.astype(np.float32) * full


def fp8_scale_key(key: str) -> str:
    return key + SCALE_SUFFIX


def check_fp8_scales(
    entries: dict[str, tuple[np.dtype, tuple[int, ...], Any]], quantization: SourceQuantization
) -> tuple[set[str], str | None]:
    """The scale tensors that belong to FP8 weights (not weights of the model themselves), or the first
    problem as a sentence: an FP8 weight without its scales or with scales of the wrong shape, or FP8
    weights in a checkpoint whose config.json does not declare them. `entries`: key -> (dtype, shape,
    file)."""
    scales: set[str] = set()
    for key, (dtype, shape, where) in entries.items():
        if dtype != FP8:
            continue
        if quantization.method != "fp8":
            return scales, (
                f"{where}: tensor {key!r} is stored as FP8 (F8_E4M3), but config.json has no "
                "quantization_config with quant_method 'fp8' saying how it is scaled"
            )
        scale = fp8_scale_key(key)
        if scale not in entries:
            return scales, (
                f"{where}: tensor {key!r} is FP8 (F8_E4M3) but its scales {scale!r} are missing from the "
                "checkpoint; FP8 weights cannot be read without them (is a shard missing?)"
            )
        want = quantization.scale_shape(shape)
        if entries[scale][1] != want:
            return scales, (
                f"{entries[scale][2]}: tensor {scale!r} has shape {entries[scale][1]}, but {key!r} {shape} "
                f"in blocks of {list(quantization.block)} needs {want}"
            )
        scales.add(scale)
    return scales, None
