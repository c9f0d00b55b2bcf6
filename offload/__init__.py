"""fmoe_jax.offload: expert offloading — the cache and its transfers, placement over devices, the policies
(fMoE and the baselines), fMoE's expert-map store, and the trace-replay simulator with its cost model."""

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
from .simulator import SimResult, SimulatedLink, simulate
from .transfer import JaxMover

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
