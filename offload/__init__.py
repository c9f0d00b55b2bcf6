"""fmoe_jax.offload: expert offloading — the cache and its transfers, placement over devices, the policies
(fMoE and the baselines), fMoE's expert-map store, and the trace-replay simulator with its cost model."""

from typing import TYPE_CHECKING

from .cache import CacheBook, CacheStats, DeviceExpertCache
from .config import OffloadConfig
from .cost_model import (
    A100_SXM,
    H100_PCIE,
    H100_SXM,
    HARDWARE,
    MIXTRAL_8X7B,
    MODELS,
    PHI35_MOE,
    QWEN15_MOE_A27B,
    RTX_3090,
    CostModel,
    HardwarePreset,
    ModelPreset,
)
from .placement import CacheGroup, round_robin
from .policies import POLICIES, Policy, PolicyContext, make_policy, store_from_traces
from .policies.fmoe.store import ExpertMapStore
from .transfer import JaxMover

if TYPE_CHECKING:
    from .simulator import SimResult, SimulatedLink, simulate

# The simulator's names load on first use (PEP 562), so that `python -m fmoe_jax.offload.simulator` (the
# fmoe-sim command) does not find the module already imported by its package.
_SIMULATOR = ("SimResult", "SimulatedLink", "simulate")


def __getattr__(name: str):
    if name in _SIMULATOR:
        from . import simulator

        return getattr(simulator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "A100_SXM",
    "CacheBook",
    "CacheGroup",
    "CacheStats",
    "CostModel",
    "DeviceExpertCache",
    "ExpertMapStore",
    "H100_PCIE",
    "H100_SXM",
    "HARDWARE",
    "HardwarePreset",
    "JaxMover",
    "MIXTRAL_8X7B",
    "MODELS",
    "ModelPreset",
    "OffloadConfig",
    "PHI35_MOE",
    "POLICIES",
    "Policy",
    "PolicyContext",
    "QWEN15_MOE_A27B",
    "RTX_3090",
    "SimResult",
    "SimulatedLink",
    "make_policy",
    "round_robin",
    "simulate",
    "store_from_traces",
]
