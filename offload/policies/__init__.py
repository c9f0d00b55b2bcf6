"""Offloading policies by name; `make_policy` builds the one `OffloadConfig(policy=...)` names."""

from __future__ import annotations

from typing import Any

from .base import Policy, PolicyContext
from .fmoe import FMoE, store_from_traces
from .on_demand import OnDemandLFU, OnDemandLRU, Resident

POLICIES: dict[str, type[Policy]] = {
    "resident": Resident,
    "on_demand_lru": OnDemandLRU,
    "on_demand_lfu": OnDemandLFU,
    "fmoe": FMoE,
}


def make_policy(policy: str | Policy, **options: Any) -> Policy:
    """A policy object from a name (with options) or the object itself."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown offload policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy](**options)


__all__ = [
    "POLICIES",
    "FMoE",
    "OnDemandLFU",
    "OnDemandLRU",
    "Policy",
    "PolicyContext",
    "Resident",
    "make_policy",
    "store_from_traces",
]
