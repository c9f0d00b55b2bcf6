"""The offload engine: serves a model whose routed experts live in host memory, with a device expert cache.

A step is the iteration driver's loop over the MoE layers (`offload/driver.py`, which orders what the policy
and the cache hear) run by a `StepLoop` (`engines/step_loop.py`): the step program (`engines/segment.py`)
runs the layers with every routed expert the device holds and stops at the first MoE layer that routes to
one it lacks; the driver loads that layer's misses and the program resumes from there. A step whose routed
experts are all resident is one launch and one host read, whatever the budget. A layer that needs more
experts than the cache holds runs in chunks. With several devices each computes the experts it holds and
the layer's outputs meet in the next launch (`engines/devices.py`).

Hybrid execution (`OffloadConfig(execution="hybrid")`): the driver's planner hands some misses to the host;
the loop dispatches them to the CPU backend (`engines/host.py`) before the device's chunks, and adds the
host's outputs to the device's before resuming.
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
from fmoe_jax.offload.driver import Driver
from fmoe_jax.offload.hybrid import DeviceCost, HostCost, HybridPlanner, MeasuredHostCost
from fmoe_jax.offload.placement import CacheGroup, placement_from
from fmoe_jax.offload.policies import PolicyContext
from fmoe_jax.offload.transfer import TimedMover, jax_mover

from ..sampling import Sampling
from . import ForcedStep, StepOutput
from .devices import DeviceSet, per_device_slots, resolve_devices
from .host import HostCompute
from .programs import (
    Graph,
    Programs,
    add_parts,
    chunk_width,
    experts_partial,
    forward_inputs,
    no_parts,
    split,
)
from .segment import Entry, offload_step
from .step_loop import ExpertArguments, StepLoop
from .stop_price import StopPrice


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
        graph, params = split(module)
        self.step_program = offload_step(self.programs, graph, kernel)
        self.experts_partial = experts_partial(self.programs, kernel)
        positions = _expert_leaves(graph, self.moe_index)
        experts = {index for index, _, _ in positions}
        # The dense parameters on the device(s); the routed experts' come from the cache at each launch.
        dense = self.devices.replicate([None if i in experts else p for i, p in enumerate(params)])
        placeholder = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), _host_expert(module, (0, 0)))
        placeholder = self.devices.replicate(placeholder)
        self.arguments = ExpertArguments(dense, positions, placeholder, (cfg.num_moe_layers, cfg.num_experts))

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
        self.add_parts = add_parts(self.programs)
        self.driver = Driver(self.policy, self.cache, planner)
        # Whether a launch uses every expert the device holds and runs on until a layer misses (one device,
        # and a planner that gives the host only misses); else it stops at every MoE layer, after which
        # the driver serves the layer as the planner says.
        self.optimistic = self.devices.single and (planner is None or planner.device is None)
        # What a stop for a miss costs (`CacheView.stop_s`): an engine that stops at every layer has none.
        self.stop_price = StopPrice()
        # A policy may hold a thread (fMoE's matcher) that would outlive a model nobody closes: close it
        # when the engine is collected, or on `close()`, whichever comes first (once).
        self._close_policy = weakref.finalize(self, _close_quietly, self.policy)
        if self.policy.preload_all or offload.preload:
            self.cache.preload(self.all_keys)
        elif self.policy.initial_experts():
            self.cache.preload(self.policy.initial_experts())
        self._no_parts: dict[tuple, jax.Array] = {}
        self._entries: dict[tuple[int, int], Entry] = {}
        self._steps: list[tuple[int, int, float]] = []  # per step since `begin`: launches, syncs, host s

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
        self._steps = []
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
        stats.step_launches = [s[0] for s in self._steps]
        stats.step_syncs = [s[1] for s in self._steps]
        stats.step_host_s = [s[2] for s in self._steps]
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
        forced: ForcedStep | None = None,
    ) -> tuple[StepOutput, list[LayerKV]]:
        """Prefill (T > 1) or one decode step (T = 1); samples each row's next token. `requests`: each row's
        request id (`IterationStart.requests`), for continuous batching. `forced`: routing every MoE layer
        and the semantic context the policy hears instead of the step's own (`ForcedStep`)."""
        self.driver.requests = None if requests is None else tuple(int(r) for r in requests)
        if not self.devices.single:
            if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
                key = jax.random.key_data(key)
            key = self.devices.replicate(key)  # raw key data; the sampler wraps it
        start, waited = time.perf_counter(), self.cache.on_demand_wait_s
        policy_s = self.driver.timers["policy_events"]
        loop = StepLoop(
            self,
            tokens,
            kv,
            layout,
            key,
            sampling,
            record=record,
            record_hidden=record and record_hidden,
            forced=None if forced is None else forced.routing,
            forced_embeds=None if forced is None else forced.embeds,
        )
        out, kv = loop.run()
        wall, waited = time.perf_counter() - start, self.cache.on_demand_wait_s - waited
        self._steps.append((loop.launches, loop.syncs, wall - loop.waited_s - waited))
        if self.optimistic and np.shape(tokens)[1] == 1:
            self.stop_price.add(loop.stops, wall - waited - (self.driver.timers["policy_events"] - policy_s))
        return out, kv

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list[Routing]]:
        """Full-sequence logits `[B, T, V]` and each MoE layer's routing (probabilities only)."""
        b, t = tokens.shape
        kv, layout = forward_inputs(self.config, tokens, self.module.dtype)
        loop = StepLoop(
            self,
            tokens,
            self.devices.replicate(kv),
            layout,
            None,
            None,
            record=True,
            record_hidden=False,
            all_positions=True,
        )
        out, _ = loop.run()
        recorded = out.recorded
        probs = recorded.probs.reshape(b * t, recorded.probs.shape[2], -1)
        ids = recorded.ids.reshape(b * t, recorded.ids.shape[2], -1)
        routings = [
            Routing(jnp.asarray(probs[:, i]), jnp.asarray(ids[:, i]), jnp.zeros(ids[:, i].shape))
            for i in range(probs.shape[1])
        ]
        return jnp.asarray(out.logits), routings

    # -- what a step's loop asks of the engine --------------------------------------------------------------
    def resident(self) -> dict[Key, ExpertWeights]:
        """The experts a launch may use without asking: all the device holds (optimistic), or none."""
        return self.cache.ready_arrays() if self.optimistic else {}

    def first_entry(self, b: int, t: int) -> Entry:
        """A step's first entry (the embedding): zeros of the shapes a stop layer's state has."""
        if (b, t) not in self._entries:
            cfg, n = self.config, b * t
            z = jax.ShapeDtypeStruct((n, cfg.hidden_size), self.module.dtype)
            routing = jax.eval_shape(self.module.layers[cfg.moe_layer_ids[0]].route, z)
            zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), routing)
            h = np.zeros((b, t, cfg.hidden_size), self.module.dtype)
            entry = Entry(np.int32(-1), h, np.zeros(z.shape, z.dtype), zeros, None)
            entry = self.devices.replicate(entry)
            if self.devices.single:
                acc = self.empty_parts((b, t), 0)
            else:
                acc = self.devices.gather(
                    [self.empty_parts((b, t), i) for i, mine in enumerate(self.devices.local) if mine]
                )
            self._entries[(b, t)] = entry._replace(acc=acc)
        return self._entries[(b, t)]

    def empty_parts(self, shape: tuple[int, int], device: int) -> jax.Array:
        """The zero buffer `[N, k, D]` float32 a layer's chunks add their assignment outputs to, on `device`:
        made once per shape and device and shared by every layer and step (the jitted steps return new
        buffers, never write to it). Made per layer, its eager zeros cost ~0.1 ms of dispatch each on CPU."""
        cfg = self.config
        key = (shape, device)
        if key not in self._no_parts:
            zeros = no_parts(shape[0] * shape[1], cfg.top_k, cfg.hidden_size)
            self._no_parts[key] = jax.device_put(zeros, self.devices.devices[device])
        return self._no_parts[key]

    def chunk_arguments(self, chunk: list[Key], arrays: dict, tokens: int, device: int):
        """A chunk's experts as `experts_partial` takes them: the weights (padded to a few widths, see
        `chunk_width`) and `slot_of_expert` `[J]` (-1: not in this chunk)."""
        num_experts = self.config.num_experts
        slots = np.full((num_experts,), -1, np.int32)
        experts = [arrays[k] for k in chunk]
        slots[[e for _, e in chunk]] = np.arange(len(chunk), dtype=np.int32)
        capacity = self.device_slots[device]
        experts += [experts[0]] * (chunk_width(len(experts), capacity, num_experts, tokens) - len(experts))
        return tuple(experts), self.devices.put(jnp.asarray(slots), device)


def _expert_leaves(graph: Graph, moe_index: dict[int, int]) -> list[tuple[int, Key, tuple[str, ...]]]:
    """(position in the flat parameter list, (MoE layer index, expert), fields) of every routed expert's
    array in the whole-model graph; a launch puts the cached arrays there. Fields name the array in
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
