"""The jitted programs an engine runs, owned by the model that made them: the whole-model step (resident
engine, and the offload engine's full-cache fast path) and the offload engine's per-layer steps.

`Programs` makes every `jax.jit` of one model (so its executables are freed with the model), compiles each
with exact bfloat16 rounding, and counts and times its compilations; `generate` reports that time as
`compile_s`, apart from decoding. Engines of the same weights may share one `Programs`
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

from fmoe_jax.models import MoECausalLM, init_kv_cache
from fmoe_jax.models.base import output_logits
from fmoe_jax.models.layers import Layout
from fmoe_jax.models.moe import Kernel, Routing, expert_parts

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
    test or benchmark sees any recompilation; `compile_s` is the wall time of the calls that compiled.
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

    def jit(self, fn: Callable, **jit_kwargs: Any) -> Callable:
        """`jax.jit(fn)` with exact rounding; a call that traced (and so compiled) adds to `compile_s`."""
        jitted = jax.jit(fn, compiler_options=EXACT_ROUNDING, **jit_kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
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


class Recorded(NamedTuple):
    """What a step records for a routing trace (host or device arrays)."""

    embeds: Any  # [B, T, D] embedding output of the new tokens (the semantic context)
    probs: Any  # [B, T, L_moe, J] router probabilities
    ids: Any  # [B, T, L_moe, k] chosen experts
    hidden: Any  # [B, T, L_moe, D] router inputs, or None


# -- the whole model ---------------------------------------------------------------------------------------
def whole_step(programs: Programs, graph: Graph, kernel: Kernel) -> Callable:
    """The jitted whole-model step: prefill (T > 1) or one decode step (T = 1), sampling included."""

    def step(params, tokens, cache, layout, key, sampling: Sampling, record: bool, record_hidden: bool):
        programs.count(f"whole_step_T{tokens.shape[1]}_S{cache[0].k.shape[1]}_B{tokens.shape[0]}")
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
        ("whole", graph, kernel), lambda: programs.jit(step, static_argnums=(5, 6, 7), donate_argnums=2)
    )


def full_forward(programs: Programs, graph: Graph, kernel: Kernel) -> Callable:
    """Full-sequence logits `[B, T, V]` and routings of unpadded tokens `[B, T]` (no sampling)."""

    def forward(params, tokens, cache, layout):
        programs.count(f"full_forward_T{tokens.shape[1]}")
        logits, cache, routings = graph.merge(params)(tokens, cache, layout, kernel=kernel)
        return logits, routings, cache

    return programs.memo(("forward", graph, kernel), lambda: programs.jit(forward, donate_argnums=2))


def forward_inputs(config: Any, tokens: Any, dtype: Any) -> tuple[list, Layout]:
    """The KV cache and layout `forward` runs a batch with, in either engine. The cache has one position
    more than the tokens, as every `generate` step's has: a cache the new keys fill exactly lets XLA fold
    the cache update away, differently in the whole-model program and in the per-layer programs, and
    float32 logits then differ in the last bit between the resident and the offload engine."""
    b, t = tokens.shape
    layout = Layout(np.int32(0), np.zeros((b,), np.int32), np.ones((b,), bool), t)
    return init_kv_cache(config, b, t + 1, dtype), layout


# -- the offload engine's per-layer steps ------------------------------------------------------------------
class LayerSteps(NamedTuple):
    attention_and_router: Callable
    dense_layer: Callable
    experts_finish: Callable  # the layer's last chunk of experts, the shared expert, the residual
    combine: Callable  # several devices: their assignment outputs summed, then as `experts_finish`
    experts_partial: Callable  # an earlier chunk (or one device's share)


def layer_steps(programs: Programs, graph: Graph, kernel: Kernel) -> LayerSteps:
    def attention_and_router(state, x, kv, layout, rope):
        programs.count(f"attention_and_router_T{x.shape[1]}")
        layer = graph.merge(state)
        h, z, kv = layer.attention_block(x, rope, kv, layout)
        z = z.reshape(-1, z.shape[-1])
        return h, z, layer.route(z), kv

    def dense_layer(state, x, kv, layout, rope):
        programs.count(f"dense_layer_T{x.shape[1]}")
        layer = graph.merge(state)
        h, z, kv = layer.attention_block(x, rope, kv, layout)
        return h + layer.dense_output(z).astype(h.dtype), kv

    def experts_finish(state, h, z, routing, experts, slots, valid, acc):
        programs.count(f"experts_finish_T{h.shape[1]}_n{len(experts)}")
        layer = graph.merge(state)
        parts = acc + expert_parts(z, routing, experts, slots, valid, kernel=kernel) if experts else acc
        return h + layer.mix(z, parts).reshape(h.shape).astype(h.dtype)

    def combine(state, h, z, partials):
        """partials `[n, N, k, D]`: each assignment nonzero on one device only, so their sum is exact."""
        programs.count(f"combine_T{h.shape[1]}")
        layer = graph.merge(state)
        return h + layer.mix(z, jnp.sum(partials, axis=0)).reshape(h.shape).astype(h.dtype)

    def experts_partial(z, routing, experts, slots, valid, acc):
        """Adds one chunk's assignment outputs to `acc` `[N, k, D]` float32 (other chunks' places are zero
        here)."""
        programs.count(f"experts_partial_N{z.shape[0]}_n{len(experts)}")
        return acc + expert_parts(z, routing, experts, slots, valid, kernel=kernel)

    def make() -> LayerSteps:
        return LayerSteps(
            programs.jit(attention_and_router, donate_argnums=2),
            programs.jit(dense_layer, donate_argnums=2),
            programs.jit(experts_finish),
            programs.jit(combine),
            programs.jit(experts_partial),
        )

    return programs.memo(("layer", graph, kernel), make)


def embed_step(programs: Programs, graph: Graph, cfg: Any) -> Callable:
    def embed(state, tokens, layout):
        programs.count(f"embed_T{tokens.shape[1]}")
        x = graph.merge(state)(tokens)
        return x, MoECausalLM.rope_for(cfg, layout, x.dtype)

    return programs.memo(("embed", graph), lambda: programs.jit(embed))


def head_step(programs: Programs, graph: Graph) -> Callable:
    def head(state, x, key, sampling, all_positions=False):
        programs.count(f"head_all{all_positions}")
        norm, projection = graph.merge(state)
        if all_positions:
            return output_logits(norm, projection, x)
        logits = output_logits(norm, projection, x[:, -1])
        return sampling(logits, key), logits

    return programs.memo(
        ("head", graph), lambda: programs.jit(head, static_argnums=3, static_argnames="all_positions")
    )


def no_parts(z: jax.Array, routing: Routing) -> jax.Array:
    """The empty assignment-output buffer `[N, k, D]` float32 a layer's chunks fill."""
    return jnp.zeros((*routing.ids.shape, z.shape[-1]), jnp.float32)
