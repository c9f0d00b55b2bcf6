"""Routed experts: the SwiGLU expert, routing results, and the expert-mixture kernels behind one function.

`expert_mixture` is the whole mixture in one call (kernel tests, training); the models call its two halves,
`expert_parts` once per chunk of experts (the resident forward: one chunk of all) and `sum_parts` once per
layer (in `DecoderLayer.mix`). They take the weights of the experts to use as plain arrays, so the caller
decides where they live.

Why two halves: a layer whose experts run in chunks (a cache smaller than the layer's experts) must round
exactly as one call over all experts does, or offloading is not lossless in bfloat16. So every kernel
writes each (token, choice) assignment's weighted output, in float32, to its own place `[N, k, D]`
(zeros for assignments it skips); chunks fill disjoint places of one buffer, and `sum_parts` adds the k
places in one fixed order and rounds once, whichever chunk computed what.

Dimension letters: N tokens (B*T flattened), D hidden, F expert intermediate, J experts of a layer,
n experts passed to one call, A = N*k assignments, G rows per tile, P tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import linear
from .mxfp4 import Mxfp4Matrix, Mxfp4Weight
from .quant import (
    ExpertQuantization,
    QuantizedMatrix,
    QuantizedWeight,
    dense,
    quantized_weight,
    reference_dequantize,
    stack,
)

Matrix = jax.Array | QuantizedMatrix | Mxfp4Matrix


class ExpertWeights(NamedTuple):
    """One SwiGLU expert: `down(silu(x @ gate.T) * (x @ up.T))`, weights `[out, in]` as HF stores them
    (the layout XLA:CPU multiplies fastest by, see `models/layers.py`). A routed expert's matrices may be
    `QuantizedMatrix`es (`models/quant.py`) or `Mxfp4Matrix`es (`models/mxfp4.py`): every kernel dequantizes
    them inside the expert's own branch."""

    gate: Matrix  # [F, D]
    up: Matrix  # [F, D]
    down: Matrix  # [D, F]


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    `g = min(gate, limit)` (`swiglu_alpha`, `swiglu_limit` of its config). Hashable: static in the pytree."""

    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BiasedExpertWeights:
    """An expert whose projections have biases, with the clamped SwiGLU they come with (gpt-oss):
    `down(act(x @ gate.T + gate_bias, x @ up.T + up_bias)) + down_bias`. Field names are the `Expert`'s
    parameter names (the offload engine finds cached arrays by them); `activation` is static."""

    gate: Matrix  # [F, D]
    up: Matrix  # [F, D]
    down: Matrix  # [D, F]
    gate_bias: jax.Array  # [F]
    up_bias: jax.Array  # [F]
    down_bias: jax.Array  # [D]
    activation: ClampedSwiGLU = dataclasses.field(metadata=dict(static=True))


AnyExpertWeights = ExpertWeights | BiasedExpertWeights


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
        quantization: ExpertQuantization | None = None,
        activation: ClampedSwiGLU | None = None,
    ):
        """Initialised from `key` when given (one per routed expert), else from three draws of `rngs`. With
        `quantization` (routed experts only) each matrix is a `QuantizedWeight` (or `Mxfp4Weight`), zero
        until loaded. With `activation` (gpt-oss) the projections have biases (zeros) and that activation."""
        shapes = {
            "gate": (intermediate, hidden),
            "up": (intermediate, hidden),
            "down": (hidden, intermediate),
        }
        self.activation = activation
        if activation is not None:
            self.gate_bias = nnx.Param(jnp.zeros((intermediate,), dtype))
            self.up_bias = nnx.Param(jnp.zeros((intermediate,), dtype))
            self.down_bias = nnx.Param(jnp.zeros((hidden,), dtype))
        if quantization is not None:
            for name, shape in shapes.items():
                setattr(self, name, quantized_weight(*shape, quantization, dtype=dtype))
            return
        init = nnx.initializers.normal(0.02)
        keys = jax.random.split(key, 3) if key is not None else [rngs.params() for _ in range(3)]
        for k, (name, shape) in zip(keys, shapes.items(), strict=True):
            setattr(self, name, nnx.Param(init(k, shape, dtype)))

    def weights(self) -> AnyExpertWeights:
        matrices = [
            m.matrix() if isinstance(m, (QuantizedWeight, Mxfp4Weight)) else m[...]
            for m in (self.gate, self.up, self.down)
        ]
        if self.activation is None:
            return ExpertWeights(*matrices)
        biases = (self.gate_bias[...], self.up_bias[...], self.down_bias[...])
        return BiasedExpertWeights(*matrices, *biases, activation=self.activation)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.weights())


def swiglu(x: jax.Array, w: AnyExpertWeights) -> jax.Array:
    """x `[..., D]` -> `[..., D]` in the weights' dtype (quantized weights are dequantized here, inside the
    caller's branch for this expert, so that only experts some token uses are expanded)."""
    if isinstance(w, BiasedExpertWeights):
        gate, up, down = dense(w.gate), dense(w.up), dense(w.down)
        x = x.astype(gate.dtype)
        h = w.activation(linear(x, gate) + w.gate_bias, linear(x, up) + w.up_bias)
        return linear(h, down) + w.down_bias
    w = ExpertWeights(*(dense(m) for m in w))
    x = x.astype(w.gate.dtype)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    if rows > 1 and jax.default_backend() == "cpu":
        # The whole MLP in transposed activations `[., M]`, materialised (see `models/layers.py`).
        x_t = jax.lax.optimization_barrier(x.reshape(rows, d).T)  # [D, M]
        h_t = jax.nn.silu(w.gate @ x_t) * (w.up @ x_t)  # [F, M]
        y = jax.lax.optimization_barrier(w.down @ h_t).T  # [M, D]
        return y.reshape(*lead, d)
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


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

Kernel = Literal["auto", "unrolled", "grouped", "tiled", "ragged", "blocked"]
UNROLL_MAX_ASSIGNMENTS = 16
GROUPED_MAX_BODIES = 64  # "grouped" compiles (tile sizes x experts) expert bodies; above this, fewer sizes
GROUPED_MAX_ROWS = 256  # largest "grouped" tile: beyond ~128 rows an expert is compute bound anyway


def expert_mixture(
    x: jax.Array,
    routing: Routing,
    experts: Sequence[ExpertWeights],
    slot_of_expert: jax.Array,
    valid: jax.Array,
    *,
    kernel: Kernel = "auto",
) -> jax.Array:
    """Weighted sum of the chosen experts' outputs, `[N, D]` in the experts' dtype (arguments as
    `expert_parts`): `sum_parts(expert_parts(...))` rounded once."""
    if not experts:  # nothing routed here is resident in this call (e.g. every token is padding)
        return jnp.zeros(x.shape, x.dtype)
    parts = expert_parts(x, routing, experts, slot_of_expert, valid, kernel=kernel)
    return sum_parts(parts).astype(experts[0].gate.dtype)


def expert_parts(
    x: jax.Array,
    routing: Routing,
    experts: Sequence[ExpertWeights],
    slot_of_expert: jax.Array,
    valid: jax.Array,
    *,
    kernel: Kernel = "auto",
) -> jax.Array:
    """Each assignment's weighted expert output, unsummed.

    Args:
      x: `[N, D]` token activations.
      routing: ids and weights `[N, k]`.
      experts: the n experts available to this call (at least one).
      slot_of_expert: `[J]` int32, position of each layer expert in `experts`, or -1 (its assignments are
        skipped: the engine runs a layer in chunks this way).
      valid: `[N]` bool; invalid tokens (padding, finished rows) contribute nothing and load nothing.
      kernel: "unrolled" switches per assignment (decode); "grouped" sorts assignments by expert and runs
        each expert's rows as one tile of a size picked from a few (prefill); "tiled" uses tiles of one
        size, several per expert; "ragged" stacks the experts and uses `jax.lax.ragged_dot` (grouped GEMM
        on GPU/TPU); "blocked" sorts into tiles like "tiled" but gathers each tile's expert weights and
        runs one batched matmul (exact and differentiable; the training path on CPU, see
        `research/train.py`); "auto" picks by size and backend.
    Returns:
      `[N, k, D]` float32: `weight * expert(x)` of each assignment, zero for skipped ones. An assignment's
      value does not depend on which other experts are passed: tile sizes follow the layer's J
      (`slot_of_expert`'s length), not n, so a chunked layer computes each expert exactly as one call
      over all experts does ("ragged" excepted: its grouped GEMM is not specified that finely).
    """
    n_assign = routing.ids.size
    if kernel == "auto":
        kernel = "unrolled" if n_assign <= UNROLL_MAX_ASSIGNMENTS else "grouped"
    local = jnp.where(valid[:, None], slot_of_expert[routing.ids], -1)  # [N, k]
    fn = {
        "unrolled": _mixture_unrolled,
        "grouped": _mixture_grouped,
        "tiled": _mixture_tiled,
        "ragged": _mixture_ragged,
        "blocked": _mixture_blocked,
    }[kernel]
    num_layer_experts = slot_of_expert.shape[0]
    out = fn(x, local, routing.weights, tuple(experts), num_layer_experts)  # [A, D]
    return out.reshape(*local.shape, x.shape[-1])


def sum_parts(parts: jax.Array) -> jax.Array:
    """`[N, k, D]` -> `[N, D]` float32, adding the k choices left to right (one order for every caller:
    the resident forward, and the offload engine after its last chunk)."""
    return functools.reduce(jnp.add, [parts[:, i] for i in range(parts.shape[1])])


def _branches(experts: tuple[ExpertWeights, ...], dtype: jnp.dtype):
    """`lax.switch` branches: one per expert, plus a last one that returns zeros (skipped assignment)."""

    def make(w):
        return lambda rows: swiglu(rows, w)

    return [make(w) for w in experts] + [lambda rows: jnp.zeros(rows.shape, dtype)]


def _mixture_unrolled(x, local, weights, experts, num_layer_experts):
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
        y = jax.lax.switch(idx[a], branches, jax.lax.dynamic_slice_in_dim(x, rows[a], 1))
        return out.at[a].set(y[0].astype(jnp.float32) * scale[a])

    return jax.lax.fori_loop(0, n * k, body, jnp.zeros((n * k, x.shape[-1]), jnp.float32))


def _sort_by_expert(local, weights, n_exp):
    """Assignments `[N, k]` flattened and stably sorted by expert (skipped ones, -1, last as `n_exp`):
    returns the unsorted expert ids `[A]`, the sorted (expert, token, weight) and the sorted order (each
    sorted row's assignment index), each `[A]`."""
    n, k = local.shape
    a = n * k
    flat_e = jnp.where(local.reshape(a) >= 0, local.reshape(a), n_exp)
    order = jnp.argsort(flat_e, stable=True)
    tokens = jnp.arange(a, dtype=jnp.int32) // k
    return flat_e, flat_e[order], tokens[order], weights.reshape(a)[order], order


def _unsort(contrib: jax.Array, order: jax.Array) -> jax.Array:
    """Sorted rows' contributions `[A, D]` back to assignment order (a permutation: each place once)."""
    return jnp.zeros(contrib.shape, contrib.dtype).at[order].set(contrib, unique_indices=True)


def _ceil8(x: float) -> int:
    return max(8, -(-int(math.ceil(x)) // 8) * 8)


def group_sizes(n_assign: int, n_experts: int) -> tuple[int, ...]:
    """Tile sizes of the grouped kernel, ascending multiples of 8 from about half to about twice the mean
    rows per expert (at most `GROUPED_MAX_ROWS`), as many as `GROUPED_MAX_BODIES` allows; with room for
    only one size, the mean itself. The largest is also the size of the full tiles of an expert with
    more rows than it."""
    mean = n_assign / max(1, min(n_experts, n_assign))
    room = max(1, GROUPED_MAX_BODIES // max(1, n_experts))
    if room == 1:
        return (min(GROUPED_MAX_ROWS, _ceil8(mean)),)
    low = min(GROUPED_MAX_ROWS, _ceil8(mean / 2))
    top = min(GROUPED_MAX_ROWS, _ceil8(2 * mean))
    step = _ceil8((top - low) / (room - 1))
    return tuple(range(low, top, step)) + (top,)


def _mixture_grouped(x, local, weights, experts, num_layer_experts):
    """Sort assignments by expert; each expert's rows run as one tile of the smallest size that holds
    them (experts with more rows than the largest size add full tiles of it), so each expert's weights
    are read about once per call and little compute goes to padding.

    Why: on XLA:CPU a SwiGLU expert on M rows costs about (read the weights once) + M x (compute per
    row) for M a multiple of 8 (bench-s: 1.5 ms + 0.14 ms per row), so several small tiles per expert
    (the "tiled" kernel) pay the read several times, and padding to powers of two pays for empty rows.
    One `lax.map` over tile records, each a `lax.switch` over (expert, size) branches; measured on
    bench-s (128 tokens, 8 experts, top-2): 49 ms per layer, against 57 ms with a separate loop per size
    and 79 ms for "tiled" with 32-row tiles.
    """
    n, k = local.shape
    d = x.shape[-1]
    n_exp = len(experts)
    dtype = experts[0].gate.dtype
    a = n * k
    sizes = group_sizes(a, num_layer_experts)
    top, n_sizes = sizes[-1], len(sizes)

    flat_e, se, st, sw, order = _sort_by_expert(local, weights, n_exp)
    counts = jnp.bincount(flat_e, length=n_exp + 1)[:n_exp]  # [n]
    first = jnp.cumsum(counts) - counts  # [n], first sorted row of each expert
    rows = jnp.concatenate([x[st].astype(dtype), jnp.zeros((top, d), dtype)])  # sorted rows + slack

    # Tile records (branch, first row, rows): one per expert for its last rows, then every full tile.
    n_full = jnp.maximum(counts - 1, 0) // top  # the last tile keeps 1..top rows
    rest = counts - n_full * top
    size_index = jnp.searchsorted(jnp.asarray(sizes), rest)  # smallest size >= rest
    skip = n_exp * n_sizes
    branch = [jnp.where(counts > 0, jnp.arange(n_exp) * n_sizes + size_index, skip)]
    start, used = [first + n_full * top], [rest]
    if a // top:
        tile_end = jnp.cumsum(n_full)
        full_e = jnp.searchsorted(tile_end, jnp.arange(a // top), side="right")  # n_exp: no tile
        e = jnp.minimum(full_e, n_exp - 1)
        branch.append(jnp.where(full_e < n_exp, e * n_sizes + n_sizes - 1, skip))
        start.append(first[e] + (jnp.arange(a // top) - (tile_end - n_full)[e]) * top)
        used.append(jnp.where(full_e < n_exp, top, 0))
    branch, start, used = (jnp.concatenate(v).astype(jnp.int32) for v in (branch, start, used))

    def make(w, size):
        def run(first_row):
            y = swiglu(jax.lax.dynamic_slice_in_dim(rows, first_row, size), w)
            return jnp.pad(y, ((0, top - size), (0, 0)))

        return run

    branches = [make(w, size) for w in experts for size in sizes]
    branches.append(lambda first_row: jnp.zeros((top, d), dtype))
    ys = jax.lax.map(lambda rec: jax.lax.switch(rec[0], branches, rec[1]), (branch, start))  # [R, top, D]

    offset = jnp.arange(top)
    pos = jnp.where(offset[None, :] < used[:, None], start[:, None] + offset, a + 1)  # a + 1: dropped
    out_sorted = (
        jnp.zeros((a, d), jnp.float32)
        .at[pos.reshape(-1)]
        .set(ys.reshape(-1, d).astype(jnp.float32), mode="drop")
    )
    return _unsort(out_sorted * (sw * (se < n_exp))[:, None], order)


def tile_rows(n_assign: int, n_experts: int) -> int:
    """Rows per tile for the tiled kernel: about a quarter of the mean rows per expert, a power of two."""
    per_expert = max(1, n_assign // max(1, min(n_experts, n_assign)))
    g = 1
    while g * 2 <= max(1, per_expert // 4) and g < 64:
        g *= 2
    return g


class _Tiles(NamedTuple):
    """Assignments sorted by expert into tiles of G rows, one expert per tile (the tiled and blocked
    kernels): P = `count` tiles (a static bound on sum_e ceil(rows_e / G)); `tokens`, `weight`, `kept` of
    the sorted assignments; `dest` each sorted assignment's row among the P * G (P * G: dropped);
    `expert` each tile's expert (n: none)."""

    rows: int  # G
    count: int  # P
    tokens: jax.Array  # [A]
    weight: jax.Array  # [A], zero for skipped assignments
    order: jax.Array  # [A], each sorted assignment's original index
    dest: jax.Array  # [A]
    expert: jax.Array  # [P]


def _tile(local: jax.Array, weights: jax.Array, n_exp: int, num_layer_experts: int) -> _Tiles:
    n, k = local.shape
    a = n * k
    g = tile_rows(a, num_layer_experts)
    n_tiles = min(a, (a + min(n_exp, a) * (g - 1)) // g)
    flat_e, se, st, sw, order = _sort_by_expert(local, weights, n_exp)
    counts = jnp.bincount(flat_e, length=n_exp + 1).at[n_exp].set(0)  # [n+1]
    tiles_per = (counts + g - 1) // g
    tile_start = jnp.cumsum(tiles_per) - tiles_per  # exclusive
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[se]
    dest = jnp.where(se < n_exp, tile_start[se] * g + rank, n_tiles * g)
    expert = jnp.searchsorted(jnp.cumsum(tiles_per[:n_exp]), jnp.arange(n_tiles), side="right")
    return _Tiles(g, n_tiles, st, sw * (se < n_exp), order, dest, expert)


def _untile(ys: jax.Array, tiles: _Tiles) -> jax.Array:
    """Tile outputs `[P * G, D]` -> each assignment's weighted output `[A, D]` float32, assignment order."""
    top = tiles.count * tiles.rows - 1
    contrib = ys[jnp.minimum(tiles.dest, top)].astype(jnp.float32) * tiles.weight[:, None]
    return _unsort(contrib, tiles.order)


def _mixture_tiled(x, local, weights, experts, num_layer_experts):
    """Sort assignments by expert into tiles of G rows, one expert per tile, and switch per tile.

    Work is close to the routed work (each expert's rows are padded to a multiple of G) and each tile
    reads one expert's weights; the scan keeps the program small for any number of tiles.
    """
    d = x.shape[-1]
    tiles = _tile(local, weights, len(experts), num_layer_experts)
    g, p = tiles.rows, tiles.count
    rows = jnp.zeros((p * g, d), x.dtype).at[tiles.dest].set(x[tiles.tokens], mode="drop")
    branches = _branches(experts, experts[0].gate.dtype)  # tile.expert == n: the zeros branch

    def one_tile(args):
        e, tile = args
        return jax.lax.switch(e, branches, tile)

    ys = jax.lax.map(one_tile, (tiles.expert, rows.reshape(p, g, d)))
    return _untile(ys.reshape(p * g, d), tiles)


def _mixture_ragged(x, local, weights, experts, num_layer_experts):
    """Grouped GEMM with `jax.lax.ragged_dot` over the stacked experts (fast where it is a native kernel)."""
    n_exp = len(experts)
    dtype = experts[0].gate.dtype
    gate, up, down = (stack([getattr(w, name) for w in experts]).mT for name in ("gate", "up", "down"))
    # gate, up [n, D, F]; down [n, F, D]
    flat_e, se, st, sw, order = _sort_by_expert(local, weights, n_exp)
    sizes = jnp.bincount(flat_e, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    rows = x[st].astype(dtype)
    row_expert = jnp.minimum(se, n_exp - 1)  # [A]; skipped rows come back as zeros whatever their bias
    g, u = jax.lax.ragged_dot(rows, gate, sizes), jax.lax.ragged_dot(rows, up, sizes)
    y = jax.lax.ragged_dot(_activate(experts, g, u, row_expert), down, sizes)  # rows past sum(sizes): 0
    y = _add_down_bias(experts, y, row_expert)
    return _unsort(y.astype(jnp.float32) * (sw * (se < n_exp))[:, None], order)


def _activate(experts: tuple, gate: jax.Array, up: jax.Array, expert: jax.Array) -> jax.Array:
    """The stacking kernels' activation: SwiGLU, or (biased experts) the clamped SwiGLU of the pre-activations
    plus each row's expert's biases. gate, up `[..., F]`; `expert` indexes the leading dimensions."""
    w = experts[0]
    if not isinstance(w, BiasedExpertWeights):
        return jax.nn.silu(gate) * up
    gate_bias, up_bias = (jnp.stack([getattr(e, name) for e in experts]) for name in ("gate_bias", "up_bias"))
    return w.activation(gate + _at(gate_bias, expert, gate), up + _at(up_bias, expert, up))


def _add_down_bias(experts: tuple, y: jax.Array, expert: jax.Array) -> jax.Array:
    if not isinstance(experts[0], BiasedExpertWeights):
        return y
    return y + _at(jnp.stack([e.down_bias for e in experts]), expert, y)


def _at(bias: jax.Array, expert: jax.Array, like: jax.Array) -> jax.Array:
    """Stacked biases `[n, X]` picked per `expert` (shape of `like`'s leading dims), broadcast to `like`."""
    picked = bias[expert]  # [*expert.shape, X]
    return picked.reshape(*picked.shape[:-1], *(1,) * (like.ndim - picked.ndim), picked.shape[-1])


def _mixture_blocked(x, local, weights, experts, num_layer_experts):
    """Tiles of G rows, one expert each (as in `_mixture_tiled`), computed as one batched matmul over tiles
    with each tile's expert weights gathered from the stacked experts.

    Reads P tile copies of expert weights (P ~ A/G + n), so it is for training and large prefills, not
    decode. On XLA:CPU its forward and backward run about 5x faster than a dense all-experts mixture for
    8 experts top-2 and faster than `lax.switch` tiles (measured in the training benchmark of
    `research/train.py`), and unlike a capacity-limited dispatch it drops no token.
    """
    d = x.shape[-1]
    dtype = experts[0].gate.dtype
    tiles = _tile(local, weights, len(experts), num_layer_experts)
    g, p = tiles.rows, tiles.count
    rows = jnp.zeros((p * g, d), dtype).at[tiles.dest].set(x[tiles.tokens].astype(dtype), mode="drop")
    expert = jnp.minimum(tiles.expert, len(experts) - 1)  # [P]; unused tiles hold zero rows, not read
    gate, up, down = (stack([getattr(w, name) for w in experts]) for name in ("gate", "up", "down"))
    rows = rows.reshape(p, g, d)
    pre_gate = jnp.einsum("pgd,pfd->pgf", rows, gate[expert])
    h = _activate(experts, pre_gate, jnp.einsum("pgd,pfd->pgf", rows, up[expert]), expert)
    ys = _add_down_bias(experts, jnp.einsum("pgf,pdf->pgd", h, down[expert]), expert)
    return _untile(ys.reshape(p * g, d), tiles)


def reference_mixture(x: jax.Array, routing: Routing, experts: Sequence[AnyExpertWeights]) -> jax.Array:
    """The slow, obviously correct per-expert loop that every fast kernel is tested against. Quantized
    experts are dequantized first by `reference_dequantize` (NumPy, so not under a trace), then multiplied."""

    def plain(m):
        quantized = isinstance(m, (QuantizedMatrix, Mxfp4Matrix))
        return jnp.asarray(reference_dequantize(m)) if quantized else m

    out = jnp.zeros(x.shape, jnp.float32)
    for e, w in enumerate(experts):
        gate, up, down = plain(w.gate), plain(w.up), plain(w.down)
        weight = jnp.sum(jnp.where(routing.ids == e, routing.weights, 0.0), axis=-1)  # [N]
        xe = x.astype(gate.dtype)
        if isinstance(w, BiasedExpertWeights):  # plain jnp, not `swiglu`
            h = w.activation(xe @ gate.T + w.gate_bias, xe @ up.T + w.up_bias)
            y = h @ down.T + w.down_bias
        else:
            y = (jax.nn.silu(xe @ gate.T) * (xe @ up.T)) @ down.T
        out = out + y.astype(jnp.float32) * weight[:, None]
    return out.astype(plain(experts[0].gate).dtype)
