"""Every expert-mixture kernel agrees with the slow per-expert reference loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fmoe_jax.models.moe import (
    GROUPED_MAX_BODIES,
    GROUPED_MAX_ROWS,
    BiasedExpertWeights,
    ClampedSwiGLU,
    ExpertWeights,
    Routing,
    expert_mixture,
    group_sizes,
    reference_mixture,
    tile_rows,
)
from fmoe_jax.models.mxfp4 import Mxfp4Matrix

D, F, J = 16, 24, 6


def make_experts(n: int, seed: int = 0) -> list[ExpertWeights]:
    rng = np.random.default_rng(seed)
    return [
        ExpertWeights(*(jnp.asarray(rng.normal(0, 0.3, s), jnp.float32) for s in ((F, D), (F, D), (D, F))))
        for _ in range(n)
    ]


def make_routing(n_tokens: int, k: int, seed: int = 1) -> tuple[jax.Array, Routing]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n_tokens, D)), jnp.float32)
    ids = np.stack([rng.choice(J, k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (n_tokens, k)).astype(np.float32)
    probs = np.full((n_tokens, J), 1.0 / J, np.float32)
    return x, Routing(jnp.asarray(probs), jnp.asarray(ids), jnp.asarray(weights))


CASES = [
    (kernel, n, k)
    for kernel in ("unrolled", "grouped", "tiled", "ragged")
    for n, k in ((1, 2), (3, 2), (7, 2), (64, 2))
    if kernel != "unrolled" or n * k <= 16
]  # the unrolled kernel is for decode-sized batches


@pytest.mark.parametrize("kernel,n_tokens,k", CASES)
def test_kernels_match_reference(kernel, n_tokens, k):
    experts = make_experts(J)
    x, routing = make_routing(n_tokens, k)
    ref = reference_mixture(x, routing, experts)
    out = expert_mixture(
        x, routing, experts, jnp.arange(J, dtype=jnp.int32), jnp.ones(n_tokens, bool), kernel=kernel
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["unrolled", "grouped", "tiled", "ragged"])
def test_chunks_and_invalid_tokens(kernel):
    """Passing a subset of experts (slot -1 for the rest) computes only their share; chunks sum to the whole;
    invalid tokens contribute nothing."""
    experts = make_experts(J)
    x, routing = make_routing(5, 2, seed=7)
    valid = jnp.asarray([True, False, True, True, True])
    masked = Routing(routing.probs, routing.ids, routing.weights * valid[:, None])
    ref = reference_mixture(x, masked, experts)
    total = jnp.zeros_like(ref)
    for chunk in ([0, 3], [1, 4, 5], [2]):
        slots = np.full(J, -1, np.int32)
        slots[chunk] = np.arange(len(chunk))
        part = expert_mixture(
            x, routing, [experts[e] for e in chunk], jnp.asarray(slots), valid, kernel=kernel
        )
        total = total + part
    np.testing.assert_allclose(np.asarray(total), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_tile_rows_is_power_of_two_and_bounded():
    for a, n in [(1, 8), (256, 8), (4096, 60), (10, 1)]:
        g = tile_rows(a, n)
        assert g & (g - 1) == 0 and 1 <= g <= 64


@pytest.mark.parametrize("n_tokens,skew,seed", [(17, 0.0, 0), (150, 0.9, 1), (400, 0.5, 2), (90, 1.0, 3)])
def test_grouped_with_skewed_routing(n_tokens, skew, seed):
    """Experts with more rows than the largest tile (full tiles plus a remainder), experts with none, and
    unused experts holding NaN weights (never read): the grouped kernel still equals the reference."""
    rng = np.random.default_rng(seed)
    experts = make_experts(J, seed)
    poisoned = experts[:-1] + [ExpertWeights(*(w * jnp.nan for w in experts[-1]))]  # nobody routes to J-1
    x = jnp.asarray(rng.normal(size=(n_tokens, D)), jnp.float32)
    hot = rng.random(n_tokens) < skew
    first = np.where(hot, 0, rng.integers(1, J - 1, n_tokens))
    second = (
        np.where(first == 1, 2, 1) if skew == 1.0 else (first + rng.integers(1, J - 2, n_tokens)) % (J - 1)
    )
    ids = np.stack([first, second], 1).astype(np.int32)
    assert (ids[:, 0] != ids[:, 1]).all() and (ids < J - 1).all()
    routing = Routing(
        jnp.full((n_tokens, J), 1.0 / J), jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1, (n_tokens, 2)))
    )
    valid = jnp.asarray(rng.random(n_tokens) < 0.9)
    ref = reference_mixture(x, Routing(routing.probs, routing.ids, routing.weights * valid[:, None]), experts)
    out = expert_mixture(x, routing, poisoned, jnp.arange(J, dtype=jnp.int32), valid, kernel="grouped")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_group_sizes_are_bounded():
    for a, n in [(17, 8), (256, 8), (512, 60), (8192, 8), (300, 4), (1, 1)]:
        sizes = group_sizes(a, n)
        assert list(sizes) == sorted(set(sizes)) and all(s % 8 == 0 for s in sizes)
        assert sizes[-1] <= GROUPED_MAX_ROWS and len(sizes) * n <= max(GROUPED_MAX_BODIES, n)


def test_unrolled_reads_only_used_experts():
    """Decode cost scales with the experts used, not the experts passed: the unused ones are never called."""
    experts = make_experts(J)
    poisoned = [ExpertWeights(w.gate * jnp.nan, w.up, w.down) if e >= 2 else w for e, w in enumerate(experts)]
    x, _ = make_routing(1, 2)
    routing = Routing(jnp.ones((1, J)) / J, jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[0.6, 0.4]]))
    out = expert_mixture(
        x, routing, poisoned, jnp.arange(J, dtype=jnp.int32), jnp.ones(1, bool), kernel="unrolled"
    )
    assert np.isfinite(np.asarray(out)).all()


def make_biased_mxfp4_experts(n: int, seed: int = 0) -> list[BiasedExpertWeights]:
    """gpt-oss-like experts: MXFP4 matrices (`[out, in/2]` codes, `[out, in/32]` scales), biases, and a
    clamp that the pre-activations cross."""
    rng = np.random.default_rng(seed)
    d, f = 64, 32

    def matrix(out: int, fan_in: int) -> Mxfp4Matrix:
        values = rng.integers(0, 256, (out, fan_in // 2), dtype=np.uint8)
        scales = rng.integers(121, 125, (out, fan_in // 32), dtype=np.uint8)
        return Mxfp4Matrix(jnp.asarray(values), jnp.asarray(scales), jnp.float32)

    return [
        BiasedExpertWeights(
            matrix(f, d),
            matrix(f, d),
            matrix(d, f),
            *(jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for s in ((f,), (f,), (d,))),
            activation=ClampedSwiGLU(1.702, 0.5),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("kernel", ["unrolled", "grouped", "tiled", "ragged", "blocked"])
def test_kernels_match_reference_for_biased_mxfp4_experts(kernel):
    """Every kernel expands MXFP4 and applies the biases and the clamped SwiGLU as the reference loop does,
    in chunks too."""
    experts = make_biased_mxfp4_experts(J)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    ids = np.stack([rng.choice(J, 2, replace=False) for _ in range(5)]).astype(np.int32)
    routing = Routing(jnp.full((5, J), 1.0 / J), jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1, (5, 2))))
    ref = reference_mixture(x, routing, experts)
    total = jnp.zeros_like(ref)
    for chunk in ([0, 3], [1, 4, 5], [2]):
        slots = np.full(J, -1, np.int32)
        slots[chunk] = np.arange(len(chunk))
        valid = jnp.ones(5, bool)
        chunk_experts = [experts[e] for e in chunk]
        total = total + expert_mixture(x, routing, chunk_experts, jnp.asarray(slots), valid, kernel=kernel)
    np.testing.assert_allclose(np.asarray(total), np.asarray(ref), rtol=1e-5, atol=1e-5)
