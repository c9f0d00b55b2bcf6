"""fMoE's options: one frozen dataclass, checked when it is made. `FMoE(**options)` and
`OffloadConfig(policy="fmoe", policy_options={...})` build it; each part of the policy reads its own fields.

The measurements behind each default are rows of the decision log, `benchmarks/DECISIONS.md`, named here
as "decision <row>".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import numpy as np

from .store import CAPACITY

# Expert maps a store keeps unless told otherwise (`store_capacity`); the experiments' default too
# (benchmarks/harness.py). Decision "store capacity".
STORE_CAPACITY = CAPACITY

_EVICTIONS = ("reuse", "fmoe", "lfu", "lru")


@dataclasses.dataclass(frozen=True, eq=False)
class FMoEOptions:
    """The fMoE policy's settings, with the paper's ablation switches.

    Attributes:
      semantic: semantic (embedding) search guides layers [0, d) at the iteration start (see
        `decode_semantic` for decode iterations).
      decode_semantic: also search at the start of a decode iteration whose layers [0, d) the last
        iteration's next-token guess already guided (the paper searches at every iteration); off: there
        the guess stands, and the search runs only where no guess was made (prefill, hybrid execution, no
        fresh hint, a guess the credit did not pay). Decision "semantic search at decode".
      trajectory: trajectory search after each layer guides the layers d ahead.
      dynamic_delta: similarity-aware selection (delta = 1 - score); off: exactly top-k per layer.
      eviction: "reuse" (keep the experts most likely needed soon: later in this iteration, by calibrated
        map probability, or in the next `reuse_horizon` iterations, by the reuse forecast), "fmoe" (the
        paper's rule: keep the highest p * freq), "lfu", or "lru". Decision "eviction rule".
      calibrate: turn matched-map probabilities into need probabilities learned online (`Calibration`)
        before admission, priority and eviction use them; off: the raw map probability (the paper).
        Decision "calibrated need".
      reuse_horizon: iterations ahead the reuse forecast looks (eviction "reuse"), or "auto": from the
        cache's size at `bind` (`auto_reuse_horizon`, 2 to 4; decision "reuse horizon").
      sticky: the reuse forecast also bins each expert's long-run share of the request's iterations (a
        request keeps coming back to its own experts), beside the recent share and the gap since last use.
        Decision "sticky experts".
      reuse_predictor: a learned `Predictor` of kind "reuse" (or its path): from each MoE layer's router
        input, the chance each expert is used in the next iterations; it replaces the store's reuse hint
        (eviction "reuse" only; the engine then passes router inputs, `needs_hidden`). Paid for like a
        search (`pay_for_matching`). `FMoE.from_traces(reuse_predictor="train")` trains one at `bind`.
        Decision "reuse predictor".
      offline_followers: `FMoE.from_traces` links each recorded map to the maps that followed it in its
        request (`store_from_traces(followers=...)`), as the store learns online: the reuse hint knows what
        follows from the first request on. Decision "offline followers".
      learned_reuse: `FMoE.from_traces` fits logistic models of reuse within the horizon on the traces
        (finer gap, windows of recent uses, position, popularity; `next_use.py`) and the reuse forecast
        scores by them instead of its online tables (eviction "reuse" only; no traces: the tables).
        Decision "learned reuse".
      reuse_distance: eviction "reuse" evicts the resident expert whose next use is expected furthest
        ahead in layer steps (its chance of use at its layer's next routing, from a table of the request's
        history of it fit on `from_traces`' traces and learned online, with the guides' need); admission
        prices prefetches as before (`distance.py`). Decision "next-use distance".
      token_contexts: the reuse hint also reads what followed the last tokens each row fed, where the engine
        or trace gives them (`TokenContexts`: an n-gram model of the experts used within the horizon, learned
        from `from_traces`' traces and online; eviction "reuse" without a reuse predictor). Decision "token
        contexts".
      popularity: `[L, J]` tokens routed to each expert in earlier requests; eviction "reuse" also keeps an
        expert for its share of every token's routing. None (the default): the policy counts the tokens it
        serves (from the counts saved with a loaded store) and saves them with the store. False: no prior.
        Decision "popularity prior".
      traj_target: "band" guides every layer from l + d on after layer l (as the authors' code);
        "single" guides layer l + d only (as the paper's text). Decision "band targets".
      asynchronous: match on a thread of its own (the paper's publisher/subscriber); off: inline and
        deterministic (tests, and the simulator).
      learn: add every iteration's expert maps to the store (online mode); off: the store is fixed.
      store: a prebuilt `ExpertMapStore` to start from (else empty, or loaded from `store_path`).
      store_capacity: expert maps the store keeps (a new or loaded store; a prebuilt one keeps its own).
        Decision "store capacity".
      store_path: file of a saved store: loaded at start when it exists (a store of another model is
        refused), saved back at `close()`; checked writable at start.
      queue_size: contexts waiting for the matcher at most; the oldest is dropped beyond that.
      admission: which selected experts are prefetched: "cost" (those whose need probability pays for
        their link time, `Admission`), "all" (every one, as the paper), or a number (p >= it).
      copy_s, layer_s: the link time of one expert and the compute of one decode layer, in seconds, for
        "cost". Default: the context's hints (the simulator's), else measured as the engine runs.
      link: how "cost" admission prices a copy: "free" (as if the link were free when asked), "queue"
        (after the copies and misses queued ahead) or "stalls" (lands in time and pays for the misses its
        pieces delay). Decision "admission link rule".
      price_stops: where the engine stops at a layer that misses (`CacheView.stop_s`), a miss also costs its
        share of the relaunch in "cost" admission, and the credit of `pay_for_matching` banks the stops
        prediction removes, measured (paid iterations against rested ones, `StopSavings`). No effect where
        the engine reports no stop. Off by default: on the validation requests of gpt-oss-20b's routing it
        gained nothing live (the measured credit mostly rested), and on a small model it costs host time.
        Decision "relaunch price".
      skip_confirmed: in decode, skip the trajectory search after a layer whose routing the last match
        foresaw exactly, where such a confirmation is rare by chance (`CONFIRMATION_BITS`; band targets
        only). Decision "skip confirmed searches".
      pay_for_matching: search (and update the store, and live, keep the per-layer bookkeeping) only while the
        link time the work could save covers the host time it takes (`SearchBudget`). Decisions "pay for
        matching" and "pay for bookkeeping".
      next_token: in decode, guess the next token's first d layers, which no search of that token guides,
        from the reuse hint (eviction "reuse", copy-only execution). Decision "next-token guess".
      resting: which searches rest after repeated matches: "settle" (every later one of the iteration
        after its first repeat) or "doubling" (after n repeats in a row, the next 2 ** (n - 1) layers').
        Decision "resting".
    """

    semantic: bool = True
    decode_semantic: bool = False
    trajectory: bool = True
    dynamic_delta: bool = True
    eviction: Literal["reuse", "fmoe", "lfu", "lru"] = "reuse"
    calibrate: bool = True
    reuse_horizon: int | Literal["auto"] = "auto"
    sticky: bool = False
    reuse_predictor: Any = None  # a `Predictor`, or the path of one
    offline_followers: bool = False
    learned_reuse: bool = False
    reuse_distance: bool = False
    token_contexts: bool = True
    popularity: Any = None  # [L, J] counts, None, or False
    traj_target: Literal["band", "single"] = "band"
    asynchronous: bool = True
    learn: bool = True
    store: Any = None  # an `ExpertMapStore`
    store_capacity: int = STORE_CAPACITY
    store_path: str | os.PathLike | None = None
    queue_size: int = 64
    admission: Literal["cost", "all"] | float = "cost"
    copy_s: float | None = None
    layer_s: float | None = None
    link: Literal["stalls", "free", "queue"] = "free"
    price_stops: bool = False
    skip_confirmed: bool = True
    pay_for_matching: bool = True
    next_token: bool = True
    resting: Literal["settle", "doubling"] = "settle"

    def __post_init__(self) -> None:
        if self.eviction not in _EVICTIONS:
            raise ValueError(f"eviction must be 'reuse', 'fmoe', 'lfu' or 'lru', got {self.eviction!r}")
        admission = self.admission
        if not (admission in ("cost", "all") or isinstance(admission, (int, float))):
            raise ValueError(f"admission must be 'cost', 'all' or a probability, got {admission!r}")
        if self.link not in ("stalls", "free", "queue"):
            raise ValueError(f"link must be 'stalls', 'free' or 'queue', got {self.link!r}")
        if self.resting not in ("settle", "doubling"):
            raise ValueError(f"resting must be 'settle' or 'doubling', got {self.resting!r}")
        if self.traj_target not in ("band", "single"):
            raise ValueError(f"traj_target must be 'band' or 'single', got {self.traj_target!r}")
        if self.store_capacity < 1:
            raise ValueError(f"store_capacity must be >= 1, got {self.store_capacity}")
        horizon = self.reuse_horizon
        if horizon != "auto" and not (isinstance(horizon, int) and horizon >= 1):
            raise ValueError(f"reuse_horizon must be an int >= 1 or 'auto', got {horizon!r}")
        if self.reuse_predictor is not None and self.eviction != "reuse":
            raise ValueError(f"a reuse_predictor serves eviction 'reuse' only, not {self.eviction!r}")
        if self.learned_reuse and self.eviction != "reuse":
            raise ValueError(f"learned_reuse serves eviction 'reuse' only, not {self.eviction!r}")
        if self.reuse_distance and (self.eviction != "reuse" or self.learned_reuse):
            raise ValueError("reuse_distance serves eviction 'reuse' without learned_reuse only")
        if self.popularity is not None and self.popularity is not False:
            object.__setattr__(self, "popularity", np.asarray(self.popularity, np.float64))
        if self.store_path is not None:
            object.__setattr__(self, "store_path", os.fspath(self.store_path))

    @property
    def band(self) -> bool:
        """A trajectory search guides every later layer from l + d on (its match covers them all)."""
        return self.traj_target == "band"
