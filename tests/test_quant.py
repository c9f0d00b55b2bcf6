"""Quantized experts' numerics: `quantize` and its error bound, the int4 byte layout, the fast `dequantize`
against the slow reference, every expert kernel against the dequantize-then-matmul reference mixture, the
bytes per expert, and the settings' errors. Loading and conversion: `test_quant_loading.py`; offloaded
against resident: `test_quant_lossless.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fmoe_jax.models.moe import ExpertWeights, Routing, expert_mixture, reference_mixture
from fmoe_jax.models.quant import (
    QMAX,
    ExpertQuantization,
    QuantizedMatrix,
    dequantize,
    expert_quantization,
    quantize,
    reference_dequantize,
)
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, MODELS, ModelPreset

D, F, J = 32, 48, 6
KINDS = ("int8", "int4")
DTYPES = (np.float32, ml_dtypes.bfloat16)
# |w - dequantized| per element: half a quantization step (rounding to the nearest level), plus the
# rounding of the scale to its dtype (the top level may then sit up to one relative ulp of the scale away)
# and of the dequantized product to the model's dtype (half an ulp of |w|). bfloat16 ulp = 2**-7 relative.
ULP = {np.float32: 2.0**-23, ml_dtypes.bfloat16: 2.0**-7}


def random_matrix(shape, dtype, seed: int) -> np.ndarray:
    """Gaussian weights with a few large outliers and one all-zero group (rows 0, inputs [0, 16))."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, shape)
    w.flat[rng.choice(w.size, 5, replace=False)] *= 20
    w[0, :16] = 0
    return w.astype(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [8, 16, 48])
def test_quantization_error_is_half_a_step(kind, dtype, group_size):
    w = random_matrix((F, D if group_size != 48 else 48), dtype, seed=group_size)
    spec = ExpertQuantization(kind, group_size)
    m = quantize(w, spec)
    assert m.values.dtype == spec.storage_dtype and m.values.shape == spec.values_shape(*w.shape)
    assert m.scales.dtype == np.dtype(dtype) and m.scales.shape == spec.scales_shape(*w.shape)
    back = reference_dequantize(m).astype(np.float32)
    step = np.repeat(m.scales.astype(np.float32), group_size, axis=1)  # [out, in]
    w32 = w.astype(np.float32)
    bound = 0.5 * step + QMAX[kind] * step * ULP[dtype] + np.abs(w32) * ULP[dtype]
    assert (np.abs(back - w32) <= bound).all(), np.max(np.abs(back - w32) / bound)
    np.testing.assert_array_equal(back[0, :16], 0.0)  # the all-zero group stays zero (scale 0)


def test_int4_layout_low_nibble_first_half_high_nibble_second_half():
    """The stored bytes, written out by hand: each byte holds q + 8 of input j (low nibble) and of input
    j + in/2 (high nibble); scales per (row, group)."""
    q = np.array([[-7, -1, 0, 7, 3, -7, 5, 1], [1, 2, 3, -7, -4, -5, -6, 7]], np.float32)  # |7| per group
    scales = np.array([[0.5, 0.25], [2.0, 1.0]], np.float32)
    w = q * np.repeat(scales, 4, axis=1)
    m = quantize(w, ExpertQuantization("int4", 4))
    np.testing.assert_array_equal(m.scales, scales)
    expected = np.array(
        [[(q[r, j] + 8) + 16 * (q[r, j + 4] + 8) for j in range(4)] for r in range(2)], np.uint8
    )
    np.testing.assert_array_equal(m.values, expected)
    np.testing.assert_array_equal(reference_dequantize(m), w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_dequantize_equals_reference_bit_for_bit(kind, dtype):
    m = quantize(random_matrix((F, D), dtype, seed=1), ExpertQuantization(kind, 16))
    fast = jax.jit(dequantize)(QuantizedMatrix(jnp.asarray(m.values), jnp.asarray(m.scales)))
    assert fast.dtype == np.dtype(dtype) and fast.shape == (F, D)
    np.testing.assert_array_equal(np.asarray(fast), reference_dequantize(m))
    assert (
        quantize(reference_dequantize(m), ExpertQuantization(kind, 16)).values.tobytes() == m.values.tobytes()
    )


def quantized_experts(kind: str, dtype=np.float32, n: int = J, seed: int = 0) -> list[ExpertWeights]:
    spec = ExpertQuantization(kind, 16)
    rng = np.random.default_rng(seed)
    experts = []
    for _ in range(n):
        mats = [rng.normal(0, 0.3, s).astype(dtype) for s in ((F, D), (F, D), (D, F))]
        experts.append(ExpertWeights(*(jax.tree.map(jnp.asarray, quantize(w, spec)) for w in mats)))
    return experts


def routing(n_tokens: int, k: int, seed: int = 1) -> tuple[jax.Array, Routing]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n_tokens, D)), jnp.float32)
    ids = np.stack([rng.choice(J, k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (n_tokens, k)).astype(np.float32)
    return x, Routing(jnp.full((n_tokens, J), 1.0 / J), jnp.asarray(ids), jnp.asarray(weights))


CASES = [
    (kernel, n, k)
    for kernel in ("unrolled", "grouped", "tiled", "ragged", "blocked")
    for n, k in ((1, 2), (7, 2), (64, 2))
    if kernel != "unrolled" or n * k <= 16
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernel,n_tokens,k", CASES)
def test_kernels_match_the_dequantize_then_matmul_reference(kind, kernel, n_tokens, k):
    experts = quantized_experts(kind)
    x, r = routing(n_tokens, k)
    ref = reference_mixture(x, r, experts)
    slots = jnp.arange(J, dtype=jnp.int32)
    out = expert_mixture(x, r, experts, slots, jnp.ones(n_tokens, bool), kernel=kernel)
    assert out.dtype == jnp.float32
    # float32 throughout: the kernels and the reference differ only in summation order
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_kernel_matches_reference(kind):
    experts = quantized_experts(kind, ml_dtypes.bfloat16)
    x, r = routing(5, 2)
    ref = reference_mixture(x, r, experts)
    out = expert_mixture(x, r, experts, jnp.arange(J, dtype=jnp.int32), jnp.ones(5, bool), kernel="unrolled")
    # bf16 activations: both round x and the hidden layer to bf16 (2**-8 relative), in different orders
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


def test_unused_quantized_experts_are_never_dequantized():
    """NaN scales on experts no token uses leave the output finite: decode expands only the experts used."""
    experts = quantized_experts("int4")
    poisoned = [
        e if i < 2 else ExpertWeights(*(QuantizedMatrix(m.values, m.scales * jnp.nan) for m in e))
        for i, e in enumerate(experts)
    ]
    x, _ = routing(1, 2)
    r = Routing(jnp.ones((1, J)) / J, jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[0.6, 0.4]]))
    out = expert_mixture(x, r, poisoned, jnp.arange(J, dtype=jnp.int32), jnp.ones(1, bool), kernel="unrolled")
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("preset", list(MODELS.values()), ids=lambda p: p.name)
def test_bytes_per_expert_against_bfloat16(preset):
    """The issue's targets at the default group size, scales included: int8 <= 0.52x, int4 <= 0.28x (of the
    bfloat16 expert; gpt-oss's preset stores MXFP4, and its experts' biases stay bfloat16)."""
    int8, int4 = (dataclasses.replace(preset, expert_quantization=k).expert_bytes for k in KINDS)
    bf16 = dataclasses.replace(preset, expert_quantization=None, quantization_group_size=None).expert_bytes
    assert int8 <= 0.52 * bf16 and int4 <= 0.28 * bf16
    d, f = preset.hidden_size, preset.expert_intermediate_size
    biases = (2 * f + d) * 2 if preset.expert_bias else 0
    assert int4 == 3 * d * f // 2 + 3 * d * f // 64 * 2 + biases  # nibbles, one bf16 scale per 64 inputs


def test_settings_errors_name_the_values():
    with pytest.raises(ValueError, match="'int3'"):
        OffloadConfig(expert_quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size=32 was given without"):
        OffloadConfig(quantization_group_size=32)
    with pytest.raises(ValueError, match="positive int, got 0"):
        expert_quantization("int8", 0)
    with pytest.raises(ValueError, match="group_size=48 does not divide the input dimension 64"):
        quantize(np.zeros((8, 64), np.float32), ExpertQuantization("int8", 48))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(np.full((8, 64), np.inf, np.float32), ExpertQuantization("int8", 16))
    with pytest.raises(
        ValueError, match="'Mixtral-8x7B'.*group_size=100 does not divide the input dimension 4096"
    ):
        ModelPreset(
            **{
                **dataclasses.asdict(MIXTRAL_8X7B),
                "expert_quantization": "int4",
                "quantization_group_size": 100,
            }
        )
