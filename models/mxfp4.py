"""MXFP4 expert matrices as gpt-oss publishes them: 4-bit e2m1 values in blocks of 32 inputs sharing one e8m0
(power of two) scale, 4.25 bits per weight. Kept so in host memory, copied so, and expanded only inside the
expert kernel that multiplies by them (`models/quant.py`'s `dense` calls `dequantize` here).

Layout of one `[out, in]` matrix (the checkpoint's `*_blocks` / `*_scales` of one expert, rows kept):
  `values` `[out, in / 2]` uint8: inputs `2i` in the low nibble, `2i + 1` in the high one (an e2m1 code each:
           sign bit, 2 exponent bits, 1 mantissa bit);
  `scales` `[out, in / 32]` uint8: the block's exponent, biased by 127.
A value is `E2M1[code] * 2 ** (scale - 127)`; both factors and their product are exact in bfloat16 and
float32, so dequantizing rounds nothing and the order of the two steps does not matter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BLOCK = 32  # inputs per scale
SCALE_BIAS = 127
# The 16 e2m1 codes: 0..7 positive (0, 0.5, 1, 1.5, 2, 3, 4, 6), 8..15 the same negated.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Matrix:
    """An `[out, in]` matrix in MXFP4 (see the module docstring); `dtype` (static) is what it dequantizes to,
    the model's. A pytree of two uint8 arrays, which the engine copies and caches as they are."""

    values: jax.Array  # [..., out, in/2] uint8
    scales: jax.Array  # [..., out, in/32] uint8
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True), default=jnp.dtype(jnp.bfloat16))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, stored = self.values.shape
        return (*lead, 2 * stored)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def dequantize(m: Mxfp4Matrix) -> jax.Array:
    """`[..., out, in]` in `m.dtype` (leading dimensions: stacked matrices, as `quant.dequantize`)."""
    v = m.values
    codes = jnp.stack([v & 15, v >> 4], axis=-1).reshape(*v.shape[:-1], 2 * v.shape[-1])  # [..., out, in]
    table = jnp.asarray(E2M1, jnp.float32)
    *lead, out, fan_in = codes.shape
    blocks = table[codes.astype(jnp.int32)].reshape(*lead, out, fan_in // BLOCK, BLOCK)
    exponent = m.scales.astype(jnp.int32) - SCALE_BIAS  # [..., out, in/32]
    w = jnp.ldexp(blocks, exponent[..., None])
    return w.reshape(*lead, out, fan_in).astype(m.dtype)


def reference_dequantize(m: Mxfp4Matrix) -> np.ndarray:
    """The slow, obviously correct expansion the tests hold `dequantize` to: one input at a time."""
    values, scales = np.asarray(m.values), np.asarray(m.scales)
    out, half = values.shape
    w = np.zeros((out, 2 * half), np.float64)
    for j in range(2 * half):
        byte = values[:, j // 2].astype(np.int64)
        code = byte & 15 if j % 2 == 0 else byte >> 4
        w[:, j] = np.asarray(E2M1)[code] * 2.0 ** (scales[:, j // BLOCK].astype(np.int64) - SCALE_BIAS)
    return w.astype(np.dtype(m.dtype))


def check_input(fan_in: int, what: str) -> None:
    """Raises `ValueError` unless `fan_in` inputs fill whole MXFP4 blocks."""
    if fan_in % BLOCK:
        raise ValueError(f"MXFP4 stores blocks of {BLOCK} inputs, but the {what} has {fan_in} inputs")


class Mxfp4Weight(nnx.Module):
    """Parameters of one MXFP4 expert matrix (`values`, `scales`); zeros until a checkpoint fills them."""

    def __init__(self, out: int, fan_in: int, *, dtype: jnp.dtype):
        check_input(fan_in, f"expert matrix [{out}, {fan_in}]")
        self.values = nnx.Param(jnp.zeros((out, fan_in // 2), jnp.uint8))
        self.scales = nnx.Param(jnp.zeros((out, fan_in // BLOCK), jnp.uint8))
        self.dtype = jnp.dtype(dtype)

    def matrix(self) -> Mxfp4Matrix:
        return Mxfp4Matrix(self.values[...], self.scales[...], self.dtype)
