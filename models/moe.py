"""Routed experts: the SwiGLU expert, routing results, and the expert-mixture kernels behind one function.

`expert_mixture` is what both the resident forward and the offload engine's `experts(l)` step call; it
takes the weights of the experts to use as plain arrays, so the caller decides where they live.

Dimension letters: N tokens (B*T flattened), D hidden, F expert intermediate, J experts of a layer,
n experts passed to one call, A = N*k assignments, G rows per tile, P tiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class ExpertWeights(NamedTuple):
    """One SwiGLU expert: `down(silu(x @ gate) * (x @ up))`."""

    gate: jax.Array  # [D, F]
    up: jax.Array  # [D, F]
    down: jax.Array  # [F, D]


class Expert(nnx.Module):
    """Parameters of one SwiGLU MLP (a routed expert, Qwen's shared expert, or a dense MLP)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None = None,
        key: jax.Array | None = None,
    ):
        """Initialised from `key` when given (one per routed expert), else from three draws of `rngs`."""
        init = nnx.initializers.normal(0.02)
        keys = jax.random.split(key, 3) if key is not None else [rngs.params() for _ in range(3)]
        self.gate = nnx.Param(init(keys[0], (hidden, intermediate), dtype))
        self.up = nnx.Param(init(keys[1], (hidden, intermediate), dtype))
        self.down = nnx.Param(init(keys[2], (intermediate, hidden), dtype))

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate[...], self.up[...], self.down[...])

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.weights())


def swiglu(x: jax.Array, w: ExpertWeights) -> jax.Array:
    """x `[..., D]` -> `[..., D]` in the weights' dtype."""
    x = x.astype(w.gate.dtype)
    return (jax.nn.silu(x @ w.gate) * (x @ w.up)) @ w.down


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decision for N tokens of one layer."""

    probs: jax.Array  # [N, J] float32, softmax over all experts (the expert map row)
    ids: jax.Array  # [N, k] int32, chosen experts
    weights: jax.Array  # [N, k] float32, their mixing weights


# ----------------------------------------------------------------------------------------------------------
# Kernels. All take the experts to use as a sequence of `ExpertWeights` plus `slot_of_expert` `[J]`
# mapping a layer's expert id to its position in that sequence (-1: not passed, its assignments are
# skipped; the engine runs a layer in chunks this way). They read only the weights of experts that some
# valid token uses, which is what keeps decoding at memory bandwidth.

Kernel = Literal["auto", "unrolled", "tiled", "ragged", "blocked"]
UNROLL_MAX_ASSIGNMENTS = 16


def expert_mixture(
    x: jax.Array,
    routing: Routing,
    experts: Sequence[ExpertWeights],
    slot_of_expert: jax.Array,
    valid: jax.Array,
    *,
    kernel: Kernel = "auto",
) -> jax.Array:
    """Weighted sum of the chosen experts' outputs.

    Args:
      x: `[N, D]` token activations.
      routing: ids and weights `[N, k]`.
      experts: the n experts available to this call.
      slot_of_expert: `[J]` int32, position of each layer expert in `experts`, or -1.
      valid: `[N]` bool; invalid tokens (padding, finished rows) contribute nothing and load nothing.
      kernel: "unrolled" switches per assignment (decode), "tiled" sorts assignments into per-expert tiles
        (prefill), "ragged" stacks the experts and uses `jax.lax.ragged_dot` (grouped GEMM on GPU/TPU);
        "blocked" sorts into tiles like "tiled" but gathers each tile's expert weights and runs one batched
        matmul (exact and differentiable; the training path on CPU, see `fmoe_jax/train.py`); "auto" picks
        by size and backend.
    Returns:
      `[N, D]` in the experts' dtype.
    """
    if not experts:  # nothing routed here is resident in this call (e.g. every token is padding)
        return jnp.zeros(x.shape, x.dtype)
    n_assign = routing.ids.size
    if kernel == "auto":
        kernel = "unrolled" if n_assign <= UNROLL_MAX_ASSIGNMENTS else "tiled"
    local = jnp.where(valid[:, None], slot_of_expert[routing.ids], -1)  # [N, k]
    fn = {
        "unrolled": _mixture_unrolled,
        "tiled": _mixture_tiled,
        "ragged": _mixture_ragged,
        "blocked": _mixture_blocked,
    }[kernel]
    return fn(x, local, routing.weights, tuple(experts))


def _branches(experts: tuple[ExpertWeights, ...], dtype: jnp.dtype):
    """`lax.switch` branches: one per expert, plus a last one that returns zeros (skipped assignment)."""

    def make(w):
        return lambda rows: swiglu(rows, w)

    return [make(w) for w in experts] + [lambda rows: jnp.zeros(rows.shape, dtype)]


def _mixture_unrolled(x, local, weights, experts):
    """One `lax.switch` per assignment: reads exactly the weights of each used expert (decode path).

    The assignments run in a loop around a single switch, so the program holds each expert's branch once
    (not once per assignment): compilation stays fast for many experts and top-k (Qwen: 60 x top-4).
    """
    n, k = local.shape
    dtype = experts[0].gate.dtype
    branches = _branches(experts, dtype)
    skip = len(experts)
    idx = jnp.where(local >= 0, local, skip).reshape(n * k)
    rows = jnp.arange(n * k, dtype=jnp.int32) // k
    scale = weights.reshape(n * k).astype(jnp.float32)

    def body(a, out):
        t = rows[a]
        y = jax.lax.switch(idx[a], branches, jax.lax.dynamic_slice_in_dim(x, t, 1))
        return out.at[t].add(y[0].astype(jnp.float32) * scale[a])

    out = jax.lax.fori_loop(0, n * k, body, jnp.zeros((n, x.shape[-1]), jnp.float32))
    return out.astype(dtype)


def tile_rows(n_assign: int, n_experts: int) -> int:
    """Rows per tile for the tiled kernel: about a quarter of the mean rows per expert, a power of two."""
    per_expert = max(1, n_assign // max(1, min(n_experts, n_assign)))
    g = 1
    while g * 2 <= max(1, per_expert // 4) and g < 64:
        g *= 2
    return g


def _mixture_tiled(x, local, weights, experts):
    """Sort assignments by expert into tiles of G rows, one expert per tile, and switch per tile.

    Work is close to the routed work (each expert's rows are padded to a multiple of G) and each tile
    reads one expert's weights; the scan keeps the program small for any number of tiles.
    """
    n, k = local.shape
    d = x.shape[-1]
    n_exp = len(experts)
    dtype = experts[0].gate.dtype
    a = n * k
    g = tile_rows(a, n_exp)
    n_tiles = min(a, (a + min(n_exp, a) * (g - 1)) // g)  # static bound on sum_e ceil(count_e / G)

    flat_e = jnp.where(local.reshape(a) >= 0, local.reshape(a), n_exp)  # [A], n_exp = skipped
    flat_t = jnp.arange(a, dtype=jnp.int32) // k
    order = jnp.argsort(flat_e, stable=True)
    se, st, sw = flat_e[order], flat_t[order], weights.reshape(a)[order]

    counts = jnp.bincount(flat_e, length=n_exp + 1).at[n_exp].set(0)  # [n+1]
    tiles_per = (counts + g - 1) // g
    tile_start = jnp.cumsum(tiles_per) - tiles_per  # exclusive
    group_start = jnp.cumsum(jnp.bincount(flat_e, length=n_exp + 1)) - jnp.bincount(flat_e, length=n_exp + 1)
    rank = jnp.arange(a, dtype=jnp.int32) - group_start[se]
    dest = jnp.where(se < n_exp, tile_start[se] * g + rank, n_tiles * g)  # [A], out of range = dropped

    rows = jnp.zeros((n_tiles * g, d), x.dtype).at[dest].set(x[st], mode="drop")
    tile_ends = jnp.cumsum(tiles_per[:n_exp])  # [n]
    tile_expert = jnp.searchsorted(tile_ends, jnp.arange(n_tiles), side="right")  # n_exp past the end

    branches = _branches(experts, dtype)

    def one_tile(args):
        e, tile = args
        return jax.lax.switch(e, branches, tile)

    ys = jax.lax.map(one_tile, (tile_expert, rows.reshape(n_tiles, g, d))).reshape(n_tiles * g, d)
    contrib = ys[jnp.minimum(dest, n_tiles * g - 1)].astype(jnp.float32) * (sw * (se < n_exp))[:, None]
    return jnp.zeros((n, d), jnp.float32).at[st].add(contrib).astype(dtype)


def _mixture_ragged(x, local, weights, experts):
    """Grouped GEMM with `jax.lax.ragged_dot` over the stacked experts (fast where it is a native kernel)."""
    n, k = local.shape
    d = x.shape[-1]
    n_exp = len(experts)
    dtype = experts[0].gate.dtype
    gate = jnp.stack([w.gate for w in experts])  # [n, D, F]
    up = jnp.stack([w.up for w in experts])
    down = jnp.stack([w.down for w in experts])  # [n, F, D]
    a = n * k
    flat_e = jnp.where(local.reshape(a) >= 0, local.reshape(a), n_exp)
    order = jnp.argsort(flat_e, stable=True)
    se, st, sw = flat_e[order], (jnp.arange(a) // k)[order], weights.reshape(a)[order]
    sizes = jnp.bincount(flat_e, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    rows = x[st].astype(dtype)
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    y = jax.lax.ragged_dot(h, down, sizes)  # rows past sum(sizes) come back as zeros
    contrib = y.astype(jnp.float32) * (sw * (se < n_exp))[:, None]
    return jnp.zeros((n, d), jnp.float32).at[st].add(contrib).astype(dtype)


def _mixture_blocked(x, local, weights, experts):
    """Tiles of G rows, one expert each (as in `_mixture_tiled`), computed as one batched matmul over tiles
    with each tile's expert weights gathered from the stacked experts.

    Reads P tile copies of expert weights (P ~ A/G + n), so it is for training and large prefills, not
    decode. On XLA:CPU its forward and backward run about 5x faster than a dense all-experts mixture for
    8 experts top-2 and faster than `lax.switch` tiles (measured in the training benchmark of
    `fmoe_jax/train.py`), and unlike a capacity-limited dispatch it drops no token.
    """
    n, k = local.shape
    d = x.shape[-1]
    n_exp = len(experts)
    dtype = experts[0].gate.dtype
    a = n * k
    g = tile_rows(a, n_exp)
    n_tiles = min(a, (a + min(n_exp, a) * (g - 1)) // g)  # static bound on sum_e ceil(count_e / G)

    flat_e = jnp.where(local.reshape(a) >= 0, local.reshape(a), n_exp)  # [A], n_exp = skipped
    order = jnp.argsort(flat_e, stable=True)
    se, st, sw = flat_e[order], (jnp.arange(a, dtype=jnp.int32) // k)[order], weights.reshape(a)[order]
    counts = jnp.bincount(flat_e, length=n_exp + 1).at[n_exp].set(0)  # [n+1]
    tiles_per = (counts + g - 1) // g
    tile_start = jnp.cumsum(tiles_per) - tiles_per
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[se]
    dest = jnp.where(se < n_exp, tile_start[se] * g + rank, n_tiles * g)  # [A], out of range = dropped

    rows = jnp.zeros((n_tiles * g, d), dtype).at[dest].set(x[st].astype(dtype), mode="drop")
    tile_expert = jnp.searchsorted(jnp.cumsum(tiles_per[:n_exp]), jnp.arange(n_tiles), side="right")
    tile_expert = jnp.minimum(tile_expert, n_exp - 1)  # [P]; unused tiles hold zero rows and are not read
    gate, up, down = (jnp.stack([getattr(w, name) for w in experts]) for name in ("gate", "up", "down"))
    rows = rows.reshape(n_tiles, g, d)
    h = jax.nn.silu(jnp.einsum("pgd,pdf->pgf", rows, gate[tile_expert]))
    h = h * jnp.einsum("pgd,pdf->pgf", rows, up[tile_expert])
    ys = jnp.einsum("pgf,pfd->pgd", h, down[tile_expert]).reshape(n_tiles * g, d)
    contrib = ys[jnp.minimum(dest, n_tiles * g - 1)].astype(jnp.float32) * (sw * (se < n_exp))[:, None]
    return jnp.zeros((n, d), jnp.float32).at[st].add(contrib).astype(dtype)


def reference_mixture(x: jax.Array, routing: Routing, experts: Sequence[ExpertWeights]) -> jax.Array:
    """The slow, obviously correct per-expert loop that every fast kernel is tested against."""
    out = jnp.zeros(x.shape, jnp.float32)
    for e, w in enumerate(experts):
        weight = jnp.sum(jnp.where(routing.ids == e, routing.weights, 0.0), axis=-1)  # [N]
        out = out + swiglu(x, w).astype(jnp.float32) * weight[:, None]
    return out.astype(experts[0].gate.dtype)
