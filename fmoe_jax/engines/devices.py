"""The devices an offload engine serves from: one, or several with the dense weights replicated over a
one-axis mesh and each device computing the experts it holds. The engine's layer loop is written once for
both; `DeviceSet` is where one device and many differ (placing, reading back, combining).

Also the multi-host pieces: a barrier that lines processes up before their first collective.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


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


class DeviceSet:
    """One device, or several behind a one-axis mesh ("d") over which dense weights are replicated."""

    def __init__(self, devices: list[jax.Device]):
        self.devices = devices
        self.single = len(devices) == 1
        self.local = [d.process_index == jax.process_index() for d in devices]
        self._barriers = 0
        if self.single:
            self.mesh = None
            return
        self.mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.stacked = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("d"))

    def __len__(self) -> int:
        return len(self.devices)

    def cache_target(self, index: int) -> jax.sharding.Sharding:
        """Where device `index`'s expert cache puts its copies."""
        return jax.sharding.SingleDeviceSharding(self.devices[index], memory_kind="device")

    def replicate(self, tree: Any) -> Any:
        """Host or single-device data -> on the device (one), or replicated over the mesh (several).

        Built from this process's copies (every process holds the same values), which avoids the
        cross-process equality check `jax.device_put` runs on host data."""
        if self.single:
            return jax.device_put(tree, self.devices[0])
        local = [d for d, mine in zip(self.devices, self.local, strict=True) if mine]

        def one(x: Any) -> jax.Array:
            x = np.asarray(x)
            return jax.make_array_from_single_device_arrays(
                x.shape, self.replicated, [jax.device_put(x, d) for d in local]
            )

        return jax.tree.map(one, tree)

    def host(self, array: jax.Array) -> np.ndarray:
        """A (replicated) result on the host: this process's copy of it."""
        if self.single:
            return np.asarray(array)
        return np.asarray(array.addressable_shards[0].data)

    def hosts(self, *arrays: jax.Array | None) -> list[np.ndarray | None]:
        """`host` of several results (None stays None), their copies started together: on a GPU each
        device-to-host copy has a fixed cost that the copies then share."""
        local = [None if a is None else a if self.single else a.addressable_shards[0].data for a in arrays]
        for array in local:
            if array is not None:
                array.copy_to_host_async()
        return [None if a is None else np.asarray(a) for a in local]

    def on(self, tree: Any, index: int) -> Any:
        """The view of replicated arrays on device `index`, without a copy (identity with one device)."""
        if self.single:
            return tree
        device = self.devices[index]

        def one(array: jax.Array) -> jax.Array:
            for shard in array.addressable_shards:
                if shard.device == device:
                    return shard.data
            return jax.device_put(array, device)

        return jax.tree.map(one, tree)

    def put(self, x: Any, index: int) -> Any:
        return x if self.single else jax.device_put(x, self.devices[index])

    def gather(self, per_device: list[jax.Array]) -> jax.Array:
        """This process's per-device arrays (each `[...]`) as one `[n, ...]` array sharded over the mesh."""
        shape = (len(self.devices), *per_device[0].shape)
        return jax.make_array_from_single_device_arrays(shape, self.stacked, [a[None] for a in per_device])

    def barrier(self, name: str, timeout_s: float = 900.0) -> None:
        """Multi-host: waits until every process reaches this point (no-op with one process).

        The CPU collectives (gloo) give up if the processes reach their first collective more than 30 s
        apart, as happens when one loads a model slower; a coordination-service barrier first lines them
        up. jax 0.10 has no public handle on the coordination client, hence the one private import here.
        """
        if jax.process_count() == 1:
            return
        from jax._src import distributed

        self._barriers += 1
        distributed.global_state.client.wait_at_barrier(f"{name}-{self._barriers}", int(timeout_s * 1000))


def per_device_slots(slots: int, cfg: Any, placement: Any, num_devices: int, everything: bool) -> list[int]:
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
