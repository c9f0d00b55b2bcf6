"""The offload engine: the per-layer loop where model steps, the expert cache and the policy meet.

One iteration (DESIGN.md "One decode iteration"): embed (the semantic context goes to the policy); per
layer, `attention_and_router` (jitted), one host read of the routing (the trajectory context goes to the
policy), `cache.ensure` for the needed experts, `experts` (jitted) with the cached experts' arrays passed
as arguments; if a layer needs more experts than the cache holds it runs in chunks; then the LM head.
`fmoe_jax.generate` drives it through `step` exactly like the resident engine.

Fast path: when the cache holds every routed expert and was filled at start (`OffloadConfig.preload`, or
the `resident` policy), a step is the resident engine's single program with the cached arrays for the
experts; the host then replays the per-layer events, so the policy, the cache statistics and the trace
see exactly what the per-layer loop would have shown them, in the same order, without a sync per layer.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import json
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fmoe_jax.models import LayerKV, Layout, MoECausalLM, init_kv_cache
from fmoe_jax.models.base import output_logits
from fmoe_jax.models.moe import ExpertWeights, Kernel, Routing, expert_parts
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.placement import CacheGroup, placement_from
from fmoe_jax.offload.policies import PolicyContext, make_policy
from fmoe_jax.offload.schedule import announce, needed_experts, serve_layer
from fmoe_jax.offload.transfer import DeviceExpertCache, JaxMover

from .resident import TRACE_COUNTS, Graph, StepOutput, resident_step, split
from .sampling import Sampling


def model_identity(cfg) -> str:
    """Names a model architecture for saved policy state (e.g. an fMoE store): family plus a config hash."""
    digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    return f"{cfg.family}-{digest[:16]}"


def router_weights(module: MoECausalLM) -> tuple[np.ndarray, ...]:
    """Each MoE layer's router kernel `[D, J]` as float32 host arrays (speculative and learned policies)."""
    cfg = module.config
    return tuple(np.asarray(module.layers[i].router.weight[...], np.float32).T for i in cfg.moe_layer_ids)


def _pad_pow2(n: int, cap: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return max(n, min(size, cap))


def _chunk_width(n: int, capacity: int, num_experts: int, tokens: int) -> int:
    """How many expert arguments a chunk of `n` experts passes to its jitted step (the rest repeat the first;
    no token is routed to them, so the switch kernels run nothing for them, while "ragged" and "blocked" still
    stack their weights). Decode steps pad to a power of two up to the cache capacity, so a few programs cover
    every count. Steps of several tokens (prefill) route to any number of experts per layer, so they always
    pass one width, min(J, capacity): a prompt whose layer happens to use fewer experts than any before it
    does not compile a new program mid-request."""
    if tokens > 1:
        n = max(n, min(num_experts, capacity))
    return _pad_pow2(n, capacity)


class OffloadEngine:
    """Serves a model whose routed experts live in host memory (see module docstring)."""

    def __init__(self, module: MoECausalLM, offload: OffloadConfig, *, kernel: Kernel = "auto"):
        cfg = module.config
        self.module = module
        self.config = cfg
        self.offload = offload
        self.kernel = kernel
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layer_ids)}
        graph, self.embed_params = split(module.embed)
        self._embed = embed_step(graph, cfg)
        graph, self.head_params = split((module.final_norm, module.output_projection))
        self._head = head_step(graph)
        self.layer_params, self.layer_fns = [], []
        for layer in module.layers:
            graph, params = split(layer)
            self.layer_params.append(params)
            self.layer_fns.append(layer_steps(graph, kernel))

        first = module.experts[cfg.moe_layer_ids[0]][0].weights()
        self.expert_bytes = sum(a.nbytes for a in first)
        total = cfg.num_moe_layers * cfg.num_experts
        self.policy = make_policy(offload.policy, **offload.policy_options)
        slots = total if self.policy.preload_all else offload.slots(self.expert_bytes, total)
        self.devices = resolve_devices(offload.devices)
        self.mesh = None
        if len(self.devices) == 1:
            self.cache = self._device_cache(self.devices[0], slots)
        else:
            self._place_dense_on_mesh()
            placement = placement_from(offload.placement, cfg.num_experts, len(self.devices))
            shares = per_device_slots(slots, cfg, placement, len(self.devices), self.policy.preload_all)
            local = jax.process_index()
            self.cache = CacheGroup(
                [
                    self._device_cache(d, n) if d.process_index == local else None
                    for d, n in zip(self.devices, shares, strict=True)
                ],
                placement,
            )
        ctx = PolicyContext(
            num_layers=cfg.num_moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            embed_dim=cfg.hidden_size,
            prefetch_distance=offload.prefetch_distance,
            capacity=slots,
            model_id=model_identity(cfg),
            options={"store_path": offload.store_path, "store_capacity": offload.store_capacity},
            router_weights=router_weights(module) if self.policy.needs_hidden else (),
        )
        self.policy.bind(ctx, self.cache)
        # A policy may hold a thread (fMoE's matcher) that would outlive a model nobody closes: close it
        # when the engine is collected, or on `close()`, whichever comes first (once).
        self._close_policy = weakref.finalize(self, _close_quietly, self.policy)
        if self.policy.preload_all or offload.preload:
            self.cache.preload([(m, e) for m in range(cfg.num_moe_layers) for e in range(cfg.num_experts)])
        self.overhead = collections.defaultdict(float)
        # A cache that holds every routed expert, filled at start, never evicts or loads: each step runs
        # as one whole-model program and the host replays the per-layer events afterwards
        # (`_step_resident`). Only for a cache filled at start, so that its programs compile on the
        # first calls, not in the middle of serving.
        preloaded = self.policy.preload_all or offload.preload
        self.whole_step = self.mesh is None and slots >= total and preloaded
        if self.whole_step:
            graph, self._whole_params = split(module)
            self._whole_step = resident_step(graph, kernel)
            self._whole_experts = _expert_leaves(graph, self.moe_index)
            self._all_keys = [(m, e) for m in range(cfg.num_moe_layers) for e in range(cfg.num_experts)]

    def _device_cache(self, device: jax.Device, slots: int) -> DeviceExpertCache:
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        return DeviceExpertCache(
            JaxMover(functools.partial(_host_expert, self.module), target),
            slots,
            self.expert_bytes,
            self.policy,
            max_inflight=self.offload.max_inflight,
            synchronous=self.offload.synchronous_transfers,
        )

    def _place_dense_on_mesh(self) -> None:
        """Several devices: dense weights replicated over a 1-D mesh, so attention, router and head run on
        every device and each device's experts find the router input locally."""
        self.mesh = jax.sharding.Mesh(np.array(self.devices), ("d",))
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.stacked = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("d"))
        self.embed_params = self._global(self.embed_params)
        self.head_params = self._global(self.head_params)
        self.layer_params = [self._global(p) for p in self.layer_params]

    def _global(self, tree: Any) -> Any:
        """Host or single-device data -> arrays replicated over the mesh (identity on one device).

        Built from this process's copies (every process holds the same values), which avoids the
        cross-process equality check `jax.device_put` runs on host data."""
        if self.mesh is None:
            return tree
        local = [d for d in self.devices if d.process_index == jax.process_index()]

        def one(x: Any) -> jax.Array:
            x = np.asarray(x)
            return jax.make_array_from_single_device_arrays(
                x.shape, self.replicated, [jax.device_put(x, d) for d in local]
            )

        return jax.tree.map(one, tree)

    def _host(self, array: jax.Array) -> np.ndarray:
        """A (replicated) result on the host: this process's copy of it."""
        if self.mesh is None:
            return np.asarray(array)
        return np.asarray(array.addressable_shards[0].data)

    # -- the generation loop's interface ----------------------------------------------------------------
    def init_cache(self, batch: int, length: int) -> list[LayerKV]:
        return self._global(init_kv_cache(self.config, batch, length, self.module.dtype))

    def begin(self, batch: int) -> None:
        """Starts a `generate` call: statistics count from here."""
        process_barrier("fmoe-generate")
        book = self.cache.book
        self._start = (copy.deepcopy(book.stats), {**self.cache.timers, **self.policy.timers})
        self.overhead.clear()
        self.policy.on_request_start(batch)

    def finish(self, stats) -> None:
        """Fills the cache and policy statistics of the call into `stats` (a `GenerationStats`)."""
        before, timers = self._start
        now = self.cache.book.stats
        stats.hits = now.hits - before.hits
        stats.misses = now.misses - before.misses
        stats.late_prefetches = now.late_prefetches - before.late_prefetches
        stats.prefetches = now.prefetches - before.prefetches
        stats.wasted_prefetches = now.wasted_prefetches - before.wasted_prefetches
        stats.bytes_to_device = now.bytes_to_device - before.bytes_to_device
        stats.hit_rate = stats.hits / (stats.hits + stats.misses) if stats.hits + stats.misses else 1.0
        stats.peak_cache_bytes = now.peak_bytes
        layers = self.config.num_moe_layers
        hits = [now.layer_hits.get(i, 0) - before.layer_hits.get(i, 0) for i in range(layers)]
        needed = [now.layer_needed.get(i, 0) - before.layer_needed.get(i, 0) for i in range(layers)]
        stats.layer_hit_rate = [h / n if n else 1.0 for h, n in zip(hits, needed, strict=True)]
        overhead = dict(self.overhead)
        for name, value in {**self.cache.timers, **self.policy.timers}.items():
            overhead[name] = overhead.get(name, 0.0) + value - timers.get(name, 0.0)
        stats.overhead_s = overhead
        stats.extra.update(self.policy.stats())
        stats.extra["cache_slots"] = self.cache.book.capacity
        if isinstance(self.cache, CacheGroup):
            stats.extra["devices"] = [str(d) for d in self.devices]
            stats.extra["per_device"] = self.cache.device_stats()
        stats.extra["expert_bytes"] = self.expert_bytes

    def close(self) -> None:
        """Closes the policy (stops its threads, saves its store) and re-raises its error, if any."""
        self._close_policy.detach()
        self.policy.close()

    def step(
        self,
        tokens: jax.Array,
        kv: list[LayerKV],
        layout: Layout,
        key: jax.Array,
        sampling: Sampling,
        record: bool = False,
        record_hidden: bool = False,
    ) -> tuple[StepOutput, list[LayerKV]]:
        if self.whole_step:
            done = self._step_resident(tokens, kv, layout, key, sampling, record, record and record_hidden)
            if done is not None:
                return done
        if self.mesh is not None:
            tokens, layout = self._global((tokens, layout))
            if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
                key = jax.random.key_data(key)
            key = self._global(key)  # raw key data; the sampler wraps it
        x, kv, extra = self._layers(tokens, kv, layout, record, record and record_hidden)
        next_tokens, logits = self._head(self.head_params, x, key, sampling)
        if self.mesh is not None:  # the generation loop reads them on this process's host
            next_tokens, logits = (jnp.asarray(self._host(a)) for a in (next_tokens, logits))
        out = StepOutput(next_tokens, logits)
        if record:
            out.embeds, out.probs, out.ids, out.hidden = extra
        return out, kv

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list[Routing]]:
        b, t = tokens.shape
        kv = self.init_cache(b, t)
        layout = Layout(jnp.int32(0), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), t)
        tokens, layout = self._global((tokens, layout))
        x, _, (_, probs, ids, _) = self._layers(tokens, kv, layout, True, False)
        logits = jnp.asarray(self._host(self._head(self.head_params, x, None, None, all_positions=True)))
        probs = probs.reshape(b * t, probs.shape[2], -1)
        ids = ids.reshape(b * t, ids.shape[2], -1)
        routings = [
            Routing(jnp.asarray(probs[:, i]), jnp.asarray(ids[:, i]), jnp.zeros(ids[:, i].shape))
            for i in range(probs.shape[1])
        ]
        return logits, routings

    def _step_resident(self, tokens, kv, layout, key, sampling, record, record_hidden):
        """Every routed expert is cached (and the cache holds them all): the whole step as one program, the
        resident engine's, with the cached experts' arrays for parameters. The host then replays what the
        per-layer loop would have told the cache and the policy, in the same order (all hits). None when
        some expert is not resident."""
        arrays = self.cache.pin_if_resident(self._all_keys)
        if arrays is None:
            return None
        policy = self.policy
        try:
            params = list(self._whole_params)
            for index, key_, field in self._whole_experts:
                params[index] = getattr(arrays[key_], field)
            want_hidden = policy.needs_hidden or record_hidden
            next_tokens, logits, kv, extra = self._whole_step(
                params, tokens, kv, layout, key, sampling, True, want_hidden
            )
            embeds, probs, ids, hidden = extra
            ids.block_until_ready()  # the step's compute is not overhead; what follows is
            start = time.perf_counter()
            b, t = np.shape(tokens)
            index = np.asarray(layout.write_index) + np.arange(t)
            valid_bt = (index[None, :] >= np.asarray(layout.key_start)[:, None]) & np.asarray(
                layout.row_active
            )[:, None]
            valid = valid_bt.reshape(b * t)
            ids = np.asarray(ids)  # [B, T, L, k]
            probs = np.asarray(probs) if (policy.needs_probs or record) else None
            embeds = np.asarray(embeds).astype(np.float32) if (policy.needs_semantic or record) else None
            hidden = np.asarray(hidden).astype(np.float32) if want_hidden else None
            self.overhead["context_collection"] += time.perf_counter() - start
            start = time.perf_counter()
            flat = embeds.reshape(b * t, -1) if policy.needs_semantic else None
            policy.on_iteration_start(flat, valid_bt)
            for moe in range(self.config.num_moe_layers):
                layer_ids = ids[:, :, moe].reshape(b * t, -1)
                needed = needed_experts(layer_ids, valid)
                announce(self.cache, moe, needed)
                policy.on_layer_routed(
                    moe,
                    probs[:, :, moe].reshape(b * t, -1) if policy.needs_probs else None,
                    layer_ids,
                    valid_bt,
                    hidden=hidden[:, :, moe].reshape(b * t, -1) if policy.needs_hidden else None,
                )
                self.cache.record_served(moe, [(moe, e) for e in needed])
                self.cache.protect(())
            policy.on_iteration_end()
            self.overhead["policy_events"] += time.perf_counter() - start
        finally:
            self.cache.release(self._all_keys)
        out = StepOutput(next_tokens, logits)
        if record:
            out.embeds, out.probs, out.ids = embeds, probs, ids
            out.hidden = hidden if record_hidden else None
        return out, kv

    # -- the per-layer loop -----------------------------------------------------------------------------
    def _layers(self, tokens, kv, layout, record, record_hidden):
        policy = self.policy
        b, t = tokens.shape
        valid_bt = self._host(layout.token_valid)  # [B, T] (layout arrays are small host-made inputs)
        valid = valid_bt.reshape(b * t)
        valid_dev = jnp.asarray(valid) if self.mesh is None else self._global(valid)
        x, rope = self._embed(self.embed_params, tokens, layout)

        embeds = None
        if policy.needs_semantic or record:
            x.block_until_ready()  # the embedding's compute is not overhead; copying it out is
            start = time.perf_counter()
            embeds = self._host(x).astype(np.float32).reshape(b * t, -1)
            self.overhead["context_collection"] += time.perf_counter() - start
        start = time.perf_counter()
        policy.on_iteration_start(embeds if policy.needs_semantic else None, valid_bt)
        self.overhead["policy_events"] += time.perf_counter() - start

        kv = list(kv)
        if self.mesh is None:
            layout = jax.device_put(layout)  # once, not at each of the layers' calls
        probs_all, ids_all, hidden_all = [], [], []
        want_hidden = policy.needs_hidden or record_hidden
        for layer_id, (state, fns) in enumerate(zip(self.layer_params, self.layer_fns, strict=True)):
            if layer_id not in self.moe_index:
                x, kv[layer_id] = fns.dense_layer(state, x, kv[layer_id], layout, rope)
                continue
            moe = self.moe_index[layer_id]
            h, z, routing, kv[layer_id] = fns.attention_and_router(state, x, kv[layer_id], layout, rope)
            routing.ids.block_until_ready()  # the one sync point of the layer: attention and router done
            start = time.perf_counter()
            ids = self._host(routing.ids)  # [N, k]
            probs = self._host(routing.probs) if (policy.needs_probs or record) else None
            hidden = self._host(z).astype(np.float32) if want_hidden else None  # [N, D] router input
            self.overhead["context_collection"] += time.perf_counter() - start
            needed = needed_experts(ids, valid)
            announce(self.cache, moe, needed)
            start = time.perf_counter()
            policy.on_layer_routed(
                moe,
                probs if policy.needs_probs else None,
                ids,
                valid_bt,
                hidden=hidden if policy.needs_hidden else None,
            )
            self.overhead["policy_events"] += time.perf_counter() - start
            if record:
                probs_all.append(probs)
                ids_all.append(ids)
                hidden_all.append(hidden)
            if self.mesh is None:
                x = self._run_experts(moe, fns.experts_finish, state, h, z, routing, valid_dev, needed)
            else:
                x = self._run_experts_on_devices(moe, fns.combine, state, h, z, routing, valid_dev, needed)
        start = time.perf_counter()
        policy.on_iteration_end()
        self.overhead["policy_events"] += time.perf_counter() - start
        extra = None
        if record:
            extra = (
                embeds.reshape(b, t, -1),
                np.stack(probs_all, 1).reshape(b, t, len(probs_all), -1),
                np.stack(ids_all, 1).reshape(b, t, len(ids_all), -1),
                np.stack(hidden_all, 1).reshape(b, t, len(ids_all), -1) if record_hidden else None,
            )
        return x, kv, extra

    def _run_experts(self, moe, experts_finish, state, h, z, routing, valid, needed):
        """Computes a layer's experts with what fits the cache, in chunks when it needs more than that."""
        capacity, num_experts = self.cache.book.capacity, self.config.num_experts
        acc = _no_parts(z, routing)  # earlier chunks' assignment outputs (always an array: one variant)
        if not needed:  # only padding or finished rows: the shared expert and the residual remain
            no_slots = jnp.full((num_experts,), -1, jnp.int32)
            return experts_finish(state, h, z, routing, (), no_slots, valid, acc)

        def compute(chunk, arrays, is_last):
            nonlocal acc
            experts = [arrays[k] for k in chunk]
            slots = np.full((num_experts,), -1, np.int32)
            slots[[e for _, e in chunk]] = np.arange(len(chunk), dtype=np.int32)
            width = _chunk_width(len(experts), capacity, num_experts, h.shape[1])
            experts += [experts[0]] * (width - len(experts))
            slots = jnp.asarray(slots)
            if is_last:
                return experts_finish(state, h, z, routing, tuple(experts), slots, valid, acc)
            acc = _experts_partial(self.kernel, z, routing, tuple(experts), slots, valid, acc)
            acc.block_until_ready()  # the next chunk evicts these experts: let the computation finish
            return None

        return serve_layer(self.cache, moe, needed, compute)

    def _run_experts_on_devices(self, moe, combine, state, h, z, routing, valid, needed):
        """Each device computes the experts it holds (in chunks as needed) on its local copy of the router
        input; the partial sums meet in one array sharded over the mesh and are added up there."""
        group, num_experts = self.cache, self.config.num_experts
        partials = []
        for index, (device, keys) in enumerate(
            zip(self.devices, group.split((moe, e) for e in needed), strict=True)
        ):
            cache = group.caches[index]
            if cache is None:  # another process's device
                continue
            z_d, routing_d, valid_d = (local_copy(a, device) for a in (z, routing, valid))
            acc = jax.device_put(_no_parts(z, routing), device)

            def compute(
                chunk,
                arrays,
                is_last,
                z_d=z_d,
                routing_d=routing_d,
                valid_d=valid_d,
                cache=cache,
                device=device,
            ):
                nonlocal acc
                experts = [arrays[k] for k in chunk]
                slots = np.full((num_experts,), -1, np.int32)
                slots[[e for _, e in chunk]] = np.arange(len(chunk), dtype=np.int32)
                width = _chunk_width(len(experts), cache.book.capacity, num_experts, h.shape[1])
                experts += [experts[0]] * (width - len(experts))
                acc = _experts_partial(
                    self.kernel, z_d, routing_d, tuple(experts), jax.device_put(slots, device), valid_d, acc
                )
                if not is_last:
                    acc.block_until_ready()  # the next chunk evicts these experts
                return acc

            serve_layer(cache, moe, [e for _, e in keys], compute)
            partials.append(acc[None])
        stacked = jax.make_array_from_single_device_arrays(
            (len(self.devices), *z.shape), self.stacked, partials
        )
        return combine(state, h, z, stacked)


_BARRIERS = collections.Counter()


def process_barrier(name: str, timeout_s: float = 900.0) -> None:
    """Multi-host: waits until every process reaches this point (no-op with one process).

    The CPU collectives (gloo) give up if the processes reach their first collective more than 30 s
    apart, as happens when one loads a model slower; a coordination-service barrier first lines them up.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordination client has no public handle in jax 0.10

    _BARRIERS[name] += 1
    distributed.global_state.client.wait_at_barrier(f"{name}-{_BARRIERS[name]}", int(timeout_s * 1000))


def resolve_devices(spec: Any) -> list[jax.Device]:
    """`None` (the default device), a count (the first n devices), devices, or a `Mesh` -> device list."""
    if spec is None:
        return [jax.local_devices()[0]]
    if isinstance(spec, int):
        available = jax.devices()
        if not 1 <= spec <= len(available):
            raise ValueError(f"devices={spec} but {len(available)} are available ({available})")
        return available[:spec]
    if isinstance(spec, jax.sharding.Mesh):
        return list(spec.devices.flat)
    devices = list(spec)
    if not devices:
        raise ValueError("devices is empty")
    return devices


def per_device_slots(slots: int, cfg, placement, num_devices: int, everything: bool) -> list[int]:
    """Splits the cache budget over devices: each gets an equal share (at least one slot), or, for a
    cache that holds everything, exactly the experts placed on it."""
    if everything:
        counts = [0] * num_devices
        for m in range(cfg.num_moe_layers):
            for e in range(cfg.num_experts):
                counts[placement((m, e))] += 1
        return [max(1, c) for c in counts]
    if slots < num_devices:
        raise ValueError(f"a budget of {slots} expert slots cannot give each of {num_devices} devices one")
    return [slots // num_devices + (1 if d < slots % num_devices else 0) for d in range(num_devices)]


def local_copy(tree: Any, device: jax.Device) -> Any:
    """The single-device view of a replicated array (or pytree of them) on `device`, without a copy."""

    def one(array: jax.Array) -> jax.Array:
        for shard in array.addressable_shards:
            if shard.device == device:
                return shard.data
        return jax.device_put(array, device)

    return jax.tree.map(one, tree)


# -- jitted steps -----------------------------------------------------------------------------------------
# Built once per model graph (graphs compare by structure, so every layer of a model shares them, and so
# do engines of the same architecture). Closing over the graph, rather than passing it as a static
# argument, keeps it from being hashed on every call (~0.15 ms each on this CPU).


class LayerSteps(NamedTuple):
    attention_and_router: Callable
    dense_layer: Callable
    experts_finish: Callable
    combine: Callable


@functools.cache
def layer_steps(graph: Graph, kernel: Kernel) -> LayerSteps:
    def attention_and_router(state, x, kv, layout, rope):
        TRACE_COUNTS[f"attention_and_router_T{x.shape[1]}"] += 1
        layer = graph.merge(state)
        h, z, kv = layer.attention_block(x, rope, kv, layout)
        z = z.reshape(-1, z.shape[-1])
        return h, z, layer.route(z), kv

    def dense_layer(state, x, kv, layout, rope):
        TRACE_COUNTS[f"dense_layer_T{x.shape[1]}"] += 1
        layer = graph.merge(state)
        h, z, kv = layer.attention_block(x, rope, kv, layout)
        return h + layer.dense_output(z).astype(h.dtype), kv

    def experts_finish(state, h, z, routing, experts, slots, valid, acc):
        """The last (usually only) chunk of a layer's experts, plus the shared expert and the residual."""
        TRACE_COUNTS[f"experts_finish_T{h.shape[1]}_n{len(experts)}"] += 1
        layer = graph.merge(state)
        parts = acc + expert_parts(z, routing, experts, slots, valid, kernel=kernel) if experts else acc
        return h + layer.mix(z, parts).reshape(h.shape).astype(h.dtype)

    def combine(state, h, z, partials):
        """Several devices: the per-device assignment outputs `[n, N, k, D]` (each assignment nonzero on
        one device only, so their sum is exact), then the layer's mix and the residual."""
        TRACE_COUNTS[f"combine_T{h.shape[1]}"] += 1
        layer = graph.merge(state)
        return h + layer.mix(z, jnp.sum(partials, axis=0)).reshape(h.shape).astype(h.dtype)

    return LayerSteps(
        jax.jit(attention_and_router, donate_argnums=2),
        jax.jit(dense_layer, donate_argnums=2),
        jax.jit(experts_finish),
        jax.jit(combine),
    )


@functools.cache
def embed_step(graph: Graph, cfg) -> Callable:
    def embed(state, tokens, layout):
        TRACE_COUNTS[f"embed_T{tokens.shape[1]}"] += 1
        x = graph.merge(state)(tokens)
        return x, MoECausalLM.rope_for(cfg, layout, x.dtype)

    return jax.jit(embed)


@functools.cache
def head_step(graph: Graph) -> Callable:
    def head(state, x, key, sampling, all_positions=False):
        TRACE_COUNTS[f"head_all{all_positions}"] += 1
        norm, projection = graph.merge(state)
        if all_positions:
            return output_logits(norm, projection, x)
        logits = output_logits(norm, projection, x[:, -1])
        return sampling(logits, key), logits

    return jax.jit(head, static_argnums=3, static_argnames="all_positions")


@functools.partial(jax.jit, static_argnums=0)
def _experts_partial(kernel, z, routing, experts, slots, valid, acc):
    """An earlier chunk of a layer that needs more experts than the cache holds: its assignments' outputs
    added to `acc` `[N, k, D]` float32 (the places of other chunks' assignments are zero here)."""
    TRACE_COUNTS[f"experts_partial_N{z.shape[0]}_n{len(experts)}"] += 1
    return acc + expert_parts(z, routing, experts, slots, valid, kernel=kernel)


def _no_parts(z: jax.Array, routing: Routing) -> jax.Array:
    """The empty assignment-output buffer `[N, k, D]` float32 a layer's chunks fill."""
    return jnp.zeros((*routing.ids.shape, z.shape[-1]), jnp.float32)


def _expert_leaves(graph: Graph, moe_index: dict[int, int]) -> list[tuple[int, tuple[int, int], str]]:
    """(position in the flat parameter list, (MoE layer index, expert), field) of every routed expert's
    matrix in the whole-model graph; the fast path puts the cached arrays there."""
    abstract = jax.tree.unflatten(graph.treedef, list(range(graph.treedef.num_leaves)))
    out = []
    for path, index in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if keys[0] == "experts":
            out.append((index, (moe_index[keys[1]], keys[2]), keys[3]))
    return out


def _host_expert(module: MoECausalLM, key: tuple[int, int]) -> ExpertWeights:
    """Host weights of (MoE layer index, expert). A function of the module, not a method of the engine, so
    that the cache (and a policy thread holding it) does not keep the engine and its executables alive."""
    return module.experts[module.config.moe_layer_ids[key[0]]][key[1]].weights()


def _close_quietly(policy: Any) -> None:
    """Closes a policy whose engine was collected without `close()`; an error has nowhere to go then."""
    try:
        policy.close()
    except Exception:  # noqa: BLE001, S110
        pass
