"""The resident engine: every weight on the device, one jitted program per prefill and per decode step.

`fmoe_jax.generate` drives an engine through `step` (prefill when T > 1, decode when T = 1); the offload
engine (`fmoe_jax/engine.py`) implements the same interface layer by layer. Jitted functions are module
level with the model's graph as a static argument, so every engine of the same architecture shares their
compilations; `TRACE_COUNTS` counts traces (compilations) by name, which tests and benchmarks read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fmoe_jax.models import LayerKV, Layout, MoECausalLM, init_kv_cache
from fmoe_jax.models.moe import Kernel

from .sampling import Sampling

TRACE_COUNTS: collections.Counter[str] = collections.Counter()


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


class StepOutput:
    """What one engine call returns to the generation loop."""

    __slots__ = ("tokens", "logits", "embeds", "probs", "ids", "hidden")

    def __init__(self, tokens, logits, embeds=None, probs=None, ids=None, hidden=None):
        self.tokens = tokens  # [B] int32, sampled next tokens
        self.logits = logits  # [B, V] float32, logits of the last position
        self.embeds = embeds  # [B, T, D] embedding output of the new tokens (semantic context), if recorded
        self.probs = probs  # [B, T, L_moe, J] router probabilities, if recorded
        self.ids = ids  # [B, T, L_moe, k] chosen experts, if recorded
        self.hidden = hidden  # [B, T, L_moe, D] router inputs, if recorded with hidden states


class ResidentEngine:
    """Runs the whole model in one jitted function per call; counts traces so tests can catch recompiles."""

    def __init__(self, module: MoECausalLM, *, kernel: Kernel = "auto"):
        self.module = module
        self.config = module.config
        self.graph, self.params = split(module)
        self.kernel = kernel
        self._step = resident_step(self.graph, kernel)

    def init_cache(self, batch: int, length: int) -> list[LayerKV]:
        return init_kv_cache(self.config, batch, length, self.module.dtype)

    def step(
        self,
        tokens: jax.Array,
        cache: list[LayerKV],
        layout: Layout,
        key: jax.Array,
        sampling: Sampling,
        record: bool = False,
        record_hidden: bool = False,
    ) -> tuple[StepOutput, list[LayerKV]]:
        """Runs prefill (T > 1) or one decode step (T = 1) and samples the next token of each row."""
        next_tokens, logits, cache, extra = self._step(
            self.params, tokens, cache, layout, key, sampling, record, record and record_hidden
        )
        out = StepOutput(next_tokens, logits)
        if extra is not None:
            out.embeds, out.probs, out.ids, out.hidden = extra
        return out, cache

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list]:
        """Full-sequence logits `[B, T, V]` and routings of unpadded tokens `[B, T]`, no sampling or cache."""
        return _full_forward(self.graph, self.params, tokens, self.kernel)


@functools.cache
def resident_step(graph: Graph, kernel: Kernel):
    """The jitted whole-model step for one model graph (closing over the graph avoids hashing it per call)."""

    def step(params, tokens, cache, layout, key, sampling: Sampling, record: bool, record_hidden: bool):
        TRACE_COUNTS[f"resident_step_T{tokens.shape[1]}_S{cache[0].k.shape[1]}_B{tokens.shape[0]}"] += 1
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
        embeds = model.embed_tokens(tokens)
        if hidden is not None:
            hidden = jnp.stack(hidden, axis=1).reshape(b, t, len(routings), -1)
        return next_tokens, logits, cache, (embeds, probs, ids, hidden)

    return jax.jit(step, static_argnums=(5, 6, 7), donate_argnums=2)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _full_forward(graph, params, tokens, kernel):
    TRACE_COUNTS[f"full_forward_T{tokens.shape[1]}"] += 1
    model = graph.merge(params)
    b, t = tokens.shape
    cache = init_kv_cache(model.config, b, t, model.dtype)
    layout = Layout(jnp.int32(0), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), t)
    logits, _, routings = model(tokens, cache, layout, kernel=kernel)
    return logits, routings
