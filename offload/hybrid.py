"""Hybrid execution: which of a layer's needed experts the host CPU computes from its own copy of the weights
instead of waiting for a copy to the device, and what host compute costs (modelled, or measured online).

The iteration driver (`offload/driver.py`) asks a `HybridPlanner` once per MoE layer, after the routing
and before any expert runs; the live engine (`fmoe_jax/engines/host.py`) and the simulator
(`offload/simulator.py`) then run the host's share concurrently with the device's. Plain Python, no JAX.

The decision (DESIGN.md, "One decode iteration", step c), per needed expert:
- resident on the device: the device computes it (a hit);
- otherwise the host takes it if it would finish it sooner than its copy would land: an arriving copy's
  remaining time, or for an expert nobody is copying, an on-demand load issued now; either counts the
  on-demand loads already planned for this layer (they go before a prefetch's unsent chunks). The host's
  finish time counts its call overhead once per layer (latency, the activations to the host) and, per
  expert, its compute and the result's trip back; experts go to the host in order of fewest tokens first,
  since host time grows with tokens and a copy's does not.
- with a device cost (`DeviceCost`: in the simulator its `CostModel`, from the hardware preset), resident
  experts too go to the host, fewest tokens first, while that ends the layer sooner: the layer ends when
  both have finished, and where the device's fixed cost per expert matches the host's (Hopper's 30 us kernel
  tails against a server's 12 memory channels reading a 9 MiB Qwen3-30B-A3B expert) a device that computes
  every hit leaves the host idle; where a device expert costs far less than a host one hardly anything moves
  (decision "hybrid balance", `benchmarks/DECISIONS.md`).
So decode (one token per expert) mostly computes misses on the host and prefill (many tokens per expert)
mostly copies; the cost model decides.
Fiddler's rule (efeslab/fiddler, `src/fiddler/mixtral.py`) is the miss rule with fixed latencies (7 ms per
token on the CPU against 70 ms per copy).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .cache import Key

# Priority of the background copy of an expert the host computed (`Policy.host_fill`): behind every prefetch
# a policy asks for, so a prediction always goes first.
FILL_PRIORITY = -math.inf


class HostCost:
    """Seconds of host work, as the planner needs them. Subclasses give `overhead_s` and `expert_s`; one
    that learns from the host calls the engine measures overrides `record`."""

    def overhead_s(self, tokens: int) -> float:
        """Once per layer with host work: the call's fixed cost and the `tokens` activations to the host."""
        raise NotImplementedError

    def expert_s(self, tokens: int) -> float:
        """One expert computed for `tokens` of the layer's tokens, its output's trip back included."""
        raise NotImplementedError

    def record(self, expert_tokens: Sequence[int], seconds: float) -> None:
        """One host call that computed experts with `expert_tokens` tokens each took `seconds`."""


class DeviceCost(Protocol):
    """Seconds of device work, as the balancing planner needs them."""

    def expert_s(self, tokens: int) -> float:
        """One resident expert computed on the device for `tokens` of the layer's tokens."""


class Cache(Protocol):
    """What the planner reads of one device's expert cache (`DeviceExpertCache`)."""

    def entry(self, key: Key) -> Any: ...

    def copy_eta(self, key: Key, ahead: int = 0) -> float: ...


class HybridPlanner:
    """Splits a layer's needed experts between the device and the host (see the module docstring).

    Args:
      cost: the host's cost (`ModelledHostCost` in the simulator, `MeasuredHostCost` live).
      device: the device's cost per expert (`CostModel` in the simulator); None: resident experts stay on
        the device.
    """

    def __init__(self, cost: HostCost, device: DeviceCost | None = None):
        self.cost = cost
        self.device = device

    def split(
        self, parts: Sequence[tuple[Cache, list[Key]]], tokens: Mapping[int, int], valid: int
    ) -> list[Key]:
        """The experts the host computes.

        Args:
          parts: each device's cache with its share of the layer's needed experts (`cache.parts(keys)`).
          tokens: expert id -> assignments of valid tokens to it in this layer.
          valid: the layer's valid tokens (what the host receives if it computes anything).
        """
        on_host: list[Key] = []
        host_done = self.cost.overhead_s(valid)  # seconds from now, once the host has work
        kept: list[tuple[list[Key], dict[Key, float]]] = []  # each device's resident experts, copy landings
        for cache, keys in parts:
            resident = [k for k in keys if _entry_state(cache.entry(k)) == "ready"]
            absent = [k for k in keys if _entry_state(cache.entry(k)) != "ready"]
            lands: dict[Key, float] = {}
            ahead = 0  # on-demand loads already planned on this device's link
            for key in sorted(absent, key=lambda k: (tokens[k[1]], k)):
                arriving = cache.entry(key) is not None
                land = cache.copy_eta(key, ahead)
                done = host_done + self.cost.expert_s(tokens[key[1]])
                if done < land:
                    on_host.append(key)
                    host_done = done
                else:
                    lands[key] = land
                    if not arriving:
                        ahead += 1
            kept.append((resident, lands))
        if self.device is not None:
            for resident, lands in kept:
                host_done = self._balance(resident, lands, tokens, on_host, host_done)
        return on_host

    def _balance(
        self,
        resident: list[Key],
        lands: dict[Key, float],
        tokens: Mapping[int, int],
        on_host: list[Key],
        host_done: float,
    ) -> float:
        """Moves one device's resident experts to the host (appended to `on_host`), fewest tokens first, while
        that ends the layer sooner; returns when the host is done. The device is taken to compute its
        resident experts while its copies land, then the copied ones."""
        device_s = self.device.expert_s
        host_end = host_done if on_host else 0.0  # `host_done` counts the call's overhead even without work
        resident_s = sum(device_s(tokens[k[1]]) for k in resident)
        copied_s = sum(device_s(tokens[k[1]]) for k in lands)
        last_land = max(lands.values(), default=0.0)
        for key in sorted(resident, key=lambda k: (tokens[k[1]], k)):
            moved_host = host_done + self.cost.expert_s(tokens[key[1]])
            moved_resident = resident_s - device_s(tokens[key[1]])
            now = max(host_end, max(resident_s, last_land) + copied_s)
            if max(moved_host, max(moved_resident, last_land) + copied_s) >= now:
                break
            on_host.append(key)
            host_done = host_end = moved_host
            resident_s = moved_resident
        return host_done


def _entry_state(entry: Any) -> str:
    if entry is None:
        return "absent"
    return "ready" if entry.ready else "arriving"


# -- host cost -----------------------------------------------------------------------------------------------
class ModelledHostCost(HostCost):
    """The host's cost from a model preset and a host preset (the simulator's `HostCost`).

    Per layer with host work: the call latency, a transfer latency each way, and the activations
    `[tokens, D]` over the link to the host. Per expert with t tokens: reading its weights at the host's
    memory bandwidth or doing its 2 * 3 * D * F FLOPs per token (whichever is longer), plus its float32
    outputs `[t, D]` back over the link (the engine returns each assignment's output, as `expert_parts` lays
    them out). The activations' transfers are small and are not queued on the link's copies.

    Args:
      model: a `ModelPreset` (sizes).
      host: a `HostPreset`.
      link_bytes_per_s: the link's effective bandwidth (`HardwarePreset.link_effective`).
    """

    def __init__(self, model: Any, host: Any, link_bytes_per_s: float):
        self.model, self.host, self.link = model, host, link_bytes_per_s

    def overhead_s(self, tokens: int) -> float:
        to_host = tokens * self.model.hidden_size * self.model.bytes_per_param
        return self.host.call_latency_s + 2 * self.host.transfer_latency_s + to_host / self.link

    def expert_s(self, tokens: int) -> float:
        m = self.model
        compute = self.host.roofline_s(m.expert_bytes, 2.0 * m.expert_params * tokens)
        return compute + tokens * m.hidden_size * 4 / self.link

    def call_s(self, tokens: int, expert_tokens: Sequence[int]) -> float:
        """Seconds of one layer's host call computing experts with `expert_tokens` tokens each."""
        return self.overhead_s(tokens) + sum(self.expert_s(t) for t in expert_tokens)


class MeasuredHostCost(HostCost):
    """The host's cost as measured online (the live engine's `HostCost`): per expert, an exponential average
    of the seconds a host call took divided by its experts, kept per power-of-two bucket of tokens per expert.
    A bucket not measured yet borrows the nearest measured smaller one, scaled linearly in tokens above it
    (compute-bound growth), or a larger one as is; with nothing measured the host costs 0, so the first
    misses go to the host and are measured.

    Args:
      decay: weight of the previous average at each measurement.
    """

    def __init__(self, decay: float = 0.8):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.per_expert: dict[int, float] = {}  # bucket (tokens rounded up to a power of two) -> seconds
        self.calls = 0
        self.seconds = 0.0

    @staticmethod
    def bucket(tokens: int) -> int:
        return 1 << max(0, int(tokens) - 1).bit_length()

    def overhead_s(self, tokens: int) -> float:
        return 0.0  # inside the measured per-expert times

    def expert_s(self, tokens: int) -> float:
        if not self.per_expert:
            return 0.0
        b = self.bucket(tokens)
        if b in self.per_expert:
            return self.per_expert[b]
        below = [k for k in self.per_expert if k < b]
        if below:
            k = max(below)
            return self.per_expert[k] * tokens / k
        return self.per_expert[min(self.per_expert)]

    def record(self, expert_tokens: Sequence[int], seconds: float) -> None:
        """One host call that computed experts with `expert_tokens` tokens each took `seconds`."""
        self.calls += 1
        self.seconds += seconds
        if not expert_tokens:
            return
        b = self.bucket(max(expert_tokens))
        each = seconds / len(expert_tokens)
        old = self.per_expert.get(b)
        self.per_expert[b] = each if old is None else self.decay * old + (1 - self.decay) * each


@dataclasses.dataclass
class FixedHostCost(HostCost):
    """A host cost given outright: `per_expert_s` per expert per token (tests, and what-if studies)."""

    per_expert_s: float = 0.0
    call_overhead_s: float = 0.0

    def overhead_s(self, tokens: int) -> float:
        return self.call_overhead_s

    def expert_s(self, tokens: int) -> float:
        return self.per_expert_s * max(1, tokens)
