"""The live offload engine's own host costs, as the simulator charges them (`simulate`, `HardwarePreset`).

The engine (`fmoe_jax/engines/step_loop.py`) launches its step program once at the start of a step, with
every expert the device holds ready, and reads its results once (a host sync); the program runs until the
first MoE layer that routes a token to an expert it was not given, where the engine loads that layer's
misses and launches again (one more launch and sync). Per MoE layer the host hears the routing and serves
it (the driver, the cache and the policy: `layer_host_s`, plus the policy's own measured time `policy_s`
when the caller passes it), and each expert copy costs its issue (`copy_issue_s`). `EngineModel` follows
the same rule on the simulated clock: a layer is a stop when one of the experts it runs was not ready in
the cache when the last launch went out, and it tells the cache of each stop and its price (the relaunch and
its sync: `CacheView.stops`, `.stop_s`), as the live engine does, so that a policy that prices a miss's
relaunch (fmoe) decides alike in both. Host work is serial with the device at batch 1 (every launch
waits on the sync before it), so every charge advances the clock; copies in flight overlap it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .hardware import HardwarePreset


class EngineModel:
    """One replay's engine charges (see the module docstring); `launches` and `syncs` count them.

    Args:
      hardware: the preset whose `launch_s`, `launch_argument_s`, `sync_s`, `layer_host_s` and
        `copy_issue_s` are charged.
      arguments: the step program's arguments (`ModelPreset.launch_arguments`), each costing
        `launch_argument_s` per launch.
      cache: the replay's `DeviceExpertCache` (what is ready at a launch; its copies issued).
      policy_s: the policy's host seconds per MoE layer on the engine's path (0: free).
    """

    def __init__(self, hardware: HardwarePreset, arguments: int, cache: Any, policy_s: float = 0.0):
        self.launch_s = hardware.launch_s + arguments * hardware.launch_argument_s
        self.sync_s, self.layer_s = hardware.sync_s, hardware.layer_host_s + policy_s
        self.copy_issue_s = hardware.copy_issue_s
        self.cache = cache
        self.active = self.launch_s > 0 or self.sync_s > 0 or self.layer_s > 0 or self.copy_issue_s > 0
        self.launches = self.syncs = 0
        self._usable: set = set()
        self._loads: int | None = None
        self._layer_keys: set = set()

    def step_started(self) -> float:
        """A step's first launch and its read: seconds to charge (none, and nothing counted, when the
        preset has no engine costs)."""
        if not self.active:
            return 0.0
        if self._loads is None:
            self._loads = self.cache.stats.loads
        self.launches += 1
        self.syncs += 1
        self._usable = set(self.cache.ready_arrays())
        return self.launch_s + self.sync_s

    def routed(self) -> float:
        """The host hears a layer's routing and serves it."""
        self._layer_keys = set()
        return self.layer_s

    def runs(self, keys: Iterable[Any]) -> None:
        """Experts the layer runs (a chunk on the device, or the host's share)."""
        self._layer_keys.update(keys)

    def relaunch_s(self) -> float:
        """What one stop costs (`CacheView.stop_s`): a launch and its sync."""
        return self.launch_s + self.sync_s

    def layer_done(self) -> float:
        """After a layer's last chunk: a relaunch (and its read) if the layer stopped the last launch, and
        the copies issued since the last charge."""
        if not self.active:
            return 0.0
        stop = not self._layer_keys <= self._usable
        self.launches += stop
        self.syncs += stop
        loads = self.cache.stats.loads
        seconds = (loads - self._loads) * self.copy_issue_s
        self._loads = loads
        if stop:
            self._usable = set(self.cache.ready_arrays())
            seconds += self.launch_s + self.sync_s
            self.cache.record_stop(self.relaunch_s)
        return seconds
