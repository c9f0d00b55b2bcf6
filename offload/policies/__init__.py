"""Offloading policies by name; `make_policy` builds the one `OffloadConfig(policy=...)` names."""

from __future__ import annotations

from typing import Any

from .base import Policy, PolicyContext
from .duoserve import DuoServe
from .fiddler import Fiddler
from .fmoe import FMoE, FMoEOptions, store_from_traces
from .mixtral_offload import MixtralOffload
from .moe_infinity import MoEInfinity
from .on_demand import OnDemandLFU, OnDemandLRU, Resident
from .oracle import Oracle
from .promoe import ProMoE
from .static_split import StaticSplit

POLICIES: dict[str, type[Policy]] = {
    "resident": Resident,
    "on_demand_lru": OnDemandLRU,
    "on_demand_lfu": OnDemandLFU,
    "fmoe": FMoE,
    "mixtral_offload": MixtralOffload,
    "moe_infinity": MoEInfinity,
    "promoe": ProMoE,
    "duoserve": DuoServe,
    "oracle": Oracle,
    "fiddler": Fiddler,
    "static_split": StaticSplit,
}


def required_options(name: str) -> list[str]:
    """The options a named policy cannot start without (`Policy.required_options`)."""
    return POLICIES[name].required_options()


def accepted_options(name: str) -> set[str]:
    """The keyword options a named policy takes (`Policy.accepted_options`)."""
    return POLICIES[name].accepted_options()


def make_policy(policy: str | Policy, **options: Any) -> Policy:
    """A policy object from a name (with options) or the object itself."""
    if isinstance(policy, Policy):
        if options:
            raise ValueError(
                f"policy_options {sorted(options)} were given with a policy object; pass them to "
                f"its constructor instead"
            )
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown offload policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    unknown = sorted(set(options) - accepted_options(policy))
    if unknown:
        raise ValueError(
            f"policy {policy!r} takes no option(s) {unknown}; it takes {sorted(accepted_options(policy))}"
        )
    return POLICIES[policy](**options)


__all__ = [
    "POLICIES",
    "FMoE",
    "FMoEOptions",
    "Fiddler",
    "OnDemandLFU",
    "OnDemandLRU",
    "Policy",
    "PolicyContext",
    "Resident",
    "StaticSplit",
    "make_policy",
    "store_from_traces",
]
