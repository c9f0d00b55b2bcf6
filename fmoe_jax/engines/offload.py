"""The offload engine: serves a model whose routed experts live in host memory, one layer at a time.

A step: embed (jitted; the semantic context goes to the host when the policy needs it), then the iteration
driver (`offload/driver.py`) runs the MoE layers, calling back here: `route` runs the dense layers before a
MoE layer and its attention and router (jitted) and reads the routing on the host (the one sync point of
the layer); `compute` runs the layer's experts (jitted) with the cached experts' arrays as arguments, in
chunks when the layer needs more experts than the cache holds; then the LM head. With several devices each
computes the experts it holds and the layer's outputs meet on the mesh (`engines/devices.py`).

Full-cache fast path: whenever every routed expert is resident (preloaded, or brought by earlier
requests), a step is the whole-model program with the cached arrays for the experts, and the driver replays
the step's routing to the policy and the cache afterwards: the same events and statistics, no per-layer sync.

Hybrid execution (`OffloadConfig(execution="hybrid")`): the driver's planner hands some misses to the host;
`host` dispatches them to the CPU backend (`engines/host.py`) before the device's chunks are dispatched, and
the layer's last `compute` adds the host's assignment outputs to the device's before finishing the layer.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmoe_jax.models import LayerKV, Layout, MoECausalLM, init_kv_cache, model_identity
from fmoe_jax.models.moe import ExpertWeights, Kernel, Routing
from fmoe_jax.offload.cache import DeviceExpertCache, Key
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.driver import Driver, Routed
from fmoe_jax.offload.hybrid import DeviceCost, HostCost, HybridPlanner, MeasuredHostCost
from fmoe_jax.offload.placement import CacheGroup, placement_from
from fmoe_jax.offload.policies import PolicyContext
from fmoe_jax.offload.transfer import TimedMover, jax_mover

from ..sampling import Sampling
from . import StepOutput
from .devices import DeviceSet, per_device_slots, resolve_devices
from .host import HostCompute
from .programs import (
    Graph,
    Programs,
    Recorded,
    add_parts,
    chunk_width,
    embed_step,
    forward_inputs,
    head_step,
    layer_steps,
    no_parts,
    split,
    whole_step,
)


def router_weights(module: MoECausalLM) -> tuple[np.ndarray, ...]:
    """Each MoE layer's router kernel `[D, J]` as float32 host arrays (speculative and learned policies)."""
    cfg = module.config
    return tuple(np.asarray(module.layers[i].router.weight[...], np.float32).T for i in cfg.moe_layer_ids)


class OffloadEngine:
    """Serves a model whose routed experts live in host memory (see the module docstring).

    Args:
      module: the model, its routed experts in pinned host memory (`load_model(..., offload=...)` puts them
        there).
      offload: the policy, budget and transfer settings.
      kernel: expert-mixture kernel.
      programs: compiled programs to share with another engine of the same weights (default: its own).
      host_cost: hybrid execution: the host's cost the planner weighs (default: measured online,
        `MeasuredHostCost`); tests pass a `FixedHostCost` to send every miss to the host.
      device_cost: hybrid execution: the device's cost per expert (a `cost_model.CostModel` of presets), with
        which the planner also gives resident experts to the host where that ends a layer sooner; default
        None: resident experts stay on the device (the device's cost is not measured online yet).
    """

    def __init__(
        self,
        module: MoECausalLM,
        offload: OffloadConfig,
        *,
        kernel: Kernel = "auto",
        programs: Programs | None = None,
        host_cost: HostCost | None = None,
        device_cost: DeviceCost | None = None,
    ):
        cfg = module.config
        self.module, self.config, self.offload, self.kernel = module, cfg, offload, kernel
        self.programs = programs if programs is not None else Programs()
        self.devices = DeviceSet(resolve_devices(offload.devices))
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layer_ids)}
        graph, embed_params = split(module.embed)
        self._embed = embed_step(self.programs, graph, cfg)
        graph, head_params = split((module.final_norm, module.output_projection))
        self._head = head_step(self.programs, graph)
        layer_params, self.layer_fns = [], []
        for layer in module.layers:
            graph, params = split(layer)
            layer_params.append(params)
            self.layer_fns.append(layer_steps(self.programs, graph, kernel))
        self.embed_params, self.head_params, self.layer_params = self.devices.replicate(
            (embed_params, head_params, layer_params)
        )

        # As stored: a quantized expert's values and scales (what a copy moves and a cache slot holds).
        leaves = jax.tree.leaves(_host_expert(module, (0, 0)))
        self.expert_bytes = sum(a.nbytes for a in leaves)
        self.all_keys = [(m, e) for m in range(cfg.num_moe_layers) for e in range(cfg.num_experts)]
        self.policy = offload.make_policy()
        total = len(self.all_keys)
        slots = total if self.policy.preload_all else offload.slots(self.expert_bytes, total)
        self.cache = self._make_cache(slots)
        self.policy.bind(
            PolicyContext(
                num_layers=cfg.num_moe_layers,
                num_experts=cfg.num_experts,
                top_k=cfg.top_k,
                embed_dim=cfg.hidden_size,
                prefetch_distance=offload.prefetch_distance,
                capacity=slots,
                model_id=model_identity(cfg),
                router_weights=router_weights(module) if self.policy.needs_hidden else (),
                copy_chunks=len(leaves) if offload.transfer == "chunked" else 1,  # one per array
                execution=offload.execution,
            ),
            self.cache,
        )
        self.host: HostCompute | None = None
        planner = None
        if offload.execution == "hybrid":
            cost = host_cost if host_cost is not None else MeasuredHostCost()
            self.host = HostCompute(module, self.programs, kernel, offload.host_threads, cost)
            planner = HybridPlanner(cost, device_cost)
            for mover, key in zip(self._movers, self.all_keys, strict=False):
                mover.calibrate(key)
        self._add_parts = add_parts(self.programs)
        self.driver = Driver(self.policy, self.cache, planner)
        # A policy may hold a thread (fMoE's matcher) that would outlive a model nobody closes: close it
        # when the engine is collected, or on `close()`, whichever comes first (once).
        self._close_policy = weakref.finalize(self, _close_quietly, self.policy)
        if self.policy.preload_all or offload.preload:
            self.cache.preload(self.all_keys)
        elif self.policy.initial_experts():
            self.cache.preload(self.policy.initial_experts())
        self._whole: tuple[Any, list[Any], list[tuple[int, Key, str]]] | None = None
        self._no_parts: dict[tuple, jax.Array] = {}

    def _make_cache(self, slots: int) -> DeviceExpertCache | CacheGroup:
        self._movers: list[TimedMover] = []

        def one(index: int, capacity: int) -> DeviceExpertCache:
            host, target = functools.partial(_host_expert, self.module), self.devices.cache_target(index)
            mover = TimedMover(jax_mover(self.offload.transfer, host, target))
            self._movers.append(mover)
            return DeviceExpertCache(
                mover,
                capacity,
                self.expert_bytes,
                self.policy,
                max_inflight=self.offload.max_inflight,
                synchronous=self.offload.transfer == "synchronous",
            )

        if self.devices.single:
            self.device_slots = [slots]
            return one(0, slots)
        cfg, n = self.config, len(self.devices)
        placement = placement_from(self.offload.placement, cfg.num_experts, n)
        self.device_slots = per_device_slots(slots, cfg, placement, n, self.policy.preload_all)
        caches = [one(i, c) if self.devices.local[i] else None for i, c in enumerate(self.device_slots)]
        return CacheGroup(caches, placement)

    # -- the generation loop's interface (`fmoe_jax.engines.Engine`) -----------------------------------
    def init_cache(self, batch: int, length: int) -> list[LayerKV]:
        return self.devices.replicate(init_kv_cache(self.config, batch, length, self.module.dtype))

    def begin(self, batch: int) -> None:
        """Starts a `generate` call: statistics count from here."""
        self.devices.barrier("fmoe-generate")
        self.driver.reset()
        self._began = (time.perf_counter(), [m.busy_s for m in self._movers])
        self._host_began = (self.host.busy_s, self.host.calls) if self.host is not None else (0.0, 0)
        self.driver.begin(batch)

    def finish(self, stats: Any) -> None:
        """Fills the cache and policy statistics of the call into `stats` (a `GenerationStats`)."""
        measured = self.driver.measure()
        s = measured.cache
        stats.hits, stats.misses, stats.late_prefetches = s.hits, s.misses, s.late_prefetches
        stats.prefetches, stats.wasted_prefetches = s.prefetches, s.wasted_prefetches
        stats.bytes_to_device, stats.peak_cache_bytes, stats.hit_rate = (
            s.bytes_to_device,
            s.peak_bytes,
            s.hit_rate,
        )
        stats.layer_hit_rate = s.layer_hit_rate(self.config.num_moe_layers)
        stats.overhead_s = measured.overhead_s
        stats.host_computed = s.host_computed
        began, busy = self._began
        wall = time.perf_counter() - began
        shares = [(m.busy_s - b) / wall for m, b in zip(self._movers, busy, strict=True)] if wall > 0 else []
        stats.link_busy_share = float(np.mean(shares)) if shares else 0.0
        if self.host is not None:
            stats.host_compute_s = self.host.busy_s - self._host_began[0]
            stats.extra["host_calls"] = self.host.calls - self._host_began[1]
            stats.extra["host_copies_alias_pinned"] = self.host.aliased
        stats.extra.update(self.policy.stats())
        stats.extra["cache_slots"] = self.cache.capacity
        stats.extra["expert_bytes"] = self.expert_bytes
        if isinstance(self.cache, CacheGroup):
            stats.extra["devices"] = [str(d) for d in self.devices.devices]
            stats.extra["per_device"] = self.cache.device_stats()

    def paused_learning(self) -> contextlib.AbstractContextManager[None]:
        """The policy's learning pause (`Policy.paused_learning`)."""
        return self.policy.paused_learning()

    def close(self) -> None:
        """Closes the policy (stops its threads, saves its state; its errors propagate) and the transfer
        threads."""
        self._close_policy.detach()
        try:
            self.policy.close()
        finally:
            for mover in self._movers:
                mover.close()

    def step(
        self,
        tokens: Any,
        kv: list[LayerKV],
        layout: Layout,
        key: Any,
        sampling: Sampling,
        record: bool = False,
        record_hidden: bool = False,
        requests: Any = None,
    ) -> tuple[StepOutput, list[LayerKV]]:
        """Prefill (T > 1) or one decode step (T = 1); samples each row's next token. `requests`: each row's
        request id (`IterationStart.requests`), for continuous batching."""
        self.driver.requests = None if requests is None else tuple(int(r) for r in requests)
        if self.devices.single:
            done = self._step_whole(tokens, kv, layout, key, sampling, record, record and record_hidden)
            if done is not None:
                return done
        else:
            if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
                key = jax.random.key_data(key)
            key = self.devices.replicate(key)  # raw key data; the sampler wraps it
        x, kv, recorded = self._layers(tokens, kv, layout, record, record and record_hidden)
        next_tokens, logits = self._head(self.head_params, x, key, sampling)
        if not self.devices.single:  # the generation loop reads them on this process's host
            next_tokens, logits = (jnp.asarray(self.devices.host(a)) for a in (next_tokens, logits))
        return StepOutput(next_tokens, logits, recorded), kv

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list[Routing]]:
        """Full-sequence logits `[B, T, V]` and each MoE layer's routing (probabilities only)."""
        b, t = tokens.shape
        kv, layout = forward_inputs(self.config, tokens, self.module.dtype)
        kv = self.devices.replicate(kv)
        x, _, recorded = self._layers(tokens, kv, layout, True, False)
        logits = jnp.asarray(
            self.devices.host(self._head(self.head_params, x, None, None, all_positions=True))
        )
        probs = recorded.probs.reshape(b * t, recorded.probs.shape[2], -1)
        ids = recorded.ids.reshape(b * t, recorded.ids.shape[2], -1)
        routings = [
            Routing(jnp.asarray(probs[:, i]), jnp.asarray(ids[:, i]), jnp.zeros(ids[:, i].shape))
            for i in range(probs.shape[1])
        ]
        return logits, routings

    # -- the per-layer loop ---------------------------------------------------------------------------
    def _layers(self, tokens, kv, layout, record: bool, record_hidden: bool):
        """Embedding and every layer, the MoE layers through the driver; returns x `[B, T, D]`, the KV cache
        and, with `record`, the routing of the step (host arrays)."""
        policy, devices, timers = self.policy, self.devices, self.driver.timers
        b, t = np.shape(tokens)
        valid_bt = _token_valid(layout)  # [B, T] host bool
        # Expert arguments are padded to one width when a step has several tokens (see `chunk_width`). A
        # continuous batch (a write index per row) counts its rows as such: its decode steps then compile
        # one program whatever the rows' experts, so serving compiles nothing after its warm-up.
        width_tokens = b * t if np.ndim(layout.write_index) else t
        valid = devices.replicate(valid_bt.reshape(b * t))
        tokens, layout = devices.replicate((tokens, layout))
        x, rope = self._embed(self.embed_params, tokens, layout)
        embeds = None
        if policy.needs_semantic or record:
            x.block_until_ready()  # the embedding's compute is not overhead; copying it out is
            start = time.perf_counter()
            embeds = devices.host(x).astype(np.float32).reshape(b * t, -1)
            timers["context_collection"] += time.perf_counter() - start
        kv = list(kv)
        want_probs = policy.needs_probs or record
        state = {"x": x, "next": 0}  # the residual stream and the next layer to run
        routed_layers: list[Routed] = []
        layer_of = self.config.moe_layer_ids

        def run_dense_until(layer_id: int) -> None:
            while state["next"] < layer_id:
                i = state["next"]
                state["x"], kv[i] = self.layer_fns[i].dense_layer(
                    self.layer_params[i], state["x"], kv[i], layout, rope
                )
                state["next"] += 1

        def route(m: int) -> Routed:
            layer_id = layer_of[m]
            run_dense_until(layer_id)
            fns, params = self.layer_fns[layer_id], self.layer_params[layer_id]
            h, z, routing, kv[layer_id], z_f32 = fns.attention_and_router(
                params, state["x"], kv[layer_id], layout, rope
            )
            routing.ids.block_until_ready()  # the layer's one sync point: attention and router done
            start = time.perf_counter()
            routed = Routed(
                *devices.hosts(
                    routing.ids,  # [N, k]
                    routing.probs if want_probs else None,
                    # [N, D] router input; the policy may stop wanting it (see `Policy.needs_hidden`)
                    z_f32 if record_hidden or policy.needs_hidden else None,
                )
            )
            timers["context_collection"] += time.perf_counter() - start
            state.update(h=h, z=z, routing=routing, acc=[None] * len(devices), next=layer_id + 1)
            state.update(ids=routed.ids, pending=None)
            if record:
                routed_layers.append(routed)
            return routed

        def compute(m: int, chunk: list[Key], arrays: dict[Key, ExpertWeights], is_last: bool) -> None:
            layer_id = layer_of[m]
            fns, params = self.layer_fns[layer_id], self.layer_params[layer_id]
            h, z, routing, acc, pending = (
                state["h"],
                state["z"],
                state["routing"],
                state["acc"],
                state["pending"],
            )
            d = self.cache.device_of(chunk[0]) if chunk else 0
            z_d, routing_d, valid_d = devices.on((z, routing, valid), d)
            if acc[d] is None:
                acc[d] = self._empty_parts(z, routing, d)
            experts, slots = self._chunk_arguments(chunk, arrays, width_tokens, d)
            if (
                is_last and devices.single and pending is None
            ):  # last chunk, shared expert, residual: one program
                state["x"] = fns.experts_finish(params, h, z, routing, experts, slots, valid, acc[0])
                return
            if experts:
                acc[d] = fns.experts_partial(z_d, routing_d, experts, slots, valid_d, acc[d])
            if not is_last:
                acc[d].block_until_ready()  # the next chunk may evict these experts: let this one finish
                return
            if pending is not None:  # the host's assignment outputs join the device's (disjoint places)
                start = time.perf_counter()
                first = devices.local.index(True)
                host_parts = self.host.finish(pending, devices.devices[first], self._add_parts)
                timers["host_wait"] += time.perf_counter() - start
                if acc[first] is None:
                    acc[first] = self._empty_parts(z, routing, first)
                acc[first] = self._add_parts(acc[first], host_parts)
            if devices.single:  # every expert already in `acc`: the shared expert and the residual
                state["x"] = fns.experts_finish(params, h, z, routing, (), slots, valid, acc[0])
                return
            partials = [
                a if a is not None else self._empty_parts(z, routing, i)
                for i, a in enumerate(acc)
                if devices.local[i]
            ]
            state["x"] = fns.combine(params, h, z, devices.gather(partials))

        valid_rows = valid_bt.reshape(-1)

        def host(m: int, keys: list[Key]) -> None:
            start = time.perf_counter()
            ids = state["ids"][valid_rows]  # [valid tokens, k]
            tokens = [int(np.sum(ids == e)) for _, e in keys]
            first = devices.local.index(True)
            z, routing, valid_0 = devices.on((state["z"], state["routing"], valid), first)
            state["pending"] = self.host.start(keys, tokens, t, z, routing, valid_0)
            timers["host_dispatch"] += time.perf_counter() - start

        self.driver.iteration(valid_bt, embeds, route, compute, host if self.host is not None else None)
        run_dense_until(len(self.layer_fns))
        recorded = None
        if record:
            n = len(routed_layers)
            recorded = Recorded(
                embeds.reshape(b, t, -1),
                np.stack([r.probs for r in routed_layers], 1).reshape(b, t, n, -1),
                np.stack([r.ids for r in routed_layers], 1).reshape(b, t, n, -1),
                np.stack([r.hidden for r in routed_layers], 1).reshape(b, t, n, -1)
                if record_hidden
                else None,
            )
        return state["x"], kv, recorded

    def _empty_parts(self, z: jax.Array, routing: Routing, device: int) -> jax.Array:
        """The zero buffer a layer's chunks add their assignment outputs to, on `device`: made once per shape
        and device and shared by every layer and step (the jitted steps return new buffers, never write to
        it). Made per layer, its eager zeros cost ~0.1 ms of dispatch each on CPU."""
        key = (tuple(routing.ids.shape), int(z.shape[-1]), device)
        if key not in self._no_parts:
            self._no_parts[key] = self.devices.put(no_parts(*self.devices.on((z, routing), device)), device)
        return self._no_parts[key]

    def _chunk_arguments(self, chunk: list[Key], arrays: dict, tokens: int, device: int):
        """A chunk's experts as the jitted step takes them: the weights (padded to a few widths, see
        `chunk_width`) and `slot_of_expert` `[J]` (-1: not in this chunk)."""
        num_experts = self.config.num_experts
        slots = np.full((num_experts,), -1, np.int32)
        if not chunk:
            return (), self.devices.put(jnp.asarray(slots), device)
        experts = [arrays[k] for k in chunk]
        slots[[e for _, e in chunk]] = np.arange(len(chunk), dtype=np.int32)
        capacity = self.device_slots[device]
        experts += [experts[0]] * (chunk_width(len(experts), capacity, num_experts, tokens) - len(experts))
        return tuple(experts), self.devices.put(jnp.asarray(slots), device)

    # -- the full-cache fast path ---------------------------------------------------------------------
    def _step_whole(self, tokens, kv, layout, key, sampling, record, record_hidden):
        """Every routed expert resident: the whole step as one program (the resident engine's) with the
        cached arrays for the experts; the driver then replays the step's routing (all hits, same events and
        order as the per-layer loop). None, and nothing done, when some expert is not resident."""
        arrays = self.cache.pin_if_resident(self.all_keys)
        if arrays is None:
            return None
        policy, timers = self.policy, self.driver.timers
        try:
            step, params, leaves = self._whole_program()
            params = list(params)
            for index, key_, fields in leaves:
                params[index] = functools.reduce(getattr, fields, arrays[key_])
            want_hidden = policy.needs_hidden or record_hidden
            next_tokens, logits, kv, out = step(params, tokens, kv, layout, key, sampling, True, want_hidden)
            out.ids.block_until_ready()  # the step's compute is not overhead; what follows is
            start = time.perf_counter()
            b, t = np.shape(tokens)
            ids = np.asarray(out.ids).reshape(b * t, -1, out.ids.shape[-1])  # [N, L, k]
            probs = (
                np.asarray(out.probs).reshape(b * t, ids.shape[1], -1)
                if (policy.needs_probs or record)
                else None
            )
            embeds = (
                np.asarray(out.embeds).astype(np.float32).reshape(b * t, -1)
                if (policy.needs_semantic or record)
                else None
            )
            hidden = (
                np.asarray(out.hidden).astype(np.float32).reshape(b * t, ids.shape[1], -1)
                if want_hidden
                else None
            )
            timers["context_collection"] += time.perf_counter() - start

            def route(m: int) -> Routed:
                return Routed(
                    ids[:, m],
                    None if probs is None else probs[:, m],
                    None if hidden is None else hidden[:, m],
                )

            self.driver.iteration(_token_valid(layout), embeds, route, lambda *_: None)
        finally:
            self.cache.release(self.all_keys)
        recorded = None
        if record:
            recorded = Recorded(
                embeds.reshape(b, t, -1),
                probs.reshape(b, t, ids.shape[1], -1),
                ids.reshape(b, t, ids.shape[1], -1),
                hidden.reshape(b, t, ids.shape[1], -1) if record_hidden else None,
            )
        return StepOutput(next_tokens, logits, recorded), kv

    def _whole_program(self):
        """The whole-model step, the module's parameters, and where the routed experts sit among them."""
        if self._whole is None:
            graph, params = split(self.module)
            self._whole = (
                whole_step(self.programs, graph, self.kernel),
                params,
                _expert_leaves(graph, self.moe_index),
            )
        return self._whole


def _token_valid(layout: Layout) -> np.ndarray:
    """`[B, T]` bool: the step's real tokens (not padding, not finished rows), on the host."""
    index = np.asarray(layout.write_index).reshape(-1, 1) + np.arange(layout.num_new)  # [1 or B, T]
    return (index >= np.asarray(layout.key_start)[:, None]) & np.asarray(layout.row_active)[:, None]


def _expert_leaves(graph: Graph, moe_index: dict[int, int]) -> list[tuple[int, Key, tuple[str, ...]]]:
    """(position in the flat parameter list, (MoE layer index, expert), fields) of every routed expert's
    array in the whole-model graph; the fast path puts the cached arrays there. Fields name the array in
    the cached `ExpertWeights`: `("gate",)`, or `("gate", "values")` for a quantized matrix."""
    abstract = jax.tree.unflatten(graph.treedef, list(range(graph.treedef.num_leaves)))
    out = []
    for path, index in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if keys[0] == "experts":
            fields = tuple(k.key for k in path[3:] if isinstance(k, jax.tree_util.DictKey))  # not ".value"
            out.append((index, (moe_index[keys[1]], keys[2]), fields))
    return out


def _host_expert(module: MoECausalLM, key: Key) -> ExpertWeights:
    """Host weights of (MoE layer index, expert). A function of the module, not a method of the engine, so
    that the cache (and a policy thread holding it) does not keep the engine and its executables alive."""
    return module.experts[module.config.moe_layer_ids[key[0]]][key[1]].weights()


def _close_quietly(policy: Any) -> None:
    """Closes a policy whose engine was collected without `close()`; an error has nowhere to go then."""
    try:
        policy.close()
    except Exception:  # noqa: BLE001, S110
        pass
