"""fMoE: fine-grained expert offloading guided by expert maps (paper section 4, `seeds/000_*`).

The engine publishes contexts; a matcher thread subscribes to them, searches the `ExpertMapStore`
(semantic search at iteration start for layers [0, d), trajectory search after each layer for the layers
d ahead, except after a layer the last match foresaw, `skip_confirmed`), picks experts by similarity-aware
selection, and queues prefetches by priority p / (l - l_now). A search that finds the maps the one before it
found selects nothing anew (`_repeats`), and after a repeat the iteration's later searches rest
(`_resting`). It searches only while the copy time its work could save covers the host time the work takes
(`pay_for_matching`).
The paper's eviction keeps the experts with the highest p * freq; ours by default ("reuse") keeps those most
likely needed soon (see `keep_score`). The engine never waits for matching.

Prefetch admission (ours, not in the paper): a selected expert is prefetched only when its need probability q
pays for the link time it takes. With `link="free"` (the default) that is q >= T / (T + min(T, W)), as if the
link were free when asked: a right copy saves its layer up to min(T, W) of waiting (W: the compute before
that layer), a wrong one holds the link for T. `link="queue"` prices the same after the copies and misses
queued ahead (`_after_queue`). `link="stalls"` prices the misses a prefetch delays: the link serves on-demand
loads first, between the pieces of a copy (`SimulatedLink`, `ChunkedJaxMover`), so a prefetch moves while
the device computes, and the piece under way when the next layer's misses come delays them (by r, the
piece's expected remainder). Per layer of decode the prefetch advances c + s (c: one layer's compute; s = m *
r, m the measured chance that a layer misses), of which a share f = s / (c + s) is taken from on-demand
loads; it is admitted when q >= f and it lands before its layer, (layer - now) * (c + s) >= T
(`_stall_share`). At Mixtral-8x7B sizes (T ~ 14 ms against c ~ 1 ms on an RTX 3090) every rule admits
little; at the Qwen models' (T ~ 0.7 ms, c ~ 0.23 ms) most selected experts pass.
"stalls" was the default from before the reuse forecast and its learned predictor (on the validation split,
3 models x 3 budgets x 2 GPUs, copy-only, it was then 1.7 % faster than each other rule in geometric mean).
Checked again with eviction by predicted reuse and the predictor trained for the forecast's horizon, "free" is
faster at 17 of those 18 points, 0.985x in geometric mean (worst 1.004x, Qwen1.5-MoE at 25 % on the H100),
and at all 6 points at Phi-3.5-MoE's sizes (0.969-0.991x); so it is the default now. Under hybrid execution
every selected expert goes (`threshold`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import queue
import statistics
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from ...cache import CacheView, Entry, Key
from ...events import IterationStart, LayerRouted, RequestStart
from ...predictors import Predictor
from ..base import Policy, PolicyContext
from ..fiddler import expert_usage
from .forecast import MAX_DISTANCE, Calibration, ReuseForecast
from .select import SortedMaps, keep_priority
from .store import CAPACITY, ExpertMapStore, PrefixDots

# Requests whose last tokens the matcher remembers for follower links (`FMoE._learn`).
_RECENT_REQUESTS = 1024
# `skip_confirmed` trusts a layer's routing as confirming a match only where a stored map's top k would match
# it by chance less than once in 2 ** this many (log2 C(J, k)): the Qwen and DeepSeek presets, not Mixtral's 2
# of 8 experts (4.8 bits) or Phi-3.5's 2 of 16 (6.9).
_CONFIRMATION_BITS = 10
# The reuse hint averages what followed this many of the stored maps most like the last token's, weighted by
# similarity (`ExpertMapStore.future_of`). One map's followers (the single best match) is a noisy forecast;
# on the validation split (3 models x 12.5 / 25 / 50 % x RTX 3090 / H100, simulated) 8 neighbours gave
# 0.990x the TPOT of 1 in geometric mean, 0.973-0.991x at each 25 % point, 0.98-1.01x elsewhere
# (2, 4 and 16 neighbours: 0.996x, 0.989x, 0.996x). On the evaluation prompts (experiment 4) it was 0.996x
# overall but 0.99-1.01x at 25 %: most of its gain there was at 50 %.
HINT_NEIGHBOURS = 8
# `reuse_horizon="auto"` looks ceil(slots per layer / top_k) + 1 iterations ahead, at most this many
# (`auto_reuse_horizon`).
MAX_AUTO_HORIZON = 4
# Expert maps a store keeps unless told otherwise (`store_capacity`); the experiments' default too
# (benchmarks/harness.py), and the store size at which experiment 7 times the matcher. Why 512 (it was
# 1,000): offload/expert_map_store.py's `CAPACITY`.
STORE_CAPACITY = CAPACITY
# `pay_for_matching` prices a context at the median host time of the last `_COST_SAMPLES` of its kind, once
# `_COST_WARMUP` are measured.
_COST_SAMPLES, _COST_WARMUP = 15, 5


@dataclasses.dataclass
class _Context:
    kind: Literal["semantic", "trajectory", "update"]
    layer: int = -1
    data: Any = None
    extra: Any = None
    iteration: int = 0  # the policy's iteration count when published (a late match updates no guide)
    request: int = 0  # the policy's request count when published
    rows: Any = None  # update: each token's batch row
    requests: Any = None  # update: each row's request id (`IterationStart.requests`), or None
    published: float = 0.0  # on the simulated clock (`PolicyContext.clock`), when the simulator times it


class FMoE(Policy):
    """The fMoE policy, with the paper's ablation switches.

    Args:
      semantic: semantic (embedding) search guides layers [0, d) at each iteration start.
      trajectory: trajectory search after each layer guides the layers d ahead.
      dynamic_delta: similarity-aware selection (delta = 1 - score); off: exactly top-k per layer.
      eviction: "reuse" (keep the experts most likely needed soon: later in this iteration, by calibrated
        map probability, or in the next `reuse_horizon` iterations, by `ReuseForecast`), "fmoe" (the
        paper's rule: keep the highest p * freq), "lfu", or "lru".
      calibrate: turn matched-map probabilities into need probabilities learned online (`Calibration`)
        before admission, priority and eviction use them; off: the raw map probability (the paper).
      reuse_horizon: iterations ahead the reuse forecast looks (eviction "reuse"), or "auto" (the default):
        from the cache's size at `bind` (`auto_reuse_horizon`: 2 to 4).
      reuse_predictor: a learned `Predictor` of kind "reuse" (or the path of one; `from_traces` trains it
        from traces with router inputs): from each MoE layer's router input of a token, the chance each
        expert is used in the `horizon` iterations after it (its meta's; one trained for another horizon
        than the forecast's still serves, the forecast learning what its hint is worth, but less well:
        `_train_reuse`). After every layer it replaces the store's hint in the
        reuse forecast (eviction "reuse" only) with the mean, in log-odds, of the predictions of every layer
        routed so far in the iteration (an early layer alone says little); the engine then passes router
        inputs to the policy (`needs_hidden`). Live, its host time per layer is paid from
        `pay_for_matching`'s credit like a search: where a copy costs less than a prediction it rests, and
        the engine stops copying router inputs out until the credit covers one again. On the validation
        split (3 models x 12.5 / 25 / 50 % x RTX 3090 / H100, simulated, trained on the store prompts) it
        gave 0.88-0.99x the TPOT of fmoe without it at all 18 points (the latest layer's prediction alone:
        0.90-1.001x).
      popularity: `[L, J]` tokens routed to each expert in earlier requests (`from_traces` counts them in the
        store traces, as Fiddler profiles); eviction "reuse" also keeps an expert for its share of every
        token's routing, a chance of reuse the request's own short history cannot see yet. None: the policy
        profiles the tokens it serves instead (from the counts saved with a loaded store, if any) and saves
        the counts with the store. False: no such prior. (A given profile is not extended with the served
        tokens: on the validation split of experiment 8 that was 4 % slower than the profile alone, while
        counting from nothing was 1-4 % faster than no prior.)
      traj_target: "band" guides every layer from l + d on after layer l (as the authors' code);
        "single" guides layer l + d only (as the paper's text). Measured in benchmarks/ablations.
      asynchronous: match on a thread of its own (the paper's publisher/subscriber); off: inline,
        deterministic (tests, and the simulator's comparison with the live engine).
      learn: add every iteration's expert maps to the store (online mode); off: the store is fixed
        (offline mode, e.g. built from traces with `store_from_traces`).
      store: a prebuilt `ExpertMapStore` to start from (else empty, or loaded from `store_path`).
      store_capacity: expert maps the store keeps (for a new or loaded store; a prebuilt one keeps its own).
      store_path: file of a saved store: loaded at start when it exists (a store of another model is
        refused), saved back at `close()`; checked writable at start.
      queue_size: contexts waiting for the matcher at most; the oldest is dropped beyond that.
      admission: which selected experts are prefetched: "cost" (p >= T / (T + min(T, W)), see the module
        docstring; under hybrid execution every selected expert, see `threshold`), "all" (every one, as the
        paper), or a number (p >= it).
      copy_s, layer_s: T and the compute of one decode layer for "cost", in seconds. Default: the
        context's hints (the simulator's cost model), else measured as the engine runs (on-demand waits
        per miss; time between layers less those waits). Until measured, every selected expert goes.
      link: how "cost" admission prices a copy (see the module docstring): "free" (as if the link were free
        when asked; the default), "queue" (after the copies and misses queued ahead), "stalls" (lands in time
        and q pays for the misses its pieces delay).
      skip_confirmed: in decode, skip the trajectory search after a layer whose routing the iteration's
        last match foresaw exactly (each row's best map has the routed experts as its top k there): that
        match's guides for the layers ahead stand (`traj_target="band"` only, and only where such a
        confirmation is rare by chance, `_CONFIRMATION_BITS`). On the validation split this left out
        45 % of the searches at fmoe-tiny-qwen-moe's and -qwen3-moe's routing at the same simulated TPOT
        (0.999x in geometric mean over 12 points, 0.97-1.04x each), and 61 % at fmoe-tiny-mixtral's,
        where it was 1-7 % slower at 5 of 6 points: its top 2 of 8 experts agree by chance too often to
        confirm a match.
      pay_for_matching: the matcher searches (and updates the store) only while the link time its work
        could save covers the host time it takes: each routed layer adds (experts it needs) x T x m to a
        credit, m the share of needed experts that would miss without prediction (the cache's misses and
        prefetched hits per access: the most prediction can save there), each search or
        update spends its measured host time (`PolicyContext.matcher_s`, else the matcher thread's CPU time
        per context), and work the credit cannot pay is left out (`stats()["unpaid_<kind>"]`). Where copies
        are nearly free (this CPU: ~0.02 ms an expert of the shipped models, against 0.5-2 ms a search)
        the matcher rests and fmoe serves from its cache and eviction. At the real sizes of experiment 7
        a layer's stake k x T x m is ~10 ms on Mixtral-8x7B and ~0.2-0.5 ms on the Qwen models on an H100,
        about what one search and selection takes there: it would thin the searches out there. The
        simulator passes its `matcher_s` (by default 0: nothing is left out, and every search's
        prefetches are requested at once; above 0, they come that long later, `_catch_up`). Live, while
        the credit covers no context the engine is not asked for the embeddings and router probabilities
        that only contexts use (`needs_semantic`, `needs_probs`, decided per iteration).
      next_token: in decode, guess the next token's first d layers, which no search of this token guides,
        from the reuse hint late in the iteration, and prefetch the guesses that pay while the link idles
        between tokens (`_guide_next`; eviction "reuse" only, which keeps the hint; copy-only execution).
      resting: which searches are left out after repeated matches (`_resting`): "settle" (after the first
        repeat, every later layer's of the iteration: the match has settled) or "doubling" (after n repeats
        in a row, the next 2 ** (n - 1) layers'; the rule before 2026-11-28). "settle" searched 2.6 times an
        iteration instead of 7.3 at Qwen1.5-MoE's shapes in `matcher_overhead` (host time 0.81x), at the
        same simulated TPOT on the validation split (0.7136x on-demand LRU's in geometric mean over 18
        points, against 0.7138x) and on synthetic 32-layer routing without embeddings (`external_routing`'s
        regimes, seed 2, H100: 0.982 / 1.021 / 1.001 / 0.848x LRU against 0.980 / 1.023 / 1.001 / 0.856x).
    """

    name = "fmoe"
    needs_semantic = True
    needs_probs = True
    # Hybrid execution: an expert the host computed is copied to the cache when the link is idle, never in
    # a prediction's way. On the validation split of experiment 8 (Mixtral-8x7B sizes, four systems, 12.5 /
    # 25 / 50 %) that was 17-47 % faster at 50 % (where the cache otherwise fills only by prefetch and fmoe
    # lost to on_demand_lru), 2-13 % faster at 25 %, and from 6 % faster to 1.5 % slower at 12.5 % (three
    # systems). With it fmoe+hybrid beat on_demand_lru+hybrid at all 12 points, by 11-32 %. Filling behind
    # every prefetch, as on_demand_lru does, was slower at 12.5 and 25 % on the RTX 3090 (up to 13 %): the
    # fills evicted experts that would have been hits.
    host_fill = "idle"

    def __init__(
        self,
        *,
        semantic: bool = True,
        trajectory: bool = True,
        dynamic_delta: bool = True,
        eviction: Literal["reuse", "fmoe", "lfu", "lru"] = "reuse",
        calibrate: bool = True,
        reuse_horizon: int | Literal["auto"] = "auto",
        reuse_predictor: Predictor | str | os.PathLike | None = None,
        popularity: Any = None,
        traj_target: Literal["band", "single"] = "band",
        asynchronous: bool = True,
        learn: bool = True,
        store: ExpertMapStore | None = None,
        store_capacity: int = STORE_CAPACITY,
        store_path: str | os.PathLike | None = None,
        queue_size: int = 64,
        admission: Literal["cost", "all"] | float = "cost",
        copy_s: float | None = None,
        layer_s: float | None = None,
        link: Literal["stalls", "free", "queue"] = "free",
        skip_confirmed: bool = True,
        pay_for_matching: bool = True,
        next_token: bool = True,
        resting: Literal["settle", "doubling"] = "settle",
    ):
        if eviction not in ("reuse", "fmoe", "lfu", "lru"):
            raise ValueError(f"eviction must be 'reuse', 'fmoe', 'lfu' or 'lru', got {eviction!r}")
        if not (admission in ("cost", "all") or isinstance(admission, (int, float))):
            raise ValueError(f"admission must be 'cost', 'all' or a probability, got {admission!r}")
        if link not in ("stalls", "free", "queue"):
            raise ValueError(f"link must be 'stalls', 'free' or 'queue', got {link!r}")
        if resting not in ("settle", "doubling"):
            raise ValueError(f"resting must be 'settle' or 'doubling', got {resting!r}")
        if traj_target not in ("band", "single"):
            raise ValueError(f"traj_target must be 'band' or 'single', got {traj_target!r}")
        if store_capacity < 1:
            raise ValueError(f"store_capacity must be >= 1, got {store_capacity}")
        if reuse_horizon != "auto" and not (isinstance(reuse_horizon, int) and reuse_horizon >= 1):
            raise ValueError(f"reuse_horizon must be an int >= 1 or 'auto', got {reuse_horizon!r}")
        self.semantic, self.trajectory, self.dynamic_delta = semantic, trajectory, dynamic_delta
        self.needs_semantic = semantic  # without semantic search, traces need no embeddings
        # Live, the engine copies embeddings and router probabilities out only for an iteration whose maps
        # a paid context may use (`_plan_recording`); in the simulator they always come.
        self.needs_probs = True
        self._recording = True  # this iteration's maps are kept (`_maps`) for searches and the update
        self.eviction, self.traj_target = eviction, traj_target
        self.calibrate = calibrate
        # "auto" is resolved at `bind`, where the cache's size is known; until then 2.
        self.reuse_horizon_option = reuse_horizon
        self.reuse_horizon = 2 if reuse_horizon == "auto" else reuse_horizon
        if reuse_predictor is not None and eviction != "reuse":
            raise ValueError(f"a reuse_predictor serves eviction 'reuse' only, not {eviction!r}")
        if reuse_predictor is not None and not isinstance(reuse_predictor, Predictor):
            reuse_predictor = Predictor.load(reuse_predictor)
        self.reuse_predictor = reuse_predictor
        self.needs_hidden = reuse_predictor is not None
        # `from_traces(reuse_predictor="train")`: the traces it trains on at `bind`, and what it has trained,
        # by horizon (a policy bound again beside a cache of another size trains again).
        self._reuse_traces: list | None = None
        self._trained_reuse: dict[int, Predictor] = {}
        if popularity is not None and popularity is not False:
            popularity = np.asarray(popularity, np.float64)
        self.popularity = popularity  # the given profile; `_counts` is what the policy has counted since
        self.calibration = Calibration()
        self.asynchronous, self.learn = asynchronous, learn
        self.store = store
        self.store_capacity = store_capacity
        self.store_path = None if store_path is None else os.fspath(store_path)
        self.queue_size = queue_size
        self.admission = admission
        self.copy_s, self.layer_s = copy_s, layer_s
        self.link = link
        self.skip_confirmed = skip_confirmed and traj_target == "band"
        # (iteration, [L][B][k] nested lists): each row's matched map's top k per layer, in ascending ids
        self._foreseen: tuple[int, list] | None = None
        self._matched: tuple[int, np.ndarray] | None = None  # (iteration, [B, L, J]): the last trajectory
        self._streak = 0  # trajectory matches in a row that found the same maps as the one before
        self._rest = (-1, -1)  # (iteration, layer): searches after layers up to it are left out (`_resting`)
        self.resting = resting
        self.pay_for_matching = pay_for_matching
        self.next_token = next_token
        # P(needed at the next token's layer j | the reuse hint's p, its layer, recency), for `_guide_next`.
        self.next_calibration = Calibration()
        self._next_guides: list = []  # (iteration, p, bins, admitted) [d, J]
        self._credit = 0.0  # link seconds the matcher may still spend (`pay_for_matching`; engine thread)
        # Host seconds per context of each kind: the context's hint, else the median of the last
        # `_COST_SAMPLES` measured, once `_COST_WARMUP` are (the first of each kind, cold, is not). An
        # exponential average from the first measured kept early contexts' times, up to 15x a warm one's:
        # they priced every later context of the kind out, and an unpaid context is never timed.
        self._matcher_s: dict[str, float | None] = {"semantic": None, "trajectory": None, "update": None}
        self._spent = {kind: collections.deque(maxlen=_COST_SAMPLES) for kind in self._matcher_s}
        self._timed = collections.Counter()  # contexts timed, by kind
        # The reuse predictor's host seconds per layer (engine thread), priced like a context: measured live,
        # free in the simulator (which charges no policy its event handlers' host time).
        self._predictor_s: float | None = None
        self._predictor_spent: collections.deque[float] = collections.deque(maxlen=_COST_SAMPLES)
        self._guess_s: float | None = None  # `_guide_next`'s host seconds (engine thread), priced alike
        self._guess_spent: collections.deque[float] = collections.deque(maxlen=_COST_SAMPLES)
        self._free_link = False  # hybrid execution (set by `bind`)
        self._clock: tuple[float, float, int] | None = None  # (time, on-demand wait, misses), last layer
        self.timers = {"matching": 0.0, "store_update": 0.0}
        self.counts = collections.Counter()
        self.scores: dict[str, list[float]] = {"semantic": [], "trajectory": []}
        self.last_error: str | None = None  # the latest context the matcher failed on, and why
        self._thread: threading.Thread | None = None
        # The engine thread only puts contexts here (a C-level queue: no Python lock for the engine thread to
        # take while the matcher holds the interpreter); the matcher drains it, drops and skips on its side.
        self._inbox: queue.SimpleQueue[_Context | None] = queue.SimpleQueue()
        self._published = 0  # contexts put in the inbox (engine thread)
        self._done = 0  # contexts the matcher has finished with: processed, skipped or dropped

    # -- lifecycle ---------------------------------------------------------------------------------------
    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> FMoE:
        """Offline mode: starts from an expert-map store built from recorded traces (`store_from_traces`) and
        their experts' popularity (`expert_usage`); with no traces, from an empty store of `store_capacity`
        maps and no popularity prior. `reuse_predictor="train"` trains the reuse predictor on the traces
        (they need router inputs: `record_hidden=True`) at `bind`, for the horizon the forecast will use
        (with `reuse_horizon="auto"` it depends on the cache's size); with no traces there is none."""
        train = options.get("reuse_predictor") == "train"
        if train:
            if options.get("eviction", "reuse") != "reuse":
                eviction = options["eviction"]
                raise ValueError(f"a reuse_predictor serves eviction 'reuse' only, not {eviction!r}")
            from ...predictor_training import require_fields

            require_fields((it for t in traces for r in t.requests for it in r.iterations), ("hidden",))
            options["reuse_predictor"] = None
        if traces:
            options["store"] = store_from_traces(
                traces, capacity=store_capacity, prefetch_distance=prefetch_distance
            )
            options.setdefault("popularity", expert_usage(traces))
        policy = cls(store_capacity=store_capacity, **options)
        if train and traces:
            policy._reuse_traces = list(traces)
            policy.needs_hidden = True
        return policy

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        self.copy_s = self.copy_s if self.copy_s is not None else ctx.copy_s
        self.layer_s = self.layer_s if self.layer_s is not None else ctx.layer_s
        # Hybrid execution: a miss is computed on the host rather than waiting for the link, so a wasted
        # prefetch only delays other prefetches, and "cost" admission lets every selected expert go.
        self._free_link = ctx.execution == "hybrid"
        if self.reuse_horizon_option == "auto":
            self.reuse_horizon = auto_reuse_horizon(ctx.capacity, ctx.num_layers, ctx.top_k)
        if self._reuse_traces is not None:
            self.reuse_predictor = self._train_reuse(self.reuse_horizon)
        self._skipping = self.skip_confirmed and math.log2(math.comb(ctx.num_experts, ctx.top_k)) >= (
            _CONFIRMATION_BITS
        )
        self._measure = (
            self.admission == "cost" and not self._free_link and (self.copy_s is None or self.layer_s is None)
        )
        if ctx.matcher_s is not None:
            self._matcher_s = dict.fromkeys(self._matcher_s, ctx.matcher_s)
        self.meta = {"model": ctx.model_id}
        if self.reuse_predictor is not None:
            self.reuse_predictor.check(
                kind="reuse",
                model_id=ctx.model_id,
                num_layers=ctx.num_layers,
                num_experts=ctx.num_experts,
                top_k=ctx.top_k,
                input_dim=ctx.embed_dim or None,
                source="fmoe's reuse predictor",
            )
        # Routing without embeddings (a trace from elsewhere, semantic=False) has width 0: the store then
        # keeps one zero column, which its redundancy rule ignores like any other zero embedding.
        self._embed_dim = ctx.embed_dim or 1
        path = self.store_path
        if path:  # refuse a location `close` could not save to now, not after serving
            ExpertMapStore.check_writable(path)
        if self.store is None and path and os.path.exists(path):
            self.store = ExpertMapStore.load(path, self._expected_meta(), capacity=self.store_capacity)
        if self.store is None:
            self.store = ExpertMapStore(
                capacity=self.store_capacity,
                num_layers=ctx.num_layers,
                num_experts=ctx.num_experts,
                embed_dim=self._embed_dim,
                prefetch_distance=min(ctx.prefetch_distance, ctx.num_layers),
            )
        if (self.store.num_layers, self.store.num_experts, self.store.embed_dim) != (
            ctx.num_layers,
            ctx.num_experts,
            self._embed_dim,
        ):
            raise ValueError(
                f"expert-map store has L={self.store.num_layers}, J={self.store.num_experts}, "
                f"H={self.store.embed_dim}; the model needs L={ctx.num_layers}, J={ctx.num_experts}, "
                f"H={self._embed_dim}"
            )
        shape = (ctx.num_layers, ctx.num_experts)
        # Tokens routed to each expert [L, J]: the given profile, or else what a loaded store saved plus every
        # token served (`_counting`); `_rate` is each expert's share of a token's routing (top_k per token),
        # None while nothing is counted (or with popularity=False).
        self._counts: np.ndarray | None = None
        self._counting = self.popularity is None
        if isinstance(self.popularity, np.ndarray):
            if self.popularity.shape != shape:
                raise ValueError(
                    f"fmoe's popularity profile is {self.popularity.shape} but the model has {shape} (MoE "
                    "layers, experts): profile requests of this model"
                )
            self._counts = self.popularity.copy()
        elif self.popularity is None:
            saved = self.store.attachments.get("popularity")
            self._counts = np.zeros(shape) if np.shape(saved) != shape else np.asarray(saved, np.float64)
        self._rate: np.ndarray | None = None
        self._update_rate()
        self.forecast = ReuseForecast(*shape, horizon=self.reuse_horizon)
        self.calibration.load(self.store.attachments)  # what an earlier run learned, saved with the store
        saved = self.store.attachments
        self.next_calibration.load({k[len("next_") :]: v for k, v in saved.items() if k.startswith("next_")})
        self.forecast.load(self.store.attachments)
        # The guides of the current iteration, per distance bin and expert [D, L, J] (D = `MAX_DISTANCE`: a
        # guide made 1, 2, 3 or 4+ layers ahead of its layer): the raw map probability and its calibration bin
        # (map probability, the match's similarity, distance in layers), and per [D, L] whether a match has
        # guided the layer from that far; the latest guide of each layer gives the need probability
        # (calibrated p, `_need` [L, J]) that admission, priority and eviction use, and its raw probability
        # (`_latest_p`). Written by the matcher (a search guides every expert of its target layers). When the
        # layer routes, the calibration learns from the latest guide of every distance: admission decides
        # 4+ layers ahead at Mixtral-8x7B's copy times, while with d = 3 the guide a layer has when it routes
        # is always the one made 3 layers before; learning from that one alone left the 4+ bins empty, and an
        # empty bin answers the raw map probability (up to 0.9 where 0.3 was right).
        depth = MAX_DISTANCE
        self._guide_p, self._guide_bin = np.zeros((depth, *shape)), np.zeros((depth, *shape), np.int64)
        self._guided = np.zeros((depth, ctx.num_layers), bool)
        self._latest_p = np.zeros(shape)
        self._latest = np.zeros(ctx.num_layers, bool)  # [L] whether any match has guided the layer
        self._need = np.zeros(shape)
        self._used = np.zeros(shape, bool)  # the experts this iteration has needed so far
        self._flat_index = {
            (layer, e): layer * shape[1] + e for layer in range(shape[0]) for e in range(shape[1])
        }
        self._current = -1  # the MoE layer that routed last in this iteration
        # The first layer after which no trajectory search guides a layer: `_guide_next` follows it.
        self._next_from = ctx.num_layers - min(ctx.prefetch_distance, ctx.num_layers)
        self._iteration = 0
        self._request = 0
        self._hint: np.ndarray | None = None  # [L, J] what the store says follows the last token
        self._hinted = -1  # the iteration the hint was made in (or at the end of)
        self._logits: np.ndarray | None = None  # reuse predictor: the sum of this iteration's log-odds
        self._predicted = 0  # reuse predictor: the layers whose predictions `_logits` sums
        # Matcher: each request's last slots in the store, by (request count, row), or by the request id the
        # engine gives (continuous batching); the least recently used go beyond `_RECENT_REQUESTS`.
        self._recent: collections.OrderedDict[tuple, collections.deque] = collections.OrderedDict()
        self._requests: tuple[int, ...] | None = None  # the current iteration's rows' requests
        self._prefix_dots = PrefixDots()  # matcher: an iteration's trajectory searches, layer after layer
        self._sorted = SortedMaps()  # matcher: the maps it matched lately, sorted for selection
        # The simulator's clocked matcher (`_catch_up`): contexts waiting, and when it is next free.
        self._clocked = not self.asynchronous and ctx.clock is not None and (ctx.matcher_s or 0.0) > 0
        self._backlog: collections.deque[_Context] = collections.deque()
        self._free_at = 0.0
        if self.asynchronous:
            self._thread = threading.Thread(target=self._run, name="fmoe-matcher", daemon=True)
            self._thread.start()

    def _train_reuse(self, horizon: int) -> Predictor:
        """The reuse predictor of `from_traces(reuse_predictor="train")` for `horizon`, trained once: for the
        horizon the forecast looks at, not a fixed 2: on the validation split (simulated, the points where
        "auto" looks 3 or 4 iterations ahead) that was 0.985-0.996x the TPOT at 25 % and 0.975-0.994x at 50 %
        on the Qwen models' routing, and 2.6 % less stall (the same median) at fmoe-tiny-mixtral's 50 % on the
        RTX 3090. On the evaluation prompts (experiment 4, the 22 points where the horizon is 3 or 4) it was
        0.986x in geometric mean, 0.93-1.02x: slower at Mixtral's 50 % points (1.02x) and Qwen3's 25 % (up to
        1.011x)."""
        if horizon not in self._trained_reuse:
            from ...predictor_training import train_reuse

            self._trained_reuse[horizon] = train_reuse(self._reuse_traces, horizon=horizon, progress=False)
        return self._trained_reuse[horizon]

    def _expected_meta(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "model": ctx.model_id,
            "num_layers": ctx.num_layers,
            "num_experts": ctx.num_experts,
            "embed_dim": self._embed_dim,
            "prefetch_distance": min(ctx.prefetch_distance, ctx.num_layers),
        }

    def _update_rate(self) -> None:
        if self._counts is None or not self._counts.any():
            return
        # Only the share above uniform routing (top_k / J) counts: an expert routed no more often than any
        # other says nothing about reuse. (Counting the whole share slowed Qwen3-sized experts: on the
        # validation split, copy-only at 50 %, 3.49 ms against 3.06 with the excess; over 36 validation
        # points the excess is 0.986x the whole share, geometric mean.)
        total = self._counts.sum(axis=1, keepdims=True)
        share = self.ctx.top_k * self._counts / np.maximum(total, 1.0)
        uniform = self.ctx.top_k / self.ctx.num_experts
        self._rate = np.clip((share - uniform) / (1.0 - uniform), 0.0, 1.0)
        self._unlikely = 1.0 - self._rate  # [L, J] eviction's "anytime" factor, once per iteration

    def close(self) -> None:
        """Stops the matcher (after the contexts it has) and saves the store when `store_path` is set."""
        if self._thread is not None:
            self._inbox.put(None)  # after the contexts already published
            self._thread.join()
            self._thread = None
        for context in self._backlog:  # the simulated matcher's unfinished work: what it learns is kept,
            if context.kind == "update":  # predictions made after the replay would prefetch for nothing
                self._process_or_drop(context)
        self._backlog.clear()
        if self.store_path and self.store is not None and hasattr(self, "ctx"):
            self.store.attachments = {**self.calibration.state(), **self.forecast.state()}
            self.store.attachments |= {f"next_{k}": v for k, v in self.next_calibration.state().items()}
            if self._counts is not None:
                self.store.attachments["popularity"] = self._counts
            self.store.save(self.store_path, self.meta)

    # -- events from the engine (engine thread: cheap, never waits for matching) -------------------------
    def on_request_start(self, event: RequestStart) -> None:
        self.forecast.start_request()
        self._request += 1
        self._hint = None
        self._need[:] = 0.0  # a guess of the last request's next token says nothing of this prompt
        self._next_guides = []

    def on_iteration_start(self, event: IterationStart) -> None:
        if self._clocked:
            self._catch_up()
        valid = event.valid
        rows, tokens = valid.shape
        self._valid = valid.reshape(-1)
        self._active = (None, None)  # (the valid mask, the rows it leaves active), for `on_layer_routed`
        self._last = (
            np.where(valid.any(1), tokens - 1, -1) + np.arange(rows) * tokens
        )  # each row's last token
        n_valid = int(self._valid.sum())
        self._recording = self.needs_probs
        if not self._recording:
            self.counts["unrecorded_iterations"] += 1
        if event.embeds is not None:
            self._embeds = event.embeds[self._valid]
        else:  # no semantic search: the store keeps zero embeddings (its redundancy rule uses maps alone)
            self._embeds = np.zeros((n_valid, self._embed_dim), np.float32)
        if self._recording:
            self._maps = np.zeros((rows * tokens, self.ctx.num_layers, self.ctx.num_experts), np.float32)
            self._token_rows = np.repeat(np.arange(rows), tokens)[self._valid]  # each valid token's row
        self._requests = event.requests
        self._clock = None
        self._decoding = tokens == 1
        self._iteration += 1
        self._guided[:] = False
        self._latest[:] = False
        self._used[:] = False
        self._current = -1  # (`_need` holds what `_guide_next` guessed of this iteration's first layers)
        self._predicted = 0
        self.forecast.begin_iteration(self._hint if self.eviction == "reuse" else None)
        if self.semantic and n_valid and self._affords("semantic", event.embeds is not None):
            self._publish(_Context("semantic", data=self._embeds, iteration=self._iteration))

    def on_layer_routed(self, event: LayerRouted) -> None:
        layer, valid = event.layer, event.valid
        if self._clocked:
            self._catch_up()
        if self._measure:
            self._measure_costs()
        needed = np.asarray(event.needed, np.int64)
        self._current = layer  # from now on no guide of this layer is written (`_select`)
        self._need[layer] = 0.0  # its next routing is the next iteration's: unknown until `_guide_next`
        self._used[layer, needed] = True
        if self._counting and len(event.ids) > 1:  # the popularity profile grows with every token served
            # (one token, decode at batch 1: its experts are `needed`, counted with the others' at the end)
            routed = np.asarray(event.ids)[event.token_valid].ravel()
            self._counts[layer] += np.bincount(routed, minlength=self.ctx.num_experts)
        self.forecast.mark_used(layer, needed)
        if event.probs is None:  # the engine skipped them: no search or update from this iteration
            self._recording = False
        elif self._recording:
            self._maps[:, layer] = event.probs
        if valid is not self._active[0]:  # the engine passes one mask for every layer of an iteration
            self._active = (valid, self._last[valid.any(1)])
        active = self._active[1]  # each active row's last token
        if self.reuse_predictor is not None and event.hidden is not None and self._paid_prediction():
            self._predict_reuse(event, active)
        if self.pay_for_matching and self.copy_s is not None:  # what this layer's misses could have cost
            cap = self.ctx.num_layers * self.ctx.top_k * self.copy_s  # a decode iteration's worth at most
            self._credit = min(self._credit + len(needed) * self.copy_s * self._at_stake(), cap)
        if self.reuse_predictor is not None:  # the engine copies the next router input only for a paid use
            cost = self._predictor_s
            self.needs_hidden = cost is None or not self._priced() or self._credit >= cost
            if not self.needs_hidden:  # the next layer's prediction is left out
                self.counts["unpaid_reuse"] += 1
        if layer + self.ctx.prefetch_distance >= self.ctx.num_layers:  # no search guides a layer from here
            if layer == self._next_from and self._loads_nothing(layer, needed) and self._guides_next():
                self._guide_next(self._hint)
            return
        if not self.trajectory:
            return
        if active.size and self._confirmed(layer, event.ids, active):
            self.counts["confirmed_layers"] += 1
            # What a search would drop: waiting requests for this layer and those before it.
            self.cache.request_prefetch((), replace=False, stale_before=layer + 1)
        elif active.size and self._resting(layer):
            self.counts["rested_layers"] += 1
            self.cache.request_prefetch((), replace=False, stale_before=layer + 1)
        elif active.size and self._affords("trajectory", self._recording):
            data = self._maps[active, : layer + 1]  # a copy (`active` indexes rows): the matcher's own
            self._publish(_Context("trajectory", layer=layer, data=data, iteration=self._iteration))

    def _resting(self, layer: int) -> bool:
        """Whether the search after `layer` is left out because the searches before it found the same maps
        (`_repeats`): with `resting="settle"`, every search after the iteration's first repeat; with
        "doubling", after n repeats in a row the next 2 ** (n - 1) layers' (their routing still counts: the
        next search sums it). Doubling halved the searches of a decode iteration at Qwen1.5-MoE's shapes in
        `matcher_overhead` (17.4 -> 8.3) at 0.996-1.020x the TPOT of searching after every layer on the
        validation split (simulated, matcher free); settle halves them again at the same TPOT (see
        `resting`)."""
        rest = self._rest
        return rest[0] == self._iteration and layer <= rest[1]

    def _priced(self) -> bool:
        return self.pay_for_matching and self.copy_s is not None

    def _paid_prediction(self) -> bool:
        """Whether the credit covers the reuse predictor's work at this layer (`pay_for_matching`, priced at
        its measured host time), which it then pays for; where copies cost less than the prediction (this
        CPU) it rests and the forecast goes on from the request's own routing."""
        return self._pay(self._predictor_s, "reuse")

    def _predict_reuse(self, event: LayerRouted, rows: np.ndarray) -> None:
        """The reuse hint from the learned predictor, after each layer: the chance each expert is used by
        any active row in the iterations after this one, from each row's last token's router input at the
        layers routed so far (their mean log-odds). It rescores this iteration's forecast and starts the
        next iteration's."""
        if not rows.size:
            return
        start = time.perf_counter()
        logits = self.reuse_predictor.logits(np.asarray(event.hidden)[rows], event.layer)  # [rows, L * J]
        if self._predicted and self._logits is not None and self._logits.shape == logits.shape:
            self._logits += logits
            self._predicted += 1
        else:  # the iteration's first prediction
            self._logits, self._predicted = logits, 1
        p = 0.5 * (np.tanh(0.5 / self._predicted * self._logits) + 1.0)  # the sigmoid of the mean
        # Used by any row. (One row: its own p, which bins as 1 - (1 - p) does: they differ below 1e-9.)
        hint = p[0].astype(np.float64) if len(p) == 1 else 1.0 - np.prod(1.0 - p.astype(np.float64), axis=0)
        self._hint = hint.reshape(self.ctx.num_layers, self.ctx.num_experts)
        self._hinted = self._iteration
        self.forecast.refresh(self._hint, self._used, self._current)
        self._predictor_s = self._engine_price(self._predictor_spent, start, self._predictor_s)

    def _engine_price(
        self, spent: collections.deque[float], start: float, price: float | None
    ) -> float | None:
        """The price of engine-thread work that began at `start` (perf_counter) and just ended: live, the
        median of the recent calls in `spent` once `_COST_WARMUP` are; in the simulator (which charges no
        policy its event handlers' host time) `price` unchanged."""
        if self.ctx.matcher_s is not None:
            return price
        spent.append(time.perf_counter() - start)
        return statistics.median(spent) if len(spent) >= _COST_WARMUP else price  # 0.4 us; np.median 14

    def _confirmed(self, layer: int, ids: np.ndarray, active: np.ndarray) -> bool:
        """Whether the iteration's last trajectory match foresaw this layer's routing: in decode, each active
        row's best map has the routed experts as its top k at `layer` (`skip_confirmed`). Read on the engine
        thread while the matcher may replace it: a stale read only costs a search or skips one."""
        foreseen = self._foreseen
        if not (self._skipping and self._decoding) or foreseen is None or foreseen[0] != self._iteration:
            return False
        expected = foreseen[1][layer]  # [B][k]
        if len(expected) != len(active):
            return False
        if len(active) == 1:  # decode at batch 1: a Python sort of k ids (an array sort costs ~5x more)
            return [sorted(np.asarray(ids)[active[0]].tolist())] == expected
        return np.sort(np.asarray(ids)[active], axis=1).tolist() == expected

    def _measure_costs(self) -> None:
        """Live estimates of T and of one layer's compute (exponential averages), from the cache's on-demand
        wait and miss count at consecutive layers of a decode step: between two `on_layer_routed` events
        the engine computed one layer and waited for that layer's misses."""
        now = (time.perf_counter(), self.cache.on_demand_wait_s, self.cache.stats.misses)
        if self._clock is not None and self._decoding:
            (t0, w0, m0), (t1, w1, m1) = self._clock, now
            elapsed, waited, misses = t1 - t0, w1 - w0, m1 - m0
            compute = max(elapsed - waited, 0.0)
            self.layer_s = compute if self.layer_s is None else 0.9 * self.layer_s + 0.1 * compute
            if misses > 0:
                per_copy = waited / misses
                self.copy_s = per_copy if self.copy_s is None else 0.9 * self.copy_s + 0.1 * per_copy
        self._clock = now

    def threshold(self, layer: int | np.ndarray, current: int) -> float | np.ndarray:
        """The probability a selected expert of `layer` (or of each of several layers) needs to be
        prefetched, deciding after `current`: the share of its link time taken from on-demand loads, or inf
        where it cannot land before its layer (`link="stalls"`); T / (T + min(T, W)) with the other rules.

        Under hybrid execution "cost" admits every selected expert: the rule's price of a wasted copy, the
        link time a later miss waits behind, does not arise when misses go to the host (at Mixtral-8x7B
        sizes on the RTX 3090 systems of experiment 8, prefetching every selected expert gave 1-14 % lower
        TPOT than the copy-only rule at every budget)."""
        if self.admission == "all" or (self.admission == "cost" and self._free_link):
            return np.zeros(np.shape(layer)) if np.ndim(layer) else 0.0
        if self.admission != "cost":
            return (
                np.full(np.shape(layer), float(self.admission)) if np.ndim(layer) else float(self.admission)
            )
        if self.copy_s is None or self.layer_s is None or self.copy_s <= 0:
            return np.zeros(np.shape(layer)) if np.ndim(layer) else 0.0  # nothing measured yet
        ahead = np.asarray(layer) - current  # layers of compute before it routes (a layer routed already:
        ahead = np.where(ahead > 0, ahead, ahead + self.ctx.num_layers)  # its routing at the next iteration)
        if self.link == "stalls":
            share, per_layer = self._stall_share()
            out = np.where(ahead * per_layer >= self.copy_s, share, np.inf)  # inf: cannot land in time
        else:
            window = ahead * self.layer_s
            out = self.copy_s / (self.copy_s + np.minimum(self.copy_s, window))
        return out if np.ndim(layer) else float(out)

    def _stall_share(self) -> tuple[float, float]:
        """(f, c + s): the share of a prefetch's link time taken from on-demand loads, and how far it
        advances per decode layer. The piece under way when a layer's misses come delays them by r =
        max(piece - c, piece / 2) (a piece longer than a layer's compute, started as it began, runs piece -
        c past it; a shorter one is caught on average halfway), in a share m of the layers, m = 1 - (1 -
        miss rate) ** top_k."""
        stats = self.cache.stats
        miss_rate = stats.misses / max(1, stats.hits + stats.misses)
        m = 1.0 - (1.0 - miss_rate) ** self.ctx.top_k
        piece = self.copy_s / max(1, self.ctx.copy_chunks)
        stalls = m * max(piece - self.layer_s, piece / 2)
        per_layer = self.layer_s + stalls
        return stalls / per_layer, per_layer

    def on_iteration_end(self) -> None:
        self._observe_guides()
        self.forecast.end_iteration(self._used)
        if self._counting:
            if self._valid.size == 1:  # one token: each routed layer's experts, one count each (`_used`)
                self._counts += self._used
            self._update_rate()
        updates = self.learn or self.eviction == "reuse"
        if self._embeds.shape[0] and updates and self._affords("update", self._recording):
            context = _Context("update", data=self._embeds, extra=self._maps[self._valid])
            context.rows, context.requests = self._token_rows, self._requests
            context.request, context.iteration = self._request, self._iteration
            self._publish(context)
        self._plan_recording(updates)
        if self._guides_next():
            self._guide_next(self._hint)

    def _observe_guides(self) -> None:
        """What the iteration's guides were worth: the calibration learns, for every layer and distance bin a
        match guided, whether each expert was needed. Once per iteration (the guides of a layer are final
        when it routes, `_select`), so predictions within an iteration use the counts of those before."""
        if not self._guided.any():  # no match guided this iteration (most live ones: searches unpaid)
            return
        guided = self._guided.copy()  # [D, L]; the matcher thread may still add guides of later layers
        guided[:, self._current + 1 :] = False
        if not guided.any():
            return
        p, bins = self._guide_p[guided], self._guide_bin[guided]  # [count, J]
        outcome = self._used[np.nonzero(guided)[1]]  # each guide's layer's outcome, in the same order
        self.calibration.observe_binned(p.ravel(), bins.ravel(), outcome.ravel())

    def _plan_recording(self, updates: bool) -> None:
        """Live, whether the next iteration's embeddings and router probabilities are worth copying out of
        the device: only when the credit already covers one of the contexts they feed (`pay_for_matching`).
        On this CPU, where a copy costs less than a search, 92-95 % of fmoe-tiny-mixtral's iterations went
        without (~0.05-0.1 ms of a ~9 ms token). A search the credit could pay later in such an iteration
        waits for the next one with maps."""
        if self.ctx.matcher_s is not None or not self._priced():
            return  # simulated: copies are free; unpriced: every context goes
        costs = [self._matcher_s["update"]] if updates else []
        costs += [self._matcher_s["trajectory"]] if self.trajectory else []
        costs += [self._matcher_s["semantic"]] if self.semantic else []
        record = bool(costs) and (None in costs or self._credit >= min(costs))  # None: not priced yet
        self.needs_probs = record
        self.needs_semantic = self.semantic and record

    def _at_stake(self) -> float:
        """The share of needed experts that would miss without prediction, as far as the cache can tell:
        its misses and the hits prefetches made (prefetched, not evicted unused) per access; 1 before any."""
        stats = self.cache.stats
        accesses = stats.hits + stats.misses
        if not accesses:
            return 1.0
        return min(1.0, (stats.misses + max(0, stats.prefetches - stats.wasted_prefetches)) / accesses)

    def _affords(self, kind: str, recorded: bool) -> bool:
        """`_paid`, for a context whose inputs the engine gave (`recorded`); one it did not give them for (the
        credit covered no context when the iteration began, `_plan_recording`) is unpaid work too."""
        if not recorded:
            self.counts[f"unpaid_{kind}"] += 1
            return False
        return self._paid(kind)

    def _paid(self, kind: str) -> bool:
        """Whether the credit covers a context of `kind` (`pay_for_matching`), which it then pays for.
        Until both its cost and T are measured, every context goes."""
        return self._pay(self._matcher_s[kind], kind)

    def _pay(self, cost: float | None, kind: str) -> bool:
        """Spends `cost` host seconds of the credit on work of `kind`, if the credit covers them (or the
        work is not priced yet); counts the work left out otherwise."""
        if cost is None or not self._priced():
            return True
        if self._credit >= cost:
            self._credit -= cost
            return True
        self.counts[f"unpaid_{kind}"] += 1
        return False

    def _publish(self, context: _Context) -> None:
        if self._clocked:
            context.published = self.ctx.clock()
            self._backlog.append(context)
            self._catch_up()
        elif not self.asynchronous:
            self._process_or_drop(context)
        else:
            self._published += 1
            self._inbox.put(context)

    def _catch_up(self) -> None:
        """The simulator's matcher thread (`PolicyContext.clock` and `.matcher_s`): finishes the contexts
        whose host time has run by now on the simulated clock, as `_run` does on a real thread: one at a
        time, the oldest first, dropping the oldest beyond `queue_size` and skipping a prediction that a
        newer one waits behind. Each takes `matcher_s`; its prefetches are requested at the first event
        after it finished (the next layer's routing or iteration's start)."""
        now, backlog = self.ctx.clock(), self._backlog
        while backlog:
            start = max(self._free_at, backlog[0].published)
            if start > now:
                return
            waiting = sum(1 for c in backlog if c.published <= start)  # what the thread has seen by then
            if waiting > self.queue_size:
                backlog.popleft()
                self.counts["dropped_contexts"] += 1
                continue
            context = backlog[0]
            if self._superseded(context, itertools.islice(backlog, 1, waiting)):
                backlog.popleft()
                self.counts["skipped_contexts"] += 1
                continue
            finish = start + self._matcher_s[context.kind]
            if finish > now:
                return
            backlog.popleft()
            self._free_at = finish
            self._process_or_drop(context)

    def _superseded(self, context: _Context, newer: Iterable[_Context]) -> bool:
        """Whether a newer prediction waiting behind `context` replaces its prefetches anyway (band
        targets only: each prediction there covers every later layer), so the matcher may skip it."""
        return (
            self.traj_target == "band" and context.kind != "update" and any(c.kind != "update" for c in newer)
        )

    # -- the matcher -------------------------------------------------------------------------------------
    def _run(self) -> None:
        backlog: collections.deque[_Context] = collections.deque()
        while True:
            if not backlog:
                backlog.append(self._inbox.get())  # waits, without holding the interpreter
            while True:  # everything published meanwhile
                try:
                    backlog.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            # The oldest go first when the matcher falls behind (never close()'s mark, which comes last).
            while len(backlog) > self.queue_size and backlog[0] is not None:
                backlog.popleft()
                self.counts["dropped_contexts"] += 1
                self._done += 1
            context = backlog.popleft()
            if context is None:  # close(): every context published before it is done
                return
            try:
                if self._superseded(context, (c for c in backlog if c is not None)):
                    self.counts["skipped_contexts"] += 1
                else:
                    self._process_or_drop(context)
            finally:
                self._done += 1

    def wait_idle(self) -> None:
        """Blocks until the matcher has processed every published context (tests, benchmarks)."""
        while self._thread is not None and self._done < self._published:
            time.sleep(0.001)

    def _process_or_drop(self, context: _Context) -> None:
        """A context the matcher cannot use (say, routing with NaNs from a broken input) costs only its own
        prediction: it is dropped, counted in `stats()["failed_contexts"]` and warned about once, and the
        matcher goes on with the next, so one bad call does not disable prefetching for every later one."""
        try:
            self._process(context)
        except Exception as err:  # noqa: BLE001 - any failure of one context is reported, not fatal
            self.counts["failed_contexts"] += 1
            if self.last_error is None:
                warnings.warn(
                    f"fmoe matcher dropped a {context.kind} context: {err!r} (counted in "
                    "stats.extra['failed_contexts']; the model keeps serving)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.last_error = f"{context.kind}: {err!r}"

    def _process(self, context: _Context) -> None:
        start = time.thread_time()
        try:
            self._process_kind(context)
        finally:  # `pay_for_matching`'s cost: this thread's CPU time, what the work takes from the engine's
            spent, kind = time.thread_time() - start, context.kind
            self._timed[kind] += 1
            if self.ctx.matcher_s is None and self._timed[kind] > 1:
                self._spent[kind].append(spent)
                if len(self._spent[kind]) >= _COST_WARMUP:
                    self._matcher_s[kind] = statistics.median(self._spent[kind])

    def _process_kind(self, context: _Context) -> None:
        if context.kind == "update":
            start = time.perf_counter()
            if self.learn:
                self._learn(context)
            if self.eviction == "reuse" and self.reuse_predictor is None:  # the next hint: what followed
                # the maps most like each row's last token's
                last = np.flatnonzero(np.append(context.rows[1:] != context.rows[:-1], True))
                self._hint = self.store.future_of(context.extra[last], HINT_NEIGHBOURS).max(axis=0)
                self._hinted = context.iteration
            self.timers["store_update"] += time.perf_counter() - start
            return
        start = time.perf_counter()
        if context.kind == "semantic":
            scores, maps = self.store.match_embed(context.data)
            targets, current = range(0, min(self.ctx.prefetch_distance, self.ctx.num_layers)), -1
        else:
            scores, maps = self.store.match_traj(context.data, self._prefix_dots)
            current = context.layer
            if self._repeats(context, maps):  # the prefetches its last search asked for stand
                self._record_match(context.kind, scores)
                self.counts["repeated_matches"] += 1
                self.timers["matching"] += time.perf_counter() - start
                self.cache.request_prefetch((), replace=False, stale_before=current + 1)
                return
            if self._skipping and context.iteration == self._iteration and len(self.store):
                expected = np.zeros((*maps.shape[:2], self.ctx.top_k), np.int64)  # layers <= current: unused
                for row, expert_map in enumerate(maps):
                    order = self._sorted.sorted(expert_map)[0]  # [L, J]
                    expected[row, current + 1 :] = np.sort(order[current + 1 :, : self.ctx.top_k], axis=-1)
                self._foreseen = (context.iteration, expected.transpose(1, 0, 2).tolist())
            first = current + self.ctx.prefetch_distance
            targets = (
                range(first, self.ctx.num_layers) if self.traj_target == "band" else range(first, first + 1)
            )
        self._record_match(context.kind, scores)
        items = self._select(scores, maps, targets, current, fresh=context.iteration == self._iteration)
        self.timers["matching"] += time.perf_counter() - start
        replace = True if self.traj_target == "band" or context.kind == "semantic" else targets
        self.cache.request_prefetch(items, replace=replace, stale_before=current + 1)

    def _guides_next(self) -> bool:
        """Whether `_guide_next` may guess: in decode, with a hint made this iteration or at the end of the
        last one (live, where the credit leaves the predictor and the store's updates unpaid, an old hint
        says little), not under hybrid execution (not measured there: its admission lets every guess go),
        and where the credit covers its host time (`pay_for_matching`; it runs on the engine thread and
        starts the copies it admits, which live on this CPU cost more than the misses they save)."""
        fresh = self._hint is not None and self._hinted >= self._iteration - 1
        if not (self.next_token and self._decoding and fresh and not self._free_link):
            return False
        return self._pay(self._guess_s, "next_token")

    def _loads_nothing(self, layer: int, needed: np.ndarray) -> bool:
        """Whether every expert `layer` needs is resident or arriving: the link has no miss of it to load."""
        return all(self.cache.entry((layer, e)) is not None for e in needed.tolist())

    def _guide_next(self, hint: np.ndarray) -> None:
        """Prefetches for the next token's first d layers, which no search of this token guides (the
        trajectory search after layer l guides layers from l + d on, and the next token's semantic search
        comes as its first layer is about to route, too late for a copy to land): from the reuse hint
        `[L, J]` (the learned predictor's chance of reuse from this token's router inputs, or what followed
        the stored maps most like the last token's), calibrated into the chance each expert is needed at the
        next token's layer j (`next_calibration`, learned from the outcomes of the earlier guesses; the
        bins: the hint, the layers until j routes, the expert's recency as of the next token). The likeliest
        top_k x rows experts of each layer are prefetched where their chance pays for the copy (`threshold`,
        as for any prediction), and eviction keeps them by that chance (`_need`) until the next token's own
        searches guide their layers. Called after layer L - d (`_next_from`) when that layer loads nothing
        (its copies would otherwise wait behind these), and again when the iteration ends with the final
        hint (the link then idles until the next token's first misses).

        Measured on the validation split (simulated, 3 models x RTX 3090 / H100, Mixtral's traces also at
        Phi-3.5-MoE's sizes), against fmoe without it: at 25 % 0.986x the TPOT in geometric mean, 0.96-0.97x
        at Qwen3-30B-A3B's sizes, 0.98-0.99x at Qwen1.5-MoE's, 0.99-1.00x at Mixtral's and Phi's, where a
        copy takes a dozen layers and few guesses pay; at 12.5 % 0.990x (0.96-1.003x); at 50 % 1.001x
        (1.000-1.005x). Guessing after layer L - d regardless of its misses was 0.984x at 25 % in geometric
        mean but 0.993x at Qwen1.5-MoE / H100; only at the iteration's end, 0.992x. (Hybrid execution: off,
        not measured.)"""
        start = time.perf_counter()
        current, num_layers = self._current, self.ctx.num_layers
        for iteration, p, bins, (layers, experts) in self._next_guides:
            # What the last iteration's guesses of this one's first layers were worth (they have routed).
            if iteration == self._iteration - 1:
                self.next_calibration.observe_binned(p.ravel(), bins.ravel(), self._used[: len(p)].ravel())
                self.counts["next_token_guesses"] += len(layers)  # admitted (resident ones not copied)
                self.counts["next_token_right"] += int(self._used[layers, experts].sum())
        self._next_guides = [g for g in self._next_guides if g[0] == self._iteration]
        first = min(self.ctx.prefetch_distance, current + 1)  # the next token's layers guessed: [0, first)
        p = np.asarray(hint[:first], np.float64)
        ahead = np.arange(first) + num_layers - current  # layers of compute until each one routes
        recency = np.where(self._used[:first], 0, self.forecast.recency[:first])  # gap 0: used this token
        bins = Calibration.bins(p, 1.0, ahead[:, None], recency)
        q = self.next_calibration.predict_binned(p, bins) if self.calibrate else p
        self._need[:first] = q  # routed this iteration: `_need` is their next routing's (eviction's "now")
        likeliest = np.zeros(q.shape, bool)
        count = min(self.ctx.top_k * max(1, len(self._active[1])), q.shape[1])
        likeliest[np.arange(first)[:, None], np.argpartition(-q, count - 1, axis=1)[:, :count]] = True
        admitted = likeliest & (q > 0) & (q >= self.threshold(np.arange(first), current)[:, None])
        layers, experts = np.nonzero(admitted)
        self._next_guides.append((self._iteration, p, bins, (layers, experts)))
        priority = q[layers, experts] / ahead[layers]
        items = list(zip(zip(layers.tolist(), experts.tolist(), strict=True), priority.tolist(), strict=True))
        self.cache.request_prefetch(items, replace=range(first))
        self._guess_s = self._engine_price(self._guess_spent, start, self._guess_s)

    def _record_match(self, kind: str, scores: np.ndarray) -> None:
        self.counts[f"{kind}_matches"] += 1
        if len(self.scores[kind]) < 100_000:
            self.scores[kind].extend(scores.tolist())

    def _repeats(self, context: _Context, maps: np.ndarray) -> bool:
        """Whether a trajectory match of the current iteration found the same maps as the one before it
        (band targets: that one selected from them for every layer this one would guide). Most decode
        searches do: the best of a thousand stored prefixes rarely changes as one more layer is summed.
        Counts the repeats in a row, for `_resting`."""
        if self.traj_target != "band" or context.iteration != self._iteration:
            return False
        last, self._matched = self._matched, (context.iteration, maps)
        repeated = last is not None and last[0] == context.iteration and np.array_equal(last[1], maps)
        # An iteration's first search never repeats, so a streak never runs across iterations.
        self._streak = self._streak + 1 if repeated else 0
        if repeated:  # the match holds: the next searches would most likely find it again
            rest = 2 ** (self._streak - 1) if self.resting == "doubling" else self.ctx.num_layers
            self._rest = (context.iteration, context.layer + rest)
        return repeated

    def _learn(self, context: _Context) -> None:
        """Adds the iteration's maps to the store and records each as a follower of the same request's
        previous `reuse_horizon` tokens (`ExpertMapStore.add_future`)."""
        # In decode the iteration's searches have summed most of these maps' dot products with the store's.
        dots = self._prefix_dots.full_dots(self.store, context.extra)
        slots = self.store.add(context.data, context.extra, dots)
        for slot, row, token_map in zip(slots, context.rows, context.extra, strict=True):
            key = (context.request, int(row)) if context.requests is None else (context.requests[row],)
            recent = self._recent.get(key)
            if recent is None:
                recent = self._recent[key] = collections.deque(maxlen=self.reuse_horizon)
                if len(self._recent) > _RECENT_REQUESTS:
                    self._recent.popitem(last=False)
            self._recent.move_to_end(key)
            if recent:
                self.store.add_future(
                    np.fromiter(recent, np.int64), np.repeat(token_map[None], len(recent), 0)
                )
            recent.append(int(slot))

    def _select(
        self, scores: np.ndarray, maps: np.ndarray, targets: range, current: int, *, fresh: bool = True
    ) -> list[tuple[Key, float]]:
        """Similarity-aware selection per matched map and target layer; a batch's wishes are merged, each
        expert keeping its highest probability. Updates the target layers' guides (when the match is of
        the current iteration) and returns prefetches `(key, q / (layer - current))`, q the need
        probability (calibrated p), for the selected experts whose q pays for their copy."""
        if not len(targets):
            return []
        span = slice(targets.start, targets.stop)  # targets are consecutive layers: slices read views
        layers = np.arange(targets.start, targets.stop)
        dist = (layers - current)[:, None]  # [n, 1]
        probs = maps[:, span]  # [B, n, J]
        score = scores if self.dynamic_delta else np.ones_like(scores)  # [B]
        chosen = self._sorted.select_mask(maps, span, score, self.ctx.top_k)  # [B, n, J]
        if len(probs) == 1:  # decode at batch 1: one map, nothing to merge
            guide = probs[0]
            picked = chosen[0] & (guide > 0)  # selected, with a probability above 0
        else:
            picked = np.where(chosen, probs, 0.0).max(axis=0) > 0  # [n, J] selected from any map
            guide = probs.max(axis=0)  # [n, J] every expert's best probability in the matched maps
        match = float(scores.max()) if len(scores) else 0.0  # the guides' similarity
        bins = self.calibration.bins(guide, match, dist, self.forecast.recency[span])  # [n, J]
        need = self.calibration.predict_binned(guide, bins) if self.calibrate else guide  # [n, J]
        if fresh:  # guides of the layers still to route (from a late match, a routed layer's guide is moot)
            ahead = slice(max(0, self._current + 1 - int(layers[0])), None)  # `layers` ascend one by one
            at, depth = layers[ahead], np.minimum(dist[ahead, 0], MAX_DISTANCE) - 1  # distance bin
            self._guide_p[depth, at], self._guide_bin[depth, at] = guide[ahead], bins[ahead]
            self._guided[depth, at] = True
            self._latest_p[at], self._latest[at] = guide[ahead], True
            self._need[at] = need[ahead]
        q = np.where(picked, need, 0.0)
        thresholds = self.threshold(layers, current)  # [n]
        admitted = (q > 0) & (q >= thresholds[:, None])
        pos, experts = np.nonzero(admitted)
        self.counts["not_admitted"] += int(np.count_nonzero(picked)) - len(pos)  # admitted ones are picked
        priority = q[pos, experts] / (layers[pos] - current)  # `prefetch_priority`, checks left out
        if self.link == "queue" and self.admission == "cost" and len(pos) and thresholds.max() > 0:
            keep = self._after_queue(q[pos, experts], layers[pos], current, priority)
            self.counts["not_admitted"] += int(len(keep) - keep.sum())
            pos, experts, priority = pos[keep], experts[keep], priority[keep]
        keys = zip(layers[pos].tolist(), experts.tolist(), strict=True)
        return list(zip(keys, priority.tolist(), strict=True))

    def _after_queue(
        self, q: np.ndarray, layers: np.ndarray, current: int, priority: np.ndarray
    ) -> np.ndarray:  # [m] bool
        """Which admitted prefetches still pay once the link's queue is counted: the copies arriving now,
        the on-demand loads the layers before the target will make (the measured miss rate), and the
        prefetches of higher priority admitted before it. A prefetch starting at `start` lands at `start +
        T`, so a right guess saves min(T, W - start) of the wait at its layer (W: the compute until it),
        nothing if the link is still busy when the layer comes; a wrong one costs T of link time. Kept where
        q >= T / (T + saved) and saved > 0."""
        copy_s, layer_s = self.copy_s, self.layer_s
        stats = self.cache.stats
        misses = self.ctx.top_k * stats.misses / max(1, stats.hits + stats.misses)  # loads per layer
        arriving = sum(1 for _, entry in self.cache.entries() if not entry.ready)
        keep = np.zeros(len(q), bool)
        ahead = float(arriving)
        for i in np.argsort(-priority, kind="stable"):
            start = (ahead + misses * (layers[i] - current - 1)) * copy_s
            saved = min(copy_s, (layers[i] - current) * layer_s - start)
            if saved > 0 and q[i] >= copy_s / (copy_s + saved):
                keep[i] = True
                ahead += 1
        return keep

    # -- eviction ----------------------------------------------------------------------------------------
    def keep_score(self, key: Key, entry: Entry) -> float:
        """Higher is kept longer. "reuse": the probability the expert is needed soon: later in this
        iteration (its need probability, for a layer still to route) or in the next iterations (the reuse
        forecast) or in any token (its popularity, when profiled), combined as independent chances. "fmoe":
        the paper's p * freq (`keep_priority`)."""
        if self.eviction == "lru":
            return float(entry.last_use)
        if self.eviction == "lfu":
            return float(self.cache.freq(key))
        layer, expert = key
        if self.eviction == "fmoe":
            p = self._latest_p[layer, expert] if self._latest[layer] else 0.0
            return float(keep_priority(p, self.cache.freq(key)))
        return self._reuse_score(layer, expert)

    def keep_scores(self, keys: list[Key]) -> np.ndarray | list[float]:
        """`keep_score` of each of `keys` (resident experts), as one array expression for "reuse"."""
        if self.eviction != "reuse":
            return [self.keep_score(key, self.cache.entry(key)) for key in keys]
        flat = np.fromiter(map(self._flat_index.__getitem__, keys), np.int64, len(keys))  # layer * J + expert
        now = self._need.take(flat)  # at each layer's next routing: this iteration's, or the next's
        later = 1.0 - self.forecast.scores.take(flat)
        anytime = 1.0 if self._rate is None else self._unlikely.take(flat)
        return 1.0 - (1.0 - now) * later * anytime

    def _reuse_score(self, layer: int, expert: int) -> float:
        now = self._need[layer, expert]
        later = 1.0 - self.forecast.scores[layer, expert]
        anytime = 1.0 if self._rate is None else self._unlikely[layer, expert]
        return float(1.0 - (1.0 - now) * later * anytime)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        """A prefetch evicts only an expert worth less than the one it brings. ("reuse": both scored by
        `keep_score`. Scoring the incoming expert by its need probability alone, as before, let a victim's
        forecast and popularity outweigh nearly every prefetch once popularity was counted online; on the
        validation split of experiment 8 the change is neutral with a profile, 1-2 % faster without.)

        With cost admission the incoming expert's score is net of its price, the admission threshold: a
        wrong copy costs that share of its link time in on-demand waits, on top of the victim's misses.
        (Before, the threshold only admitted the prefetch and the eviction compared the scores alone: at
        12.5 % on fmoe-tiny-mixtral's validation routing at Mixtral-8x7B sizes, where a cache of one expert a
        layer makes every prefetch evict an expert of some later layer, fmoe was 0.731x on-demand LRU's TPOT
        on the RTX 3090 (on-demand LFU 0.746x) and with the price 0.690x; on the H100, copying in three pieces
        as its preset did then, 0.730x and 0.688x.)"""
        if self.eviction in ("lru", "lfu"):
            return True
        layer, expert = key
        if self.eviction == "fmoe":
            p = self._latest_p[layer, expert] if self._latest[layer] else 0.0
            incoming = float(keep_priority(p, self.cache.freq(key)))
            return self.keep_score(victim, self.cache.entry(victim)) < incoming
        # Scored as it would be once resident, like the victim, less what the copy costs when wrong: the
        # admission threshold (`threshold`).
        incoming = self._reuse_score(layer, expert) - self._price(layer)
        return self.keep_score(victim, self.cache.entry(victim)) < incoming

    def _price(self, layer: int) -> float:
        """`threshold` of a prefetch for `layer` decided now, 0 where it is infinite (a prefetch already
        admitted no longer asks whether it lands in time) or not priced."""
        price = self.threshold(layer, self._current) if self.admission == "cost" else 0.0
        return price if math.isfinite(price) else 0.0

    def stats(self) -> dict[str, Any]:
        out = {"store_size": len(self.store) if self.store is not None else 0, **dict(self.counts)}
        if self.last_error is not None:
            out["last_error"] = self.last_error
        if self.admission == "cost" and self.copy_s is not None and self.layer_s is not None:
            out |= {"copy_ms": 1e3 * self.copy_s, "layer_ms": 1e3 * self.layer_s}
        if self._predictor_s is not None:
            out["reuse_predictor_ms"] = 1e3 * self._predictor_s
        if self._guess_s is not None:
            out["next_token_ms"] = 1e3 * self._guess_s
        for kind, seconds in self._matcher_s.items():  # host time per context (`pay_for_matching`)
            if seconds is not None:
                out[f"{kind}_host_ms"] = 1e3 * seconds
        for kind, values in self.scores.items():
            if values:
                out[f"mean_{kind}_score"] = float(np.mean(values))
        return out


def auto_reuse_horizon(capacity: int, num_layers: int, top_k: int) -> int:
    """The reuse forecast's horizon for a cache of `capacity` experts: ceil(capacity / (L * k)) + 1
    iterations, at most `MAX_AUTO_HORIZON`. A layer's slots hold the experts of about slots / k
    tokens, so an expert the cache could evict is one that, unused, would fall out within that many tokens
    anyway; the forecast should tell the experts used again before then from the rest, and a bigger cache
    needs to look further ahead to do so (Belady's foresight, issue 16: two to four tokens).

    On the validation split (`benchmarks.validation_grid`, the three shipped models x 12.5 / 25 / 50 % x RTX
    3090 / H100, simulated), against the fixed horizon of 2: the same TPOT at the 8 points where it is 2
    (every 12.5 % point, Mixtral at 25 %), 0.98-0.99x at Qwen1.5-MoE's 25 % points, 0.95x at Qwen3's,
    0.88-0.97x at every 50 % point; 0.969x in geometric mean (fixed horizons of 1, 3 and 4 were each
    slower somewhere: 4 by 4 % at Mixtral's 25 %, 1 by up to 10 % at Qwen3's). The default since; before,
    a fixed 2. (Measured while the H100 preset still copied in three pieces, before 2026-11-28.)"""
    per_layer = -(-capacity // (num_layers * top_k))  # ceil, in integers
    return int(min(MAX_AUTO_HORIZON, per_layer + 1))


def store_from_traces(traces, *, capacity: int, prefetch_distance: int) -> ExpertMapStore:
    """Offline mode: an expert-map store built from recorded routing traces (`RoutingTrace`s).

    Every token of every iteration contributes its embedding and its expert map, in trace order. Routing
    recorded elsewhere without embeddings (`RoutingTrace.from_external`, `embed_dim` 0) gives a store of
    zero embeddings, one column wide, as the policy keeps online: trajectory matching alone
    (`semantic=False`) uses it.
    """
    traces = list(traces)
    meta = traces[0].meta
    store = ExpertMapStore(
        capacity=capacity,
        num_layers=meta["num_layers"],
        num_experts=meta["num_experts"],
        embed_dim=meta["embed_dim"] or 1,
        prefetch_distance=min(prefetch_distance, meta["num_layers"]),
    )
    for t, trace in enumerate(traces):
        for r, request in enumerate(trace.requests):
            for i, it in enumerate(request.iterations):
                if it.probs is None:
                    raise ValueError(
                        f"store_from_traces: trace {t} request {r} iteration {i} has no router probabilities"
                    )
                embeds = it.embeds
                if embeds is None:
                    if meta["embed_dim"]:
                        raise ValueError(
                            f"store_from_traces: trace {t} request {r} iteration {i} has no embeddings, "
                            f"though the trace's embed_dim is {meta['embed_dim']}"
                        )
                    embeds = np.zeros((it.num_tokens, 1), np.float32)
                store.add(embeds, it.probs)
    return store
