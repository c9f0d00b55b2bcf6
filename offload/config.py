"""`OffloadConfig`: how a model is served with its routed experts in host memory.

Passed to `fmoe_jax.load_model(path, offload=OffloadConfig(...))`; read by the engine, the expert cache
and the policy factory.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from fmoe_jax.models.quant import expert_quantization

# `OffloadConfig.transfer`: how copies go over the link (`offload/transfer.py`).
TRANSFERS = ("direct", "thread", "chunked", "synchronous")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Settings of expert offloading.

    Attributes:
      policy: a policy name (`resident`, `on_demand_lru`, `on_demand_lfu`, `fmoe`, and the baselines of
        `fmoe_jax.offload.policies.POLICIES`) or a `Policy` object.
      cache_experts: device expert-cache budget in experts (slots).
      cache_bytes: the budget in bytes instead; the cache holds `cache_bytes // bytes_per_expert` experts.
        With neither, the cache holds 25 % of all routed experts.
      prefetch_distance: d, how many layers ahead a policy prefetches.
      store_capacity, store_path: deprecated aliases of `policy_options={"store_capacity": ...,
        "store_path": ...}` (fmoe's expert-map store); given here, they reach policies that take them.
      devices: devices for expert-parallel serving: None (the default device), a count (the first n), a list
        of devices, or a `jax.sharding.Mesh`. Dense weights are replicated over them; each device has its
        own expert cache (the budget is split evenly) and transfer queue.
      placement: which device holds expert `(layer, expert)`: None (round robin), a mapping, or a callable.
      max_inflight: host-to-device copies in flight at once.
      transfer: how copies go over the link (`offload/transfer.py`): "direct" (each copy one
        `jax.device_put` issued at once; the runtime orders them), "thread" (whole copies issued from a
        transfer thread, on-demand loads first; decision "transfer thread"), "chunked" (that thread sends
        an expert one array at a time, on-demand loads first: a miss waits behind at most one matrix of a
        prefetch, and a prefetch no longer wanted is stopped between matrices), or "synchronous" (direct
        copies, each waited for as it is issued: the simulator's comparison mode).
      synchronous_transfers, chunked_copies, transfer_thread: deprecated (one release) aliases of
        `transfer="synchronous"`, `"chunked"` and `"thread"`; True maps onto `transfer`, synchronous first.
      preload: warm start: fill the cache before serving, layer by layer in expert order, up to its
        budget. These loads count in no request's statistics (a warm cache, as after earlier requests).
      policy_options: keyword arguments of the policy: every setting a policy has (fmoe's store, ablation
        switches, a baseline's predictor...), as its constructor documents them.
      execution: "copy" (every expert runs on the device; a miss waits for its copy) or "hybrid" (a miss
        the host CPU would finish sooner than its copy would land runs on the host, from its host copy,
        concurrently with the device's experts; `offload/hybrid.py`). Any policy runs with either.
      host_threads: hybrid execution: threads of the host's expert programs. None: XLA:CPU's own pool (every
        core the process may use); 1: single-threaded programs; n > 1: the host's experts of a layer split
        over n single-threaded programs that run concurrently.
      expert_quantization: None, "int8" or "int4": routed experts held quantized in host memory, copied
        quantized and dequantized inside the expert kernel (`fmoe_jax.models.quant`); a budget in bytes
        then holds about 2x (int8) or 4x (int4) the experts. A checkpoint converted with
        `--expert-quantization` already holds them so; a float one is quantized while loading.
      quantization_group_size: inputs sharing one scale (default 64, or the quantized checkpoint's).
    """

    policy: Any = "on_demand_lru"
    cache_experts: int | None = None
    cache_bytes: int | None = None
    prefetch_distance: int = 3
    store_capacity: int | None = None
    store_path: str | None = None
    devices: Any = None
    placement: Any = None
    max_inflight: int = 4
    transfer: str = "direct"
    synchronous_transfers: bool | None = None
    chunked_copies: bool | None = None
    transfer_thread: bool | None = None
    preload: bool = False
    policy_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    execution: str = "copy"
    host_threads: int | None = None
    expert_quantization: str | None = None
    quantization_group_size: int | None = None

    def __post_init__(self) -> None:
        self._resolve_transfer()
        if self.execution not in ("copy", "hybrid"):
            raise ValueError(f"execution must be 'copy' or 'hybrid', got {self.execution!r}")
        if self.host_threads is not None and (
            not isinstance(self.host_threads, int)
            or isinstance(self.host_threads, bool)
            or self.host_threads < 1
        ):
            raise ValueError(f"host_threads must be None or a positive int, got {self.host_threads!r}")
        # raises, naming the values
        expert_quantization(self.expert_quantization, self.quantization_group_size)
        if self.cache_experts is not None and self.cache_bytes is not None:
            raise ValueError("give cache_experts or cache_bytes, not both")
        if self.cache_experts is not None and self.cache_experts < 1:
            raise ValueError(f"cache_experts must be at least 1 expert slot, got {self.cache_experts}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be positive, got {self.cache_bytes}")
        if self.prefetch_distance < 1:
            raise ValueError(f"prefetch_distance must be >= 1, got {self.prefetch_distance}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.store_capacity is not None and self.store_capacity < 1:
            raise ValueError(f"store_capacity must be >= 1, got {self.store_capacity}")
        if self.store_capacity is not None or self.store_path is not None:
            warnings.warn(
                "OffloadConfig(store_capacity=..., store_path=...) are deprecated: pass them in "
                "policy_options={'store_capacity': ..., 'store_path': ...}",
                DeprecationWarning,
                stacklevel=3,
            )

    def _resolve_transfer(self) -> None:
        """Maps the deprecated transfer booleans onto `transfer`, warning, and checks the result."""
        aliases = {
            "synchronous_transfers": "synchronous",
            "chunked_copies": "chunked",
            "transfer_thread": "thread",
        }
        given = [name for name in aliases if getattr(self, name) is not None]
        if given:
            instead = ", ".join(f"{name}=True: transfer={aliases[name]!r}" for name in given)
            warnings.warn(
                f"OffloadConfig's {', '.join(given)} are deprecated; pass `transfer` instead ({instead})",
                DeprecationWarning,
                stacklevel=4,
            )
        chosen = next((aliases[name] for name in aliases if getattr(self, name)), None)
        if chosen is not None:
            if self.transfer not in ("direct", chosen):
                raise ValueError(
                    f"transfer={self.transfer!r} contradicts the deprecated alias for {chosen!r}: give one"
                )
            object.__setattr__(self, "transfer", chosen)
        if self.transfer not in TRANSFERS:
            raise ValueError(
                f"transfer must be one of {', '.join(map(repr, TRANSFERS))}, got {self.transfer!r}"
            )

    def make_policy(self) -> Any:
        """The policy object: `policy` itself, or the named policy built with `policy_options` (plus the
        deprecated store aliases, for a policy that takes them)."""
        from .policies import POLICIES, accepted_options, make_policy

        options = dict(self.policy_options)
        if isinstance(self.policy, str) and self.policy in POLICIES:
            accepted = accepted_options(self.policy)
            for name in ("store_capacity", "store_path"):
                value = getattr(self, name)
                if value is not None and name in accepted:
                    options.setdefault(name, value)
        return make_policy(self.policy, **options)

    def slots(self, expert_bytes: int, total_experts: int) -> int:
        """The budget in expert slots for experts of `expert_bytes` each."""
        if self.cache_experts is not None:
            return min(self.cache_experts, total_experts)
        if self.cache_bytes is not None:
            slots = self.cache_bytes // expert_bytes
            if slots < 1:
                raise ValueError(
                    f"cache_bytes={self.cache_bytes} is below the size of one expert ({expert_bytes} bytes); "
                    "the cache needs at least one expert slot"
                )
            return min(slots, total_experts)
        return max(1, total_experts // 4)
