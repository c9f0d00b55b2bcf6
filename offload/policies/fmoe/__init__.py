"""fMoE: fine-grained expert offloading guided by expert maps (paper section 4, `seeds/000_*`).

One file per concern: `policy.py` (the events and the wiring: `FMoE`), `parts.py` (the parts that learn from
outcomes, built at bind, and what a saved store keeps of them), `options.py` (`FMoEOptions`),
`matcher.py` (threaded, inline or simulator-clocked), `followers.py` (what the store learns from each
iteration), `budget.py` (pay for matching), `skips.py` (searches left out where a match holds), `guides.py`
(selection, calibrated need, the next-token guess), `admission.py` (which guided experts are prefetched),
`eviction.py` (keep scores, popularity, the reuse predictor's hint), `forecast.py` (calibration and the reuse
forecast), `select.py` (the paper's selection and priorities), `store.py` and `store_file.py` (the
expert-map store and its files), `prefix_dots.py` (an iteration's running trajectory searches).
"""

from .eviction import auto_reuse_horizon
from .options import STORE_CAPACITY, FMoEOptions
from .policy import HINT_NEIGHBOURS, FMoE
from .prefix_dots import PrefixDots
from .store import ExpertMapStore
from .store_file import store_from_traces

__all__ = [
    "HINT_NEIGHBOURS",
    "STORE_CAPACITY",
    "ExpertMapStore",
    "FMoE",
    "FMoEOptions",
    "PrefixDots",
    "auto_reuse_horizon",
    "store_from_traces",
]
