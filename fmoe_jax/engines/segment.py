"""The offload engine's step program: the model's layers from an entry point on, each MoE layer using the
routed experts the device holds, stopping at the first MoE layer that routes a token to one it lacks.

`engines/step_loop.py` launches it once at the start of a step (entry: the embedding) and once more after
each layer it stopped at (entry: that layer's experts, loaded by then), so that a step costs one launch and
one host read per stop, and a step whose routed experts are all resident costs one of each whatever the
budget. Which experts a launch may use is a device-side slot table `[L, J]` (-1: absent) over the model's
own expert parameters, where the engine passes each held expert's cached arrays and a placeholder for the
others. Arrays as arguments need no device-side copy of a landed expert into a pool; but on an H200 a
stacked pool (one argument per weight, a dynamic index per expert) ran a decode layer's experts 6.7x faster
than this switch, and every argument costs a launch ~0.8 us (decision "stacked expert pool",
`benchmarks/DECISIONS.md`): the change this engine has measured and not yet made.

Layers before the entry point and after the stop are skipped with `lax.cond`, their cache entries passed
through untouched (any per-layer state, a KV cache or another pytree), so one program serves every entry
point; its arithmetic is the resident forward's (`MoECausalLM.__call__`), op for op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fmoe_jax.models.layers import Layout, cache_shape
from fmoe_jax.models.moe import ForcedRouting, Kernel, Routing, expert_parts

from ..sampling import Sampling
from .programs import Graph, Programs, per_row

SKIP, FINISH, FULL = 0, 1, 2  # what a launch does with one MoE layer
# XLA copies a cache entry that a conditional's branch passes through unchanged unless copy insertion runs
# its region analysis: with it, a skipped layer's KV cache stays in place (a copy per skipped layer would
# cost a launch the size of the whole cache on a device at long context). Each backend reads its own.
COPY_ELISION = {
    "xla_cpu_copy_insertion_use_region_analysis": True,
    "xla_gpu_copy_insertion_use_region_analysis": True,
}


class Entry(NamedTuple):
    """Where a launch starts: MoE layer `start`'s attention output and routing, whose experts it runs first
    (adding `acc`, the outputs of the layer's earlier chunks or of the host); `start` -1: the embedding."""

    start: jax.Array  # [] int32, MoE-layer index, or -1
    h: jax.Array  # [B, T, D] residual stream after the layer's attention
    z: jax.Array  # [N, D] the layer's MLP input
    routing: Routing  # [N, k] ids and weights, [N, J] probabilities
    acc: jax.Array  # [N, k, D] float32 ([n, N, k, D]: per device) assignment outputs computed outside


class Segment(NamedTuple):
    """What one launch returns. What the host reads comes packed in two vectors, one copy each."""

    exit: Entry  # the stop layer's state, the next launch's entry (its `acc` zeros)
    # [1 + B + N*L*k] int32: the MoE layer it stopped at (routed, experts not run; L: it ran to the end),
    # the sampled tokens (meaningful when it ran to the end), and each MoE layer's chosen experts `[N, L, k]`
    # (zeros for layers it did not route).
    ints: jax.Array
    # float32: the router probabilities `[N, L, J]`, the router inputs `[N, L, D]` when recorded, and the
    # embedding `[N, D]` (the semantic context; meaningful when it started from the embedding).
    floats: jax.Array
    tokens: jax.Array  # [B] int32, the sampled tokens, on the device
    logits: jax.Array  # [B, V] float32, or [B, T, V] with `all_positions`


def _label(params, slots, tokens, cache, layout, *_: Any) -> str:
    b, t = tokens.shape
    return f"offload_step_T{t}_B{b}_S{cache_shape(cache)[1]}{per_row(layout)}"


def offload_step(programs: Programs, graph: Graph, kernel: Kernel) -> Callable:
    """The jitted step `(params, slots, tokens, kv, layout, key, entry, sampling, record_hidden,
    all_positions, forced) -> (Segment, kv)`: params the module's leaves (routed experts: cached arrays or
    the placeholder), slots `[L, J]` int32, kv donated, forced a `ForcedRouting` or None. The layers are
    traced by `_Walk`."""

    def step(
        params,
        slots,
        tokens,
        kv,
        layout: Layout,
        key,
        entry: Entry,
        sampling,
        record_hidden,
        all_positions,
        forced: ForcedRouting | None,
    ):
        model = graph.merge(params)
        walk = _Walk(model, slots, tokens, layout, key, entry, sampling, kernel, record_hidden, forced)
        caches, (ids, probs, hidden), stop, (h, z, routing), tokens_out, logits = walk.layers_from(
            0, walk.embeds, entry.start < 0, list(kv), all_positions
        )
        ints = jnp.concatenate([stop[None], tokens_out, ids.ravel()])
        parts = [
            probs.ravel(),
            *([] if hidden is None else [hidden.ravel()]),
            walk.embeds.astype(jnp.float32).ravel(),
        ]
        exit_ = Entry(stop, h, z, routing, jnp.zeros_like(entry.acc))
        return Segment(exit_, ints, jnp.concatenate(parts), tokens_out, logits), caches

    return programs.memo(
        ("offload_step", graph, kernel),
        lambda: programs.jit(
            step, _label, static_argnums=(7, 8, 9), donate_argnums=3, compiler_options=COPY_ELISION
        ),
    )


class _Walk:
    """One trace of the step program's layers (`offload_step`).

    Each layer's remainder is nested in the branch that continues after it, so a launch that stops skips
    the rest in one conditional; layers before the entry are skipped one by one. Cache entries pass through
    skipped layers without a copy (`COPY_ELISION`)."""

    def __init__(
        self, model, slots, tokens, layout: Layout, key, entry: Entry, sampling, kernel, record_hidden, forced
    ):
        self.model, self.cfg, self.slots, self.layout = model, model.config, slots, layout
        self.key, self.entry, self.sampling, self.kernel = key, entry, sampling, kernel
        self.record_hidden, self.forced = record_hidden, forced
        self.b, t = tokens.shape
        self.n = self.b * t
        self.valid = layout.token_valid.reshape(self.n)
        self.rope = model.rope(layout)
        self.embeds = model.embed_tokens(tokens)
        self.moe_index = {layer: m for m, layer in enumerate(self.cfg.moe_layer_ids)}
        self.nothing = jax.tree.map(jnp.zeros_like, (entry.h, entry.z, entry.routing))  # no stop state

    def records(self, count: int) -> tuple:
        """Zero records `[N, count, ...]` of MoE layers a launch did not route."""
        cfg, n = self.cfg, self.n
        hidden = jnp.zeros((n, count, cfg.hidden_size), jnp.float32) if self.record_hidden else None
        return jnp.zeros((n, count, cfg.top_k), jnp.int32), jnp.zeros((n, count, cfg.num_experts)), hidden

    def head(self, x, all_positions: bool):
        if all_positions:
            return jnp.zeros((self.b,), jnp.int32), self.model.head(x)
        logits = self.model.head(x[:, -1:, :])[:, 0]
        return self.sampling(logits, self.key).astype(jnp.int32), logits

    def layers_from(self, i: int, x, active, caches: list, all_positions: bool):
        """Layers i.. on residual stream x (`active`: False before the entry) -> their caches, the records
        of their MoE layers, the stop layer and its state, tokens and logits."""
        cfg = self.cfg
        if i == cfg.num_layers:
            return (
                [],
                self.records(0),
                jnp.int32(cfg.num_moe_layers),
                self.nothing,
                *self.head(x, all_positions),
            )
        layer, cache = self.model.layers[i], caches[0]
        if not layer.is_moe:
            rope, layout = self.rope, self.layout
            x, cache = jax.lax.cond(
                active, lambda x, c: _dense(layer, x, c, rope, layout), lambda x, c: (x, c), x, cache
            )
            out = self.layers_from(i + 1, x, active, caches[1:], all_positions)
            return [cache, *out[0]], *out[1:]
        m = self.moe_index[i]
        entry = self.entry
        mode = jnp.where(m == entry.start, FINISH, jnp.where(active, FULL, SKIP))
        h, z, routing, cache, record = jax.lax.cond(
            mode == FULL, self.attend(layer, m), self.entered, x, cache
        )
        row = self.slots[m]
        miss = (mode == FULL) & jnp.any(self.valid[:, None] & (row[routing.ids] < 0))
        ran = (mode != SKIP) & ~miss

        def run(x):
            parts = expert_parts(z, routing, self.model.layer_experts(i), row, self.valid, kernel=self.kernel)
            acc = entry.acc if entry.acc.ndim == 3 else jnp.sum(entry.acc, axis=0)  # per device: summed
            parts = jnp.where(mode == FINISH, acc + parts, parts)  # the entry adds what ran elsewhere
            return h + layer.mix(z, parts).reshape(h.shape).astype(h.dtype)

        x = jax.lax.cond(ran, run, lambda x: x, x)
        rest = cfg.num_moe_layers - m - 1

        def stopped(x, later):
            zeros = jax.eval_shape(lambda x: self.head(x, all_positions), x)
            tokens_out, logits = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            return later, self.records(rest), jnp.int32(m), (h, z, routing), tokens_out, logits

        out = jax.lax.cond(
            (mode == FULL) & ~ran,
            stopped,
            lambda x, later: self.layers_from(i + 1, x, ran, later, all_positions),
            x,
            caches[1:],
        )
        stacked = tuple(
            None if r is None else jnp.concatenate([r[:, None], rest_r], axis=1)
            for r, rest_r in zip(record, out[1], strict=True)
        )
        return [cache, *out[0]], stacked, *out[2:]

    def attend(self, layer: Any, m: int) -> Callable:
        """MoE layer m's attention and routing, as the resident forward computes them."""

        def attend(x, c):
            h, z, c = layer.attention_block(x, self.rope, c, self.layout)
            z = z.reshape(self.n, -1)
            routing = layer.route(z)
            if self.forced is not None:
                routing = self.forced.apply(m, routing)
            record = (routing.ids, routing.probs, z.astype(jnp.float32) if self.record_hidden else None)
            return h, z, routing, c, record

        return attend

    def entered(self, x, c):
        """The entry layer (its attention and routing ran in an earlier launch), or one before it."""
        entry = self.entry
        return entry.h, entry.z, entry.routing, c, _squeeze(self.records(1))


def _dense(layer: Any, x: jax.Array, cache: Any, rope: Any, layout: Layout) -> tuple[jax.Array, Any]:
    """A dense layer, as the resident forward computes it."""
    b, t, _ = x.shape
    h, z, cache = layer.attention_block(x, rope, cache, layout)
    y = layer.dense_output(z.reshape(b * t, -1))
    return h + y.reshape(b, t, -1).astype(h.dtype), cache


def _squeeze(record: tuple) -> tuple:
    """`[N, 1, ...]` records -> `[N, ...]` (one layer's)."""
    return tuple(None if r is None else r[:, 0] for r in record)


def entry_point(start: int, h: jax.Array, z: jax.Array, routing: Routing, acc: jax.Array) -> Entry:
    """An `Entry` with `start` as the int32 array the program takes."""
    return Entry(jnp.int32(start), h, z, routing, acc)


__all__ = ["Entry", "Segment", "Sampling", "entry_point", "offload_step"]
