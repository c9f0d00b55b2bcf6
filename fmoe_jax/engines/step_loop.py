"""One step of the offload engine (a prefill or one decode step): the iteration driver's `LayerLoop`.

The step launches the step program (`engines/segment.py`) from the embedding, with every routed expert the
device holds. The program runs the layers until a MoE layer routes a token to an expert the device lacks,
and stops there. `route(l)` reads a launch's results once (the host's one wait per launch: every layer's
routing it reached, and the sampled token if it ran to the end) and hands the driver layer l's routing;
`compute(l, ...)` does nothing for a layer the launch has run, and for the layer it stopped at runs the
chunks before the last (`experts_partial`, when the layer needs more experts than the cache holds, or with
several devices) and launches the program again from there, after the driver has loaded the layer's misses.
So a step costs one launch and one host read per layer that misses, plus one, and a step whose routed
experts are all resident costs one of each at any budget.

The driver still hears every layer's routing in order and serves it (hits counted, misses loaded, the
policy's prefetches issued) as if the layers ran one at a time: what the policy and the cache see does not
depend on how far a launch got. Copies go out before the launch that needs them: a layer's prefetch
requests and on-demand loads are issued between reading its routing and launching its experts.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import numpy as np

from fmoe_jax.models import Layout
from fmoe_jax.models.moe import ExpertWeights, ForcedRouting
from fmoe_jax.offload.cache import Key
from fmoe_jax.offload.driver import Routed

from . import StepOutput
from .programs import Recorded
from .segment import Entry, Segment


class ExpertArguments:
    """The step program's parameters: the module's leaves, each routed expert's from the cache where a launch
    may use it and a placeholder elsewhere, and the slot table `[L, J]` (-1: placeholder) saying which. Kept
    from launch to launch and changed where the cache changed, so a launch costs little host time.

    Args:
      params: the module's leaves (routed experts' are replaced).
      positions: (leaf position in `params`, key, fields) of every routed expert's array (`_expert_leaves`).
      placeholder: one expert's arrays on the device, passed for every absent expert.
      shape: (L, J), MoE layers and experts per layer.
    """

    def __init__(
        self,
        params: list[Any],
        positions: list[tuple[int, Key, tuple[str, ...]]],
        placeholder: Any,
        shape: tuple[int, int],
    ):
        paths = jax.tree_util.tree_flatten_with_path(placeholder)[0]
        order = {tuple(k.name for k in path): i for i, (path, _) in enumerate(paths)}  # fields -> leaf number
        self.leaves: dict[Key, list[int]] = {}  # each expert's parameter positions, in its leaves' order
        for index, key, _ in sorted(positions, key=lambda p: (p[1], order[p[2]])):
            self.leaves.setdefault(key, []).append(index)
        self.placeholder = jax.tree.leaves(placeholder)
        self.params = list(params)
        for indices in self.leaves.values():
            self._set(indices, self.placeholder)
        self.table = np.full(shape, -1, np.int32)
        self.placed: dict[Key, ExpertWeights] = {}

    def build(
        self, usable: dict[Key, ExpertWeights], entry: int, chunk: list[Key]
    ) -> tuple[list[Any], np.ndarray]:
        """Parameters and slot table of a launch that may use the experts `usable`, starting with MoE layer
        `entry` (-1: the embedding), whose row holds only `chunk` (its other experts ran before, elsewhere).
        The parameter list is this object's own: valid until the next `build`."""
        placed = self.placed
        for key in [key for key in placed if key not in usable]:
            self._set(self.leaves[key], self.placeholder)
            self.table[key] = -1
            del placed[key]
        for key, arrays in usable.items():
            if placed.get(key) is not arrays:
                self._set(self.leaves[key], jax.tree.leaves(arrays))
                self.table[key] = key[1]
                placed[key] = arrays
        table = self.table
        if entry >= 0:
            table = table.copy()
            table[entry] = -1
            table[entry, [e for _, e in chunk]] = [e for _, e in chunk]
        return self.params, table

    def _set(self, indices: list[int], leaves: list[Any]) -> None:
        for index, leaf in zip(indices, leaves, strict=True):
            self.params[index] = leaf


class Seen(NamedTuple):
    """A launch's results on the host (`StepLoop.read`)."""

    stop: int  # the MoE layer it stopped at; L: it ran to the end
    ids: np.ndarray  # [N, L, k] int32
    probs: np.ndarray | None  # [N, L, J] float32, when the policy or the trace wants them
    hidden: np.ndarray | None  # [N, L, D] float32, likewise
    embeds: np.ndarray | None  # [N, D] float32, the first launch's, likewise
    tokens: np.ndarray  # [B] int32, the sampled tokens (when `stop` is L)


class StepLoop:
    """One step's layers for the iteration driver (`LayerLoop`; see the module docstring). Made per step by
    the engine (`OffloadEngine.step` / `forward`), which `run`s it once.

    Args:
      engine: the `OffloadEngine` (its programs, cache, devices, policy and host backend).
      tokens: `[B, T]` the step's tokens; kv: the KV cache (donated to the launches); layout: the step's.
      key, sampling: the sampler's; None with `all_positions`.
      record: record the step's routing (`Recorded`); record_hidden: with the router inputs.
      all_positions: logits of every position `[B, T, V]`, no sampling (`forward`).
      forced: routing every MoE layer takes instead of its router's (`ForcedRouting`, on the host), or None;
        forced_embeds: `[N, D]` the semantic context the policy hears instead of the step's embedding.
    """

    wants_arrays = True  # its launches read the ensured experts' weights

    def __init__(
        self,
        engine: Any,
        tokens: Any,
        kv: list[Any],
        layout: Layout,
        key: Any,
        sampling: Any,
        *,
        record: bool,
        record_hidden: bool,
        all_positions: bool = False,
        forced: ForcedRouting | None = None,
        forced_embeds: np.ndarray | None = None,
    ):
        policy, devices = engine.policy, engine.devices
        self.engine = engine
        self.shape = np.shape(tokens)  # (B, T)
        self.valid_bt = token_valid(layout)  # [B, T] host bool
        # Expert arguments of a chunk are padded to one width when a step has several tokens (`chunk_width`).
        # A continuous batch (a write index per row) counts its rows as such: its decode steps then compile
        # one program whatever the rows' experts, so serving compiles nothing after its warm-up.
        self.width_tokens = int(np.prod(self.shape)) if np.ndim(layout.write_index) else self.shape[1]
        # The token ids fed, for a policy that reads them (`Policy.needs_tokens`): a host copy, `[N]`.
        self.fed = np.asarray(tokens, np.int64).reshape(-1) if policy.needs_tokens else None
        if not devices.single:
            tokens, layout, forced = devices.replicate((tokens, layout, forced))
        self.forced, self.forced_embeds = forced, forced_embeds
        self.tokens, self.kv, self.layout, self.key, self.sampling = tokens, kv, layout, key, sampling
        self.record, self.all_positions = record, all_positions
        self.want_probs = policy.needs_probs or record
        self.want_hidden = policy.needs_hidden or record_hidden
        self.want_embeds = policy.needs_semantic or record
        self.record_hidden = record_hidden
        self.segment: Segment | None = None  # the last launch's results, on the device
        self.seen: Seen | None = None  # their host copies, once read
        self.first: Seen | None = None  # the first launch's (the embedding)
        self.acc: list[jax.Array | None] = [None] * len(devices)  # the stop layer's outputs from elsewhere
        self.pending: Any = None  # the host's share of the stop layer, in flight
        self.routed: list[Routed] = []  # each MoE layer's routing, when recording
        self.launches = 0  # device programs launched
        self.stops = 0  # layers the program stopped at for a miss (an optimistic engine's), then relaunched
        self.syncs = 0  # host waits for device results
        self.waited_s = 0.0  # seconds of those waits, and of the host's share
        self._valid: jax.Array | None = None

    # -- the step ---------------------------------------------------------------------------------------
    def run(self) -> tuple[StepOutput, list[Any]]:
        """Runs the step; returns its output and the new KV cache."""
        engine = self.engine
        self.launch(engine.first_entry(*self.shape), -1, {})
        self.read()
        self.first = self.seen
        embeds = self.first.embeds if self.forced_embeds is None else self.forced_embeds
        engine.driver.iteration(self.valid_bt, embeds, self, self.fed)
        last = self.segment
        if self.seen is not None:  # the launch that ran to the end was read: its tokens came with it
            tokens = self.seen.tokens
        else:
            self.syncs += 1  # the caller reads them
            tokens = last.tokens if engine.devices.single else engine.devices.host(last.tokens)
        logits = last.logits if engine.devices.single else jax.numpy.asarray(engine.devices.host(last.logits))
        return StepOutput(tokens, logits, self.recorded()), self.kv

    def recorded(self) -> Recorded | None:
        if not self.record:
            return None
        b, t = self.shape
        n = len(self.routed)
        return Recorded(
            self.first.embeds.reshape(b, t, -1),
            np.stack([r.probs for r in self.routed], 1).reshape(b, t, n, -1),
            np.stack([r.ids for r in self.routed], 1).reshape(b, t, n, -1),
            np.stack([r.hidden for r in self.routed], 1).reshape(b, t, n, -1) if self.record_hidden else None,
        )

    def launch(self, entry: Entry, layer: int, chunk: dict[Key, ExpertWeights]) -> None:
        """Runs the step program from `entry` (MoE layer `layer` with its experts `chunk`; -1: the embedding)
        with every expert the device holds (none unless the engine runs optimistically)."""
        engine = self.engine
        usable = {**engine.resident(), **chunk}
        params, table = engine.arguments.build(usable, layer, list(chunk))
        if not engine.devices.single:
            table = engine.devices.replicate(table)
        self.segment, self.kv = engine.step_program(
            params,
            table,
            self.tokens,
            self.kv,
            self.layout,
            self.key,
            entry,
            self.sampling,
            self.want_hidden,
            self.all_positions,
            self.forced,
        )
        self.seen, self.acc, self.pending = None, [None] * len(engine.devices), None
        self.launches += 1

    def read(self) -> None:
        """The last launch's results on the host: one wait, then one or two copies (`Segment`)."""
        engine, segment = self.engine, self.segment
        start = time.perf_counter()
        jax.block_until_ready(segment.ints)
        ready = time.perf_counter()
        first = self.first is None
        floats_wanted = self.want_probs or self.want_hidden or (first and self.want_embeds)
        ints, floats = engine.devices.hosts(segment.ints, segment.floats if floats_wanted else None)
        cfg = engine.config
        b, n = self.shape[0], int(np.prod(self.shape))
        layers, k, j, d = cfg.num_moe_layers, cfg.top_k, cfg.num_experts, cfg.hidden_size
        probs = hidden = embeds = None
        if floats is not None:
            probs = floats[: n * layers * j].reshape(n, layers, j)
            if self.want_hidden:
                hidden = floats[n * layers * j : n * layers * (j + d)].reshape(n, layers, d)
            if first and self.want_embeds:
                embeds = floats[floats.size - n * d :].reshape(n, d)
        self.seen = Seen(
            int(ints[0]), ints[1 + b :].reshape(n, layers, k), probs, hidden, embeds, ints[1 : 1 + b]
        )
        engine.driver.timers["context_collection"] += time.perf_counter() - ready
        self.waited_s += ready - start
        self.syncs += 1

    # -- the driver's calls (`LayerLoop`) ------------------------------------------------------------------
    def route(self, layer: int) -> Routed:
        if self.seen is None:
            self.read()
        seen = self.seen
        assert layer <= seen.stop, (layer, seen.stop)  # the driver asks in order; a launch stops at a miss
        routed = Routed(
            seen.ids[:, layer],
            None if seen.probs is None else seen.probs[:, layer],
            None if seen.hidden is None else seen.hidden[:, layer],
        )
        if self.record:
            self.routed.append(routed)
        return routed

    def compute(self, layer: int, chunk: list[Key], arrays: dict[Key, ExpertWeights], is_last: bool) -> None:
        if layer < self.seen.stop:  # the launch that routed it has run it
            return
        engine = self.engine
        devices = engine.devices
        if is_last and devices.single:  # the last chunk goes with the next launch
            if engine.optimistic:  # it stopped for a miss: the cache hears the stop and its price
                self.stops += 1
                engine.cache.record_stop(engine.stop_price.current)
            self.join_host()
            self.launch(self.entry(), layer, {key: arrays[key] for key in chunk})
            return
        d = engine.cache.device_of(chunk[0]) if chunk else 0
        if chunk:
            exit_ = self.segment.exit
            z, routing, valid = devices.on((exit_.z, exit_.routing, self.valid()), d)
            experts, slots = engine.chunk_arguments(chunk, arrays, self.width_tokens, d)
            acc = self.acc[d] if self.acc[d] is not None else engine.empty_parts(self.shape, d)
            self.acc[d] = engine.experts_partial(z, routing, experts, slots, valid, acc)
            self.launches += 1
        if not is_last:  # the next chunk may evict these experts: let this one finish
            start = time.perf_counter()
            self.acc[d].block_until_ready()
            self.waited_s += time.perf_counter() - start
            self.syncs += 1
            return
        self.join_host()
        self.launch(self.entry(), layer, {})  # several devices: their outputs meet in the next launch

    def host(self, layer: int, keys: list[Key]) -> None:
        if layer < self.seen.stop:  # the launch that routed it has run it on the device
            return
        engine, devices = self.engine, self.engine.devices
        start = time.perf_counter()
        ids = self.seen.ids[:, layer][self.valid_bt.reshape(-1)]  # [valid tokens, k]
        tokens = [int(np.sum(ids == e)) for _, e in keys]
        first = devices.local.index(True)
        exit_ = self.segment.exit
        z, routing, valid = devices.on((exit_.z, exit_.routing, self.valid()), first)
        self.pending = engine.host.start(keys, tokens, self.shape[1], z, routing, valid)
        engine.driver.timers["host_dispatch"] += time.perf_counter() - start

    # -- helpers ----------------------------------------------------------------------------------------
    def join_host(self) -> None:
        """Adds the host's share of the stop layer, if any, to the first device's outputs."""
        if self.pending is None:
            return
        engine, devices = self.engine, self.engine.devices
        start = time.perf_counter()
        first = devices.local.index(True)
        parts = engine.host.finish(self.pending, devices.devices[first], engine.add_parts)
        waited = time.perf_counter() - start
        engine.driver.timers["host_wait"] += waited
        self.waited_s += waited
        if self.acc[first] is None:
            self.acc[first] = parts
        else:
            self.acc[first] = engine.add_parts(self.acc[first], parts)
            self.launches += 1
        self.pending = None

    def entry(self) -> Entry:
        """The next launch's entry: the stop layer's state, with what its experts computed outside."""
        engine, devices = self.engine, self.engine.devices
        if devices.single:
            acc = self.acc[0] if self.acc[0] is not None else engine.empty_parts(self.shape, 0)
        else:
            acc = devices.gather(
                [
                    a if a is not None else engine.empty_parts(self.shape, i)
                    for i, a in enumerate(self.acc)
                    if devices.local[i]
                ]
            )
        return self.segment.exit._replace(acc=acc)

    def valid(self) -> jax.Array:
        """`[N]` bool on the device(s): the step's real tokens."""
        if self._valid is None:
            self._valid = self.engine.devices.replicate(self.valid_bt.reshape(-1))
        return self._valid


def token_valid(layout: Layout) -> np.ndarray:
    """`[B, T]` bool: the step's real tokens (not padding, not finished rows), on the host."""
    index = np.asarray(layout.write_index).reshape(-1, 1) + np.arange(layout.num_new)  # [1 or B, T]
    return (index >= np.asarray(layout.key_start)[:, None]) & np.asarray(layout.row_active)[:, None]
