"""fMoE: fine-grained expert offloading guided by expert maps (paper section 4, `seeds/000_*`)."""

from .policy import HINT_NEIGHBOURS, STORE_CAPACITY, FMoE, auto_reuse_horizon, store_from_traces
from .store import ExpertMapStore, PrefixDots

__all__ = [
    "HINT_NEIGHBOURS",
    "STORE_CAPACITY",
    "ExpertMapStore",
    "FMoE",
    "PrefixDots",
    "auto_reuse_horizon",
    "store_from_traces",
]
