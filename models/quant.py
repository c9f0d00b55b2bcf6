"""Quantized routed experts: int8 or int4 weights with one scale per group of inputs, dequantized inside
the expert kernel. Fewer bytes in host memory, over the link on a miss, and per cache slot.

`quantize` (NumPy, deterministic: the converter and `load_model` produce the same bytes from the same
matrix) turns an `[out, in]` matrix into a `QuantizedMatrix`; `dequantize` (jnp) is what the kernels in
`models/moe.py` call on an expert's matrices inside each expert's branch, so only the experts a token uses
are read and expanded; `reference_dequantize` is the slow loop the tests compare both with.

The scheme (group sizes compared in `benchmarks/quantization.py`, README "Quantized experts"):
- symmetric, `w ~ q * scale` with q in [-127, 127] (int8) or [-7, 7] (int4) and one scale per output row
  and group of `group_size` consecutive inputs, `scale = max|w| / qmax` over the group, stored in the model's
  dtype and rounded to it before q is computed. A zero point (asymmetric) would cost a second array per
  group; symmetric int4 already keeps the shipped models' held-out NLL within 0.03 % of bfloat16's.
- int4 packed two to a byte (uint8): inputs `[0, in/2)` in the low nibble, `[in/2, in)` in the high one,
  as `q + 8`. Unpacking is two masks and one concatenation, which XLA:CPU fuses with the scaling.
  `jnp.int4` holds one value per byte on XLA:CPU, in pinned host memory too (no saving there or on the link).

Google's JAX quantization libraries, `qwix` (0.1.8) and `aqtp` (0.9.0), were read and qwix was run: its
`QArray` (absmax, per row and tiles of 64 inputs) holds int8 in the same bytes as here and dequantizes
int8 as fast, but holds int4 as `jnp.int4` (2x these bytes) and its dequantize-and-matvec of a bench-s
matrix took 1.9x as long as `dequantize` here. Both quantize with jnp on a device and plug in by
intercepting a module's `dot_general`; here the converter and loader quantize one expert at a time in NumPy
on the host, and the kernels take experts as pytree leaves of the offload cache. The numerics are the same
absmax-per-group; this file keeps them without the dependency.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import mxfp4
from .mxfp4 import Mxfp4Matrix

Kind = Literal["int8", "int4", "mxfp4"]
KINDS: tuple[str, ...] = ("int8", "int4")  # what fmoe_jax quantizes experts to
# How a checkpoint may store its experts: also MXFP4, as gpt-oss publishes them (`models/mxfp4.py`); kept as
# published, never produced here.
STORED_KINDS: tuple[str, ...] = (*KINDS, "mxfp4")
DEFAULT_GROUP_SIZE = 64
QMAX = {"int8": 127, "int4": 7}


@dataclasses.dataclass(frozen=True)
class ExpertQuantization:
    """How routed experts are stored: `kind` ("int8", "int4", or "mxfp4" as published) and the inputs
    sharing one scale.

    `group_size` must divide every expert matrix's input dimension (hidden size for gate and up, the
    expert intermediate size for down); `check_model` says which one it does not. MXFP4's is 32.
    """

    kind: Kind
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.kind not in STORED_KINDS:
            raise ValueError(f"expert_quantization must be None, 'int8' or 'int4', got {self.kind!r}")
        if self.kind == "mxfp4" and self.group_size != mxfp4.BLOCK:
            raise ValueError(f"MXFP4 shares one scale among {mxfp4.BLOCK} inputs, not {self.group_size}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, (int, np.integer)):
            raise ValueError(f"quantization_group_size must be a positive int, got {self.group_size!r}")
        if self.group_size < 1:
            raise ValueError(f"quantization_group_size must be a positive int, got {self.group_size}")

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(np.int8 if self.kind == "int8" else np.uint8)

    def scales_dtype(self, dtype: np.dtype) -> np.dtype:
        """The scales' dtype in a model of `dtype`: that dtype, or MXFP4's biased exponents (uint8)."""
        return np.dtype(np.uint8) if self.kind == "mxfp4" else np.dtype(dtype)

    def values_shape(self, out: int, fan_in: int) -> tuple[int, int]:
        return (out, fan_in if self.kind == "int8" else fan_in // 2)

    def scales_shape(self, out: int, fan_in: int) -> tuple[int, int]:
        return (out, fan_in // self.group_size)

    def matrix_bytes(self, out: int, fan_in: int, scale_itemsize: int) -> int:
        """Bytes of one stored `[out, in]` matrix, values and scales (`scale_itemsize`: the model dtype's;
        MXFP4's scales take one byte)."""
        scale_itemsize = 1 if self.kind == "mxfp4" else scale_itemsize
        return (
            int(np.prod(self.values_shape(out, fan_in))) + out * (fan_in // self.group_size) * scale_itemsize
        )

    def check_input(self, fan_in: int, what: str) -> None:
        """Raises `ValueError` unless matrices with `fan_in` inputs can be stored this way."""
        if self.kind == "mxfp4":
            return mxfp4.check_input(fan_in, what)
        if fan_in % self.group_size:
            raise ValueError(
                f"quantization_group_size={self.group_size} does not divide the input dimension {fan_in} of "
                f"the {what}; choose a group size that divides it"
            )
        if self.kind == "int4" and fan_in % 2:
            raise ValueError(
                f"int4 packs two inputs to a byte, but the {what} has an odd input dimension {fan_in}"
            )

    def check_model(self, hidden_size: int, intermediate_size: int) -> None:
        """Checks both kinds of expert matrix: gate/up (`[F, D]`) and down (`[D, F]`)."""
        self.check_input(hidden_size, f"experts' gate and up projections (hidden_size={hidden_size})")
        self.check_input(
            intermediate_size, f"experts' down projection (expert_intermediate_size={intermediate_size})"
        )

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "group_size": int(self.group_size)}


def expert_quantization(kind: str | None, group_size: int | None = None) -> ExpertQuantization | None:
    """The setting for the public arguments `expert_quantization` / `quantization_group_size` (None: none)."""
    if kind is None:
        if group_size is not None:
            raise ValueError(
                f"quantization_group_size={group_size!r} was given without expert_quantization ('int8' or "
                "'int4'); set both, or neither"
            )
        return None
    default = mxfp4.BLOCK if kind == "mxfp4" else DEFAULT_GROUP_SIZE
    return ExpertQuantization(kind, default if group_size is None else group_size)


class QuantizedMatrix(NamedTuple):
    """An `[out, in]` matrix stored quantized: int8 values `[out, in]` or int4 pairs `[out, in/2]` uint8,
    and `scales` `[out, in / group]` in the dtype it dequantizes to. A pytree (the engine passes experts to
    its jitted steps, and copies them to the device, as is)."""

    values: jax.Array
    scales: jax.Array

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the matrix dequantizes to (what the kernels compute in)."""
        return self.scales.dtype

    @property
    def bits(self) -> int:
        return 4 if self.values.dtype == jnp.uint8 else 8

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, stored = self.values.shape
        return (*lead, stored * 2 if self.bits == 4 else stored)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def dense(w: jax.Array | QuantizedMatrix | Mxfp4Matrix) -> jax.Array:
    """The matrix a kernel multiplies by: `w` itself, or `w` dequantized."""
    if isinstance(w, Mxfp4Matrix):
        return mxfp4.dequantize(w)
    return dequantize(w) if isinstance(w, QuantizedMatrix) else w


def dequantize(m: QuantizedMatrix) -> jax.Array:
    """`[..., out, in]` in `m.dtype`: each value times its group's scale (one rounding, the product's).
    Leading dimensions are stacked matrices (the "ragged" and "blocked" kernels expand all at once: one
    fusion instead of one per expert, which compiled 3x slower)."""
    v, s = m.values, m.scales
    if m.bits == 4:
        q = jnp.concatenate([(v & 15).astype(jnp.int8) - 8, (v >> 4).astype(jnp.int8) - 8], axis=-1)
    else:
        q = v
    *lead, out, fan_in = q.shape
    groups = s.shape[-1]
    grouped = q.reshape(*lead, out, groups, fan_in // groups).astype(s.dtype) * s[..., None]
    return grouped.reshape(*lead, out, fan_in)


def stack(matrices: list[jax.Array | QuantizedMatrix | Mxfp4Matrix]) -> jax.Array:
    """`[n, out, in]`: the matrices stacked, dequantized (after stacking) when quantized."""
    if isinstance(matrices[0], Mxfp4Matrix):
        stacked = (jnp.stack([m.values for m in matrices]), jnp.stack([m.scales for m in matrices]))
        return mxfp4.dequantize(Mxfp4Matrix(*stacked, matrices[0].dtype))
    if isinstance(matrices[0], QuantizedMatrix):
        return dequantize(QuantizedMatrix(*(jnp.stack(parts) for parts in zip(*matrices, strict=True))))
    return jnp.stack(matrices)


def quantize(w: np.ndarray, spec: ExpertQuantization, scale_dtype: np.dtype | None = None) -> QuantizedMatrix:
    """Quantizes one `[out, in]` matrix on the host (NumPy arrays in the result).

    Args:
      w: the matrix, in the model's dtype (the quantized model approximates the model it would be).
      spec: kind and group size (must divide `in`).
      scale_dtype: dtype of the scales and of the dequantized matrix; default `w.dtype`.
    Raises:
      ValueError: the group size does not divide `in`, `w` holds a NaN or an infinity, or `spec` is MXFP4
        (kept as published, never produced).
    """
    if spec.kind not in KINDS:
        raise ValueError(f"experts are quantized to {' or '.join(KINDS)} only, not {spec.kind!r}")
    w = np.asarray(w)
    scale_dtype = np.dtype(w.dtype if scale_dtype is None else scale_dtype)
    if w.ndim != 2:
        raise ValueError(f"quantize takes an [out, in] matrix, got shape {w.shape}")
    out, fan_in = w.shape
    spec.check_input(fan_in, f"matrix of shape {w.shape}")
    w32 = w.astype(np.float32).reshape(out, fan_in // spec.group_size, spec.group_size)
    if not np.isfinite(w32).all():
        raise ValueError(f"cannot quantize a matrix of shape {w.shape} holding NaN or infinite values")
    qmax = QMAX[spec.kind]
    scales = (np.abs(w32).max(axis=-1) / np.float32(qmax)).astype(scale_dtype)  # [out, groups]
    divisor = scales.astype(np.float32)[:, :, None]
    divisor = np.where(divisor > 0, divisor, np.float32(1))  # an all-zero group quantizes to zeros
    q = np.clip(np.rint(w32 / divisor), -qmax, qmax).astype(np.int8).reshape(out, fan_in)
    if spec.kind == "int8":
        return QuantizedMatrix(q, scales)
    n = (q + 8).astype(np.uint8)
    half = fan_in // 2
    return QuantizedMatrix(n[:, :half] | (n[:, half:] << 4), scales)


def reference_dequantize(m: QuantizedMatrix | Mxfp4Matrix) -> np.ndarray:
    """The slow, obviously correct dequantization the tests hold `dequantize` and the kernels to: unpack each
    byte, then multiply group by group, in float32 (exact for these products) rounded to the scales' dtype."""
    if isinstance(m, Mxfp4Matrix):
        return mxfp4.reference_dequantize(m)
    values, scales = np.asarray(m.values), np.asarray(m.scales)
    out = values.shape[0]
    if values.dtype == np.uint8:
        half = values.shape[1]
        q = np.zeros((out, 2 * half), np.int32)
        for j in range(half):
            q[:, j] = (values[:, j] & 0x0F).astype(np.int32) - 8
            q[:, half + j] = (values[:, j] >> 4).astype(np.int32) - 8
    else:
        q = values.astype(np.int32)
    fan_in, groups = q.shape[1], scales.shape[1]
    size = fan_in // groups
    w = np.zeros((out, fan_in), np.float32)
    for g in range(groups):
        w[:, g * size : (g + 1) * size] = q[:, g * size : (g + 1) * size] * scales[:, g : g + 1].astype(
            np.float32
        )
    return w.astype(scales.dtype)


class QuantizedWeight(nnx.Module):
    """Parameters of one quantized expert matrix (`values`, `scales`); zeros until a checkpoint fills them."""

    def __init__(self, out: int, fan_in: int, spec: ExpertQuantization, *, dtype: jnp.dtype):
        spec.check_input(fan_in, f"expert matrix [{out}, {fan_in}]")
        self.values = nnx.Param(jnp.zeros(spec.values_shape(out, fan_in), spec.storage_dtype))
        self.scales = nnx.Param(jnp.zeros(spec.scales_shape(out, fan_in), dtype))

    def matrix(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.values[...], self.scales[...])


def quantized_weight(
    out: int, fan_in: int, spec: ExpertQuantization, *, dtype: jnp.dtype
) -> QuantizedWeight | mxfp4.Mxfp4Weight:
    """The parameters of one expert matrix stored as `spec` says."""
    if spec.kind == "mxfp4":
        return mxfp4.Mxfp4Weight(out, fan_in, dtype=dtype)
    return QuantizedWeight(out, fan_in, spec, dtype=dtype)


EXPERT_MATRICES = ("gate", "up", "down")


def is_expert_matrix(path: tuple) -> bool:
    """A routed expert's float matrix (what `quantized_params` quantizes): not its biases, not a part
    (values, scales) of a matrix already stored quantized."""
    return path[0] == "experts" and path[-1] in EXPERT_MATRICES


def quantized_params(path: tuple, w: np.ndarray, spec: ExpertQuantization) -> dict[tuple, np.ndarray]:
    """One expert matrix's parameter `path` (e.g. `("experts", 1, 0, "gate")`) and value -> the quantized
    model's parameters `{path + ("values",): ..., path + ("scales",): ...}` (host arrays)."""
    m = quantize(w, spec)
    return {(*path, "values"): m.values, (*path, "scales"): m.scales}
