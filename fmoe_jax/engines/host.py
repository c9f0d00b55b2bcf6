"""Hybrid execution in the live engine: the host's share of a layer computed by jitted programs on JAX's CPU
backend from the experts' host copies (the copy timings the hybrid planner reads are `TimedMover`'s, in
`offload/transfer.py`). Used by `engines/offload.py` with `OffloadConfig(execution="hybrid")`; the decision
itself is `offload/hybrid.py`'s.

Mechanics, chosen by measurement (jax 0.10.2, this 2-core CPU; README "Hybrid execution"):
- The host runs `expert_parts` itself, the function the device's kernels run, jitted on
  `jax.devices("cpu")`: each assignment's float32 output lands in its own place of an `[N, k, D]` buffer, the
  device's buffer adds it (places are disjoint, so the sum is exact), and `sum_parts` rounds once as always.
  Generation is bit-identical to resident serving (tests/test_hybrid.py).
- `jax.experimental.compute_on("device_host")` inside the device's program was the other candidate: it
  rejects the model's kernels (jax 0.10.2: "memory_space of all inputs passed to `select_n` must be the
  same": the kernels' constants live in device memory) and would need a second, host-space-clean kernel.
- One host copy: the experts live in `pinned_host` memory (what the device cache copies from); the CPU
  backend's view of each is made with `np.asarray` and `jax.device_put(..., may_alias=True)`, which on a CPU
  backend shares the buffer (checked: same address; a copy of 128 MB took 105-170 ms here, the view 0.5 ms).
  Where it cannot share (a GPU's pinned memory may come back as a copy), the view is a second copy:
  `aliased` says which, and `out.stats.extra["host_copies_alias_pinned"]` reports it. Whether a CPU-backend
  array could instead feed the device's copies at pinned speed needs a GPU to measure (none here).
- Threads: XLA:CPU has no per-program thread count; `host_threads=1` compiles the host program
  single-threaded (`xla_cpu_multi_thread_eigen=False`, bit-identical here), n > 1 splits a layer's host
  experts over n such programs dispatched together, None uses XLA:CPU's pool.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from fmoe_jax.models import MoECausalLM
from fmoe_jax.models.moe import ExpertWeights, Kernel, expert_parts
from fmoe_jax.offload.cache import Key
from fmoe_jax.offload.hybrid import HostCost

from .programs import Programs, chunk_width

SINGLE_THREADED = {"xla_cpu_multi_thread_eigen": False}


@dataclasses.dataclass
class Pending:
    """A host call in flight: its programs' outputs and what its measurement needs."""

    outputs: list[jax.Array]  # [N, k, D] float32 each, on the CPU backend
    expert_tokens: list[int]
    started: float
    compile_s: float  # the model's compile time when it started (a call that compiled is not measured)


class HostCompute:
    """The host's share of a layer: dispatch (`start`), then its result on a device (`finish`).

    Args:
      module: the model; its routed experts in host memory.
      programs: the model's programs (the host program is one of them, compiled for the CPU backend).
      kernel: the expert kernel, the device's.
      threads: `OffloadConfig.host_threads`.
      cost: the planner's host cost, told each measured call (`HostCost.record`: a cost that learns).
    """

    def __init__(
        self, module: MoECausalLM, programs: Programs, kernel: Kernel, threads: int | None, cost: HostCost
    ):
        self.module, self.programs, self.cost = module, programs, cost
        self.cpu = jax.devices("cpu")[0]
        self.threads = threads
        options = SINGLE_THREADED if threads is not None else {}
        self.program = programs.memo(
            ("host_parts", kernel, threads is not None),
            lambda: programs.jit(
                _host_parts(kernel),
                lambda z, r, experts, *_: f"host_parts_N{z.shape[0]}_n{len(experts)}",
                compiler_options=options,
            ),
        )
        self.views: dict[Key, ExpertWeights] = {}
        self.aliased = True  # every view made so far shares its pinned buffer
        self.busy_s = 0.0
        self.calls = 0

    def weights(self, key: Key) -> ExpertWeights:
        """Expert `key`'s weights as CPU-backend arrays, sharing the pinned host buffers where possible."""
        if key not in self.views:
            cfg = self.module.config
            pinned = self.module.experts[cfg.moe_layer_ids[key[0]]][key[1]].weights()
            # Float matrices, or quantized ones (`QuantizedMatrix`: values and scales), leaf by leaf: the
            # host program dequantizes inside the expert kernel, as the device's does.
            view = jax.tree.map(lambda a: jax.device_put(np.asarray(a), self.cpu, may_alias=True), pinned)
            leaves = zip(jax.tree.leaves(pinned), jax.tree.leaves(view), strict=True)
            self.aliased &= all(_same_buffer(a, b) for a, b in leaves)
            self.views[key] = view
        return self.views[key]

    def start(
        self, keys: list[Key], expert_tokens: list[int], t: int, z: jax.Array, routing: Any, valid: jax.Array
    ) -> Pending:
        """Dispatches the host's experts `keys` of one layer (each with its count of tokens; z `[N, D]` of a
        step of T = `t` tokens per row, its routing and valid `[N]`); does not wait for them."""
        start = time.perf_counter()
        z, routing, valid = jax.device_put((z, routing, valid), self.cpu)
        n = min(self.threads, len(keys)) if self.threads else 1
        num_experts = self.module.config.num_experts
        outputs = []
        compile_s = self.programs.compile_s
        for group in (keys[i::n] for i in range(n)):
            slots = np.full((num_experts,), -1, np.int32)
            slots[[e for _, e in group]] = np.arange(len(group), dtype=np.int32)
            experts = [self.weights(k) for k in group]
            experts += [experts[0]] * (chunk_width(len(group), num_experts, num_experts, t) - len(group))
            outputs.append(self.program(z, routing, tuple(experts), jax.device_put(slots, self.cpu), valid))
        return Pending(outputs, list(expert_tokens), start, compile_s)

    def finish(self, pending: Pending, device: jax.Device, add: Any) -> jax.Array:
        """Waits for a call's outputs, records its time, and returns their sum `[N, k, D]` on `device`."""
        jax.block_until_ready(pending.outputs)
        seconds = time.perf_counter() - pending.started
        self.calls += 1
        if self.programs.compile_s == pending.compile_s:  # a call that compiled is not host compute time
            self.busy_s += seconds
            self.cost.record(pending.expert_tokens, seconds)
        total = pending.outputs[0]
        for more in pending.outputs[1:]:
            total = add(total, more)  # disjoint places: exact
        return jax.device_put(total, device)


def _host_parts(kernel: Kernel):
    def host_parts(z, routing, experts, slots, valid):
        return expert_parts(z, routing, experts, slots, valid, kernel=kernel)

    return host_parts


def _same_buffer(a: jax.Array, b: jax.Array) -> bool:
    try:
        return a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - a backend that does not expose its pointers: assume a copy
        return False
