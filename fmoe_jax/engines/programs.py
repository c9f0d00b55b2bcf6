"""The jitted programs an engine runs, owned by the model that made them: the whole-model step (resident
engine) and the offload engine's chunk programs (its step program is `engines/segment.py`).

`Programs` makes every `jax.jit` of one model (so its executables are freed with the model), compiles each
with exact bfloat16 rounding, and counts and times its compilations; `generate` reports that time as
`compile_s`, apart from decoding. A new program also runs once, on copies of its arguments, before the call
that needs it: XLA does part of its work on an executable's first run (7-20 ms a program on this CPU, against
2-5 ms for later runs), and that first run is charged to `compile_s` too, so that a first `generate` call
decodes as fast as a later one. Engines of the same weights may share one `Programs`
(`OffloadEngine(..., programs=model.engine.programs)`) so that a benchmark comparing policies compiles once.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fmoe_jax.models import init_kv_cache
from fmoe_jax.models.layers import Layout, cache_shape
from fmoe_jax.models.moe import Kernel, expert_parts

from ..sampling import Sampling

# Round every bfloat16 intermediate where the program says so. With excess precision allowed (XLA's default)
# a fusion may keep a value in float32 that the program rounds to bfloat16, so the same layer rounds
# differently inside the whole-model program and inside the per-layer programs: on the shipped bf16 models
# that flipped greedy tokens between a full and a partial expert cache. Set per program, this changes no
# program of the user's (unlike the process-wide XLA_FLAGS); decode speed was unchanged in our measurements.
EXACT_ROUNDING = {"xla_allow_excess_precision": False}


@dataclasses.dataclass(frozen=True)
class Graph:
    """A module's structure, hashable; jitted steps close over it and take the parameters as a flat list.

    Passing an `nnx.State` to a jitted function flattens it in Python on every call (~0.1 ms for one
    layer on this CPU); a list of arrays takes JAX's fast path.
    """

    graphdef: Any
    treedef: Any

    def merge(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def split(module: Any) -> tuple[Graph, list[jax.Array]]:
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return Graph(graphdef, treedef), leaves


class Programs:
    """One model's jitted programs: made, memoized, counted and timed here.

    `compilations` counts traces by label (a label names a program and the shapes it was traced for), so a
    test or benchmark sees any recompilation; `compile_s` is the wall time of compiling, and of each new
    program's first run.
    """

    def __init__(self) -> None:
        self.compilations: collections.Counter[str] = collections.Counter()
        self.compile_s = 0.0
        self._traced = 0
        self._made: dict[Any, Any] = {}

    def count(self, label: str) -> None:
        """Called while tracing (so once per compilation)."""
        self.compilations[label] += 1
        self._traced += 1

    def jit(
        self,
        fn: Callable,
        label: Callable[..., str],
        *,
        compiler_options: dict[str, Any] | None = None,
        donate_argnums: int | tuple[int, ...] = (),
        static_argnums: int | tuple[int, ...] = (),
        **jit_kwargs: Any,
    ) -> Callable:
        """`jax.jit(fn)` with exact rounding (and any other `compiler_options`), counted by `label(*args)`.

        `label` names the program a call needs from its arguments' shapes, cheaply (it runs on every call).
        The first call with a new label (or new static arguments) compiles the program and runs it once on
        copies of the donated arguments, both charged to `compile_s`, before the real run. The copies hold
        the donated arguments' memory a second time during that one run: the KV cache, for the whole-model
        step; one layer's, for the per-layer steps. A compilation the label did not foresee (say, a new
        dtype) happens inside the real call, which is then charged to `compile_s` whole, its first run
        included.
        """
        donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.count(label(*args, **kwargs))
            return fn(*args, **kwargs)

        jitted = jax.jit(
            traced,
            compiler_options={**EXACT_ROUNDING, **(compiler_options or {})},
            donate_argnums=donated,
            static_argnums=static,
            **jit_kwargs,
        )
        warmed: set[tuple] = set()

        def call(*args: Any, **kwargs: Any) -> Any:
            key = (label(*args, **kwargs), *(args[i] for i in static), *sorted(kwargs.items()))
            if key not in warmed:
                start = time.perf_counter()
                copies = [_copy(a) if i in donated else a for i, a in enumerate(args)]
                jax.block_until_ready(jitted(*copies, **kwargs))
                del copies
                warmed.add(key)
                self.compile_s += time.perf_counter() - start
            start, before = time.perf_counter(), self._traced
            out = jitted(*args, **kwargs)
            if self._traced != before:
                self.compile_s += time.perf_counter() - start
            return out

        return call

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()` once per key (graphs compare by structure: every layer of a model shares its steps)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def _copy(tree: Any) -> Any:
    """A copy of every array in `tree`, placed as its original (committed or not: JAX compiles a call on
    committed arguments apart from one on uncommitted ones)."""
    return jax.tree.map(jnp.copy, tree)


class Recorded(NamedTuple):
    """What a step records for a routing trace (host or device arrays)."""

    embeds: Any  # [B, T, D] embedding output of the new tokens (the semantic context)
    probs: Any  # [B, T, L_moe, J] router probabilities
    ids: Any  # [B, T, L_moe, k] chosen experts
    hidden: Any  # [B, T, L_moe, D] router inputs, or None


def per_row(layout: Layout) -> str:
    """A label's mark for a layout with a write index per row (continuous batching), traced apart."""
    return "_per_row" if np.ndim(layout.write_index) else ""


def _whole_label(params, tokens, cache, layout, *_: Any) -> str:
    return f"whole_step_T{tokens.shape[1]}_S{cache_shape(cache)[1]}_B{tokens.shape[0]}{per_row(layout)}"


# -- the whole model ---------------------------------------------------------------------------------------
def whole_step(programs: Programs, graph: Graph, kernel: Kernel) -> Callable:
    """The jitted whole-model step: prefill (T > 1) or one decode step (T = 1), sampling included."""

    def step(params, tokens, cache, layout, key, sampling: Sampling, record: bool, record_hidden: bool):
        model = graph.merge(params)
        hidden = [] if record_hidden else None
        logits, cache, routings = model(
            tokens, cache, layout, kernel=kernel, last_only=True, moe_inputs=hidden
        )
        next_tokens = sampling(logits, key)
        if not record:
            return next_tokens, logits, cache, None
        b, t = tokens.shape
        probs = jnp.stack([r.probs for r in routings], axis=1).reshape(b, t, len(routings), -1)
        ids = jnp.stack([r.ids for r in routings], axis=1).reshape(b, t, len(routings), -1)
        if hidden is not None:
            hidden = jnp.stack(hidden, axis=1).reshape(b, t, len(routings), -1)
        return next_tokens, logits, cache, Recorded(model.embed_tokens(tokens), probs, ids, hidden)

    return programs.memo(
        ("whole", graph, kernel),
        lambda: programs.jit(step, _whole_label, static_argnums=(5, 6, 7), donate_argnums=2),
    )


def full_forward(programs: Programs, graph: Graph, kernel: Kernel) -> Callable:
    """Full-sequence logits `[B, T, V]` and routings of unpadded tokens `[B, T]` (no sampling)."""

    def forward(params, tokens, cache, layout):
        logits, cache, routings = graph.merge(params)(tokens, cache, layout, kernel=kernel)
        return logits, routings, cache

    return programs.memo(
        ("forward", graph, kernel),
        lambda: programs.jit(
            forward, lambda params, tokens, *_: f"full_forward_T{tokens.shape[1]}", donate_argnums=2
        ),
    )


def forward_inputs(config: Any, tokens: Any, dtype: Any) -> tuple[list, Layout]:
    """The KV cache and layout `forward` runs a batch with, in either engine. The cache has one position
    more than the tokens, as every `generate` step's has: a cache the new keys fill exactly lets XLA fold
    the cache update away, differently in the whole-model program and in the per-layer programs, and
    float32 logits then differ in the last bit between the resident and the offload engine."""
    b, t = tokens.shape
    layout = Layout(np.int32(0), np.zeros((b,), np.int32), np.ones((b,), bool), t)
    return init_kv_cache(config, b, t + 1, dtype), layout


def insert_row(programs: Programs) -> Callable:
    """`insert(cache, row, slot)`: a one-row cache `row` copied into row `slot` (a traced int) of a batch's
    `cache` (donated), every layer (its keys and values, or a linear layer's state). Continuous batching
    prefills a joining request on its own and then moves it into its slot (`fmoe_jax/batching.py`)."""

    def insert(cache, row, slot):
        def put(whole, one):
            return jax.lax.dynamic_update_slice(whole, one, (slot,) + (0,) * (whole.ndim - 1))

        return [jax.tree.map(put, c, r) for c, r in zip(cache, row, strict=True)]

    return programs.memo(
        "insert_row",
        lambda: programs.jit(
            insert,
            lambda cache, *_: "insert_row_B{}_S{}".format(*cache_shape(cache)),
            donate_argnums=0,
        ),
    )


# -- the offload engine's programs besides its step (`engines/segment.py`) ---------------------------------
def experts_partial(programs: Programs, kernel: Kernel) -> Callable:
    """`partial(z, routing, experts, slots, valid, acc)`: one chunk's assignment outputs added to `acc`
    `[N, k, D]` float32 (other chunks' places are zero here): a layer's chunks before its last, or one
    device's share of it."""

    def partial(z, routing, experts, slots, valid, acc):
        return acc + expert_parts(z, routing, experts, slots, valid, kernel=kernel)

    return programs.memo(
        ("experts_partial", kernel),
        lambda: programs.jit(
            partial, lambda z, r, experts, *_: f"experts_partial_N{z.shape[0]}_n{len(experts)}"
        ),
    )


def add_parts(programs: Programs) -> Callable:
    """Two assignment-output buffers `[N, k, D]` float32 added (hybrid execution: the host's places and the
    device's are disjoint, so the sum is exact)."""

    def add(a, b):
        return a + b

    return programs.memo("add_parts", lambda: programs.jit(add, lambda a, b: f"add_parts_N{a.shape[0]}"))


def chunk_width(n: int, capacity: int, num_experts: int, tokens: int) -> int:
    """How many expert arguments a chunk of `n` experts passes to its jitted step (the rest repeat the first;
    no token is routed to them, so the switch kernels run nothing for them, while "ragged" and "blocked" still
    stack their weights). Decode steps pad to a power of two up to the cache capacity, so a few programs cover
    every count. Steps of several tokens (prefill) route to any number of experts per layer, so they always
    pass one width, min(J, capacity): a prompt whose layer happens to use fewer experts than any before it
    does not compile a new program mid-request."""
    if tokens > 1:
        n = max(n, min(num_experts, capacity))
    size = 1
    while size < n:
        size *= 2
    return max(n, min(size, capacity))


def no_parts(n: int, k: int, d: int) -> jax.Array:
    """The empty assignment-output buffer `[N, k, D]` float32 a layer's chunks fill."""
    return jnp.zeros((n, k, d), jnp.float32)
