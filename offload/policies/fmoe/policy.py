"""The fMoE policy: its events and the wiring of its parts (paper section 4, `seeds/000_*`).

The engine publishes contexts; the matcher (`matcher.py`) searches the expert-map store (`store.py`):
semantic search at iteration start for layers [0, d) (where no next-token guess did), trajectory search
after each layer for the layers d ahead, except where the last match holds (`skips.py`). Its matches guide
the layers still to route (`guides.py`: similarity-aware selection, calibrated need probabilities), and the
guided experts whose need pays for their copy are prefetched by priority (`admission.py`). Eviction keeps
the experts most likely needed soon (`eviction.py`). Matching runs only while the copy time it could save
covers its host time (`budget.py`), and the engine never waits for it. Options: `options.py`; measurements
behind the defaults: `benchmarks/DECISIONS.md`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...cache import CacheView, Entry, Key
from ...events import IterationStart, LayerRouted, RequestStart
from ...predictors import Predictor
from ..base import Policy, PolicyContext
from ..fiddler import expert_usage
from . import parts
from .admission import Admission
from .budget import SearchBudget
from .distance import fit_counts
from .eviction import auto_reuse_horizon
from .followers import FollowerLinks
from .forecast import Calibration
from .matcher import Context, Matcher, make_matcher
from .next_use import NextUseTraining, used_sets
from .options import FMoEOptions
from .prefix_dots import PrefixDots
from .skips import SearchSkips
from .store import ExpertMapStore
from .store_file import open_store, store_from_traces
from .token_contexts import TokenContexts

# The reuse hint averages what followed this many of the stored maps most like the last token's, weighted by
# similarity (`ExpertMapStore.future_of`): one map's followers is a noisy forecast.
# Decision "hint neighbours".
HINT_NEIGHBOURS = 8


class FMoE(Policy):
    """The fMoE policy. Construct it with `FMoEOptions` or their fields as keywords (`FMoE(eviction="lru")`),
    or from recorded routing with `from_traces`."""

    name = "fmoe"
    # Hybrid execution: an expert the host computed is copied to the cache when the link is idle, never in
    # a prediction's way. Decision "host fill".
    host_fill = "idle"
    _resting = False  # a decode iteration whose bookkeeping went unpaid (`_rest`)

    def __init__(self, options: FMoEOptions | None = None, /, **overrides: Any):
        options = FMoEOptions(**overrides) if options is None else dataclasses.replace(options, **overrides)
        self.options = options
        self.learn = options.learn  # off while `paused_learning`
        self.store: ExpertMapStore | None = options.store
        self.store_path = options.store_path
        # "auto" is resolved at `bind`, where the cache's size is known; until then 2.
        self.reuse_horizon = 2 if options.reuse_horizon == "auto" else options.reuse_horizon
        predictor = options.reuse_predictor
        if predictor is not None and not isinstance(predictor, Predictor):
            predictor = Predictor.load(predictor)
        self.reuse_predictor: Predictor | None = predictor
        # `from_traces(reuse_predictor="train")`: the traces it trains on at `bind`, and what it has trained,
        # by horizon (a policy bound again beside a cache of another size trains again).
        self._reuse_traces: list | None = None
        self._trained_reuse: dict[int, Predictor] = {}
        self._next_use: NextUseTraining | None = None  # `from_traces(learned_reuse=True)`: fits at `bind`
        self._distance_counts: np.ndarray | None = None  # `from_traces(reuse_distance=True)`
        self._token_traces: list = []  # `from_traces`: the token contexts learn them at `bind`
        self.token_contexts: TokenContexts | None = None
        self.calibration = Calibration()
        # P(needed at the next token's layer j | the reuse hint's p, its layer, recency): the next token's
        # guess.
        self.next_calibration = Calibration()
        self.timers = {"matching": 0.0, "store_update": 0.0}
        self.counts: collections.Counter = collections.Counter()
        self.scores: dict[str, list[float]] = {"semantic": [], "trajectory": []}
        self.matcher: Matcher | None = None
        # What the engine copies out for this policy (`needs_*`): live, the embeddings and router
        # probabilities only for an iteration whose maps a paid context may use; in the simulator always.
        self._wants_maps = True
        self._wants_hidden = predictor is not None

    @classmethod
    def accepted_options(cls) -> set[str]:
        return {field.name for field in dataclasses.fields(FMoEOptions)}

    # -- what the engine copies out (`Policy.needs_*`: read at the points the base documents) ----------
    @property
    def needs_semantic(self) -> bool:
        return self.options.semantic and self._wants_maps

    @property
    def needs_probs(self) -> bool:
        return self._wants_maps

    @property
    def needs_hidden(self) -> bool:
        return self._wants_hidden

    @property
    def needs_tokens(self) -> bool:
        options = self.options
        return options.token_contexts and options.eviction == "reuse" and self.reuse_predictor is None

    @property
    def threaded(self) -> bool:
        return self.options.asynchronous

    def doing_without(self, need: str) -> str:
        if need == "thread":
            return "policy_options={'asynchronous': False} runs it inline"
        return "policy_options={'semantic': False} matches on the routing alone" if need == "embeds" else ""

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
            # Followers over the reuse horizon the forecast starts with (2 until `bind` resolves "auto").
            links = 2 if options.get("offline_followers", False) else 0
            options["store"] = store_from_traces(
                traces, capacity=store_capacity, prefetch_distance=prefetch_distance, followers=links
            )
            options.setdefault("popularity", expert_usage(traces))
        policy = cls(store_capacity=store_capacity, **options)
        if options.get("learned_reuse") and traces:
            policy._next_use = NextUseTraining(traces, options["popularity"])
        if options.get("reuse_distance") and traces:
            policy._distance_counts = fit_counts(used_sets(traces))
        policy._token_traces = list(traces) if policy.needs_tokens else []
        if train and traces:
            policy._reuse_traces = list(traces)
            policy._wants_hidden = True
        return policy

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        options = self.options
        self.admission = Admission(options, ctx, cache, self.counts)
        if options.reuse_horizon == "auto":
            self.reuse_horizon = auto_reuse_horizon(ctx.capacity, ctx.num_layers, ctx.top_k)
        if self._reuse_traces is not None:
            self.reuse_predictor = self._train_reuse(self.reuse_horizon)
        self.skips = SearchSkips(options, ctx.num_experts, ctx.top_k, ctx.num_layers)
        self.budget = SearchBudget(
            enabled=options.pay_for_matching,
            counts=self.counts,
            admission=self.admission,
            ctx=ctx,
        )
        self.charged_s = self.budget.charged  # the bookkeeping the simulator charges (`Policy.charged_s`)
        self.meta = {"model": ctx.model_id}  # what a saved store belongs to
        self._check_predictor()
        # Routing without embeddings (a trace from elsewhere, semantic=False) has width 0: the store then
        # keeps one zero column, which its redundancy rule ignores like any other zero embedding.
        self._embed_dim = ctx.embed_dim or 1
        self.store = open_store(self.store, self.store_path, ctx, options.store_capacity, self._embed_dim)
        self._bind_forecasts()
        self._bind_token_contexts()
        self._begin_state()
        clocked = ctx.clock is not None and (ctx.matcher_s or 0.0) > 0
        self.matcher = make_matcher(
            self._process,
            self.counts,
            asynchronous=options.asynchronous,
            queue_size=options.queue_size,
            band=options.band,
            clock=ctx.clock,
            cost=self.budget.prices.__getitem__,
            clocked=clocked,
        )

    def _check_predictor(self) -> None:
        if self.reuse_predictor is None:
            return
        self.reuse_predictor.check(
            kind="reuse",
            model_id=self.ctx.model_id,
            num_layers=self.ctx.num_layers,
            num_experts=self.ctx.num_experts,
            top_k=self.ctx.top_k,
            input_dim=self.ctx.embed_dim or None,
            source="fmoe's reuse predictor",
        )

    def _bind_forecasts(self) -> None:
        """Popularity, the reuse forecast, the calibrations (what an earlier run learned, saved with the
        store), the guides and the eviction rule over them (`parts.py`)."""
        built = parts.build(
            self.options,
            self.ctx,
            self.cache,
            self.admission,
            saved=self.store.attachments,
            calibration=self.calibration,
            next_calibration=self.next_calibration,
            reuse_horizon=self.reuse_horizon,
            reuse_predictor=self.reuse_predictor,
            next_use=self._next_use,
            distance_counts=self._distance_counts,
        )
        self.popularity, self.forecast, self.guides = built.popularity, built.forecast, built.guides
        self.sorted_maps, self.evictor, self.predicted = built.sorted_maps, built.evictor, built.predicted

    def _bind_token_contexts(self) -> None:
        """The token contexts over the forecast's horizon, first learning `from_traces`' traces (theirs)."""
        self.token_contexts = None
        if self.needs_tokens:
            ctx = self.ctx
            self.token_contexts = TokenContexts(ctx.num_layers, ctx.num_experts, self.reuse_horizon)
            self.token_contexts.learn_traces(self._token_traces)

    def _begin_state(self) -> None:
        ctx = self.ctx
        # The first layer after which no trajectory search guides a layer: the next-token guess follows it.
        self._next_from = ctx.num_layers - min(ctx.prefetch_distance, ctx.num_layers)
        self._iteration = 0
        self._request = 0
        self._hint: np.ndarray | None = None  # [L, J] what the store says follows the last token
        self._hinted = -1  # the iteration the hint was made in (or at the end of)
        self._recording = True  # this iteration's maps are kept (`_maps`) for searches and the update
        self._followers = FollowerLinks(self.reuse_horizon)  # matcher: what the store learns
        self._requests: tuple[int, ...] | None = None  # the current iteration's rows' requests
        self._prefix_dots = PrefixDots()  # matcher: an iteration's trajectory searches, layer after layer
        self._resting = False
        self._rest_needed = 0  # experts the layers routed while resting (the credit's deposit at the end)
        self._spent = 0.0  # host seconds of this iteration's event handlers so far

    def _train_reuse(self, horizon: int) -> Predictor:
        """The reuse predictor for `horizon`, trained once (decision "reuse predictor horizon")."""
        if horizon not in self._trained_reuse:
            from ...predictor_training import train_reuse

            self._trained_reuse[horizon] = train_reuse(self._reuse_traces, horizon=horizon, progress=False)
        return self._trained_reuse[horizon]

    def close(self) -> None:
        """Stops the matcher (after the contexts it has) and saves the store when `store_path` is set."""
        if self.matcher is None:
            return
        self.matcher.close()
        if self.store_path and self.store is not None:
            learned = (self.calibration, self.next_calibration, self.forecast, self.popularity)
            self.store.attachments = parts.attachments(*learned)
            self.store.save(self.store_path, self.meta)

    def wait_idle(self) -> None:
        """Blocks until the matcher has processed every published context (tests, benchmarks)."""
        if self.matcher is not None:
            self.matcher.wait_idle()

    @contextlib.contextmanager
    def paused_learning(self) -> Iterator[None]:
        """The store learns no maps meanwhile (a warm-up's random tokens); the matcher has seen the last
        context when it ends."""
        learning, self.learn = self.learn, False
        try:
            yield
        finally:
            self.wait_idle()
            self.learn = learning

    # -- events from the engine (engine thread: cheap, never waits for matching) -------------------------
    def on_request_start(self, event: RequestStart) -> None:
        if self.token_contexts is not None:
            self.token_contexts.start_request()
        self.forecast.start_request()
        self._request += 1
        self._hint = None
        self.guides.start_request()
        self.evictor.stale()

    def on_iteration_start(self, event: IterationStart) -> None:
        start = time.perf_counter()
        self.matcher.catch_up()
        valid = event.valid
        rows, tokens = valid.shape
        if tokens == 1 and (self.admission.probes() or not self.budget.pay("bookkeeping")):
            self._rest()
            return
        if self._resting:
            self._wake()
        self._valid = valid.reshape(-1)
        self._active = (None, None)  # (the valid mask, the rows it leaves active), for `on_layer_routed`
        self._last = np.where(valid.any(1), tokens - 1, -1) + np.arange(rows) * tokens  # each row's last
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
        if self.token_contexts is not None:
            self.token_contexts.begin_iteration(event.tokens, valid, self.ctx.top_k)
        self._decoding = tokens == 1
        self.admission.begin_iteration(self._decoding)
        self._iteration += 1
        self.guides.begin_iteration()
        if self.predicted is not None:
            self.predicted.begin_iteration()
        self.forecast.begin_iteration(self._hint if self.options.eviction == "reuse" else None)
        recorded = event.embeds is not None
        guessed = tokens == 1 and not self.options.decode_semantic and self.guides.guessed(self._iteration)
        if self.options.semantic and n_valid and not guessed and self.budget.affords("semantic", recorded):
            self.matcher.publish(Context("semantic", data=self._embeds, iteration=self._iteration))
        self._spent = time.perf_counter() - start
        self.evictor.stale()  # (resting, eviction reads none of it)

    def _rest(self) -> None:
        """A decode iteration the credit cannot pay fmoe's own bookkeeping for (`SearchBudget`; where copies
        cost less than it, as on a CPU): no search, forecast or guide follows it, eviction is LRU (every keep
        score ties), and waiting prefetches are dropped as rest begins. Decision "pay for bookkeeping"."""
        if not self._resting:
            self._resting = True  # from here on `evicts_least_recent`
            self.evictor.ask(self.cache.drop_prefetches, before=self.ctx.num_layers)
        self.admission.begin_iteration(True, paid=False)
        self._iteration, self._rest_needed = self._iteration + 1, 0
        self._wants_hidden = self._wants_maps = False  # nothing to copy out (the first paid iteration too)
        self.counts["unrecorded_iterations"] += 1

    def _wake(self) -> None:
        """The first iteration fmoe pays for after resting: the request's routing features start over (they
        would skip the tokens it rested through)."""
        self._resting = False
        if self.token_contexts is not None:
            self.token_contexts.start_request()
        self.forecast.start_request()
        self.guides.start_request()
        self._hint = None

    def on_layer_routed(self, event: LayerRouted) -> None:
        if self._resting:
            self._rest_needed += len(event.needed)
            return
        start = time.perf_counter()
        if not self._routed(event):  # True: it ended on a call to the cache, whose keep scores still hold
            self.evictor.stale()
        self._spent += time.perf_counter() - start

    def _routed(self, event: LayerRouted) -> bool:
        layer, valid, ctx = event.layer, event.valid, self.ctx
        self.matcher.catch_up()
        if self.admission.measuring:
            self.admission.measure(self._decoding)
        needed = np.asarray(event.needed, np.int64)
        self.guides.route(layer, needed)
        self.popularity.count_layer(layer, event.ids, event.token_valid)
        self.forecast.mark_used(layer, needed)
        if self.token_contexts is not None:
            self.token_contexts.route(layer, event.ids)
        if event.probs is None:  # the engine skipped them: no search or update from this iteration
            self._recording = False
        elif self._recording:
            self._maps[:, layer] = event.probs
        if valid is not self._active[0]:  # the engine passes one mask for every layer of an iteration
            self._active = (valid, self._last[valid.any(1)])
        active = self._active[1]  # each active row's last token
        if self.predicted is not None and event.hidden is not None and self.budget.pay("reuse"):
            self._predict_reuse(event, active)
        self.budget.deposit(len(needed), self.cache.stats, ctx.num_layers * ctx.top_k)
        if self.predicted is not None:  # the engine copies the next router input only for a paid use
            self._wants_hidden = self.budget.covers("reuse")
            if not self._wants_hidden:  # the next layer's prediction is left out
                self.counts["unpaid_reuse"] += 1
        if layer + ctx.prefetch_distance >= ctx.num_layers:  # no search guides a layer from here
            if layer == self._next_from and self._loads_nothing(layer, needed) and self._guesses_next():
                self._guess_next(self._hint)
                return True  # (it ends on `Eviction.ask`)
            return False
        return bool(self.options.trajectory and active.size) and self._after_layer(layer, event.ids, active)

    def _after_layer(self, layer: int, ids: np.ndarray, active: np.ndarray) -> bool:
        """The trajectory search after `layer`, or what is left of it where the last match holds: the
        waiting requests for this layer and those before it are dropped, as a search would (True)."""
        if self.skips.confirmed(layer, ids, active, self._iteration, self._decoding):
            self.counts["confirmed_layers"] += 1
        elif self.skips.resting(layer, self._iteration):
            self.counts["rested_layers"] += 1
        else:
            if self.budget.affords("trajectory", self._recording):
                data = self._maps[active, : layer + 1]  # a copy (`active` indexes rows): the matcher's own
                self.matcher.publish(Context("trajectory", layer=layer, data=data, iteration=self._iteration))
            return False
        self.evictor.ask(self.cache.drop_prefetches, before=layer + 1)
        return True

    def _predict_reuse(self, event: LayerRouted, rows: np.ndarray) -> None:
        """The reuse hint from the learned predictor: it rescores this iteration's forecast and starts the
        next iteration's (where copies cost less than a prediction the credit leaves it unpaid, and the
        forecast goes on from the request's own routing)."""
        if not rows.size:
            return
        start = time.perf_counter()
        self._hint = self.predicted.predict(np.asarray(event.hidden)[rows], event.layer)
        self._hinted = self._iteration
        self.forecast.refresh(self._hint, self.guides.used, self.guides.current)
        self.budget.record_engine("reuse", start)

    def on_iteration_end(self) -> None:
        if self._resting:
            ctx = self.ctx
            self.budget.deposit(self._rest_needed, self.cache.stats, ctx.num_layers * ctx.top_k)
            return
        updates = self.learn or self.options.eviction == "reuse"
        start = time.perf_counter()
        self.guides.observe()
        self.forecast.end_iteration(self.guides.used)
        self.popularity.end_iteration(self.guides.used, self._valid.size)
        contexts = self.token_contexts
        rows = None if contexts is None else contexts.end_iteration(self._requests, self.guides.used)
        if self._embeds.shape[0] and updates and self.budget.affords("update", self._recording):
            context = Context("update", data=self._embeds, extra=self._maps[self._valid])
            context.rows, context.requests = self._token_rows, self._requests
            context.token_hint = None if rows is None else self.token_contexts.hint(rows)
            context.request, context.iteration = self._request, self._iteration
            self.matcher.publish(context)
        self._plan_recording(updates)
        if self._guesses_next():
            self._guess_next(self._hint)
        if self._decoding:
            self.budget.record_spent("bookkeeping", self._spent + time.perf_counter() - start)
        self.evictor.stale()

    def _plan_recording(self, updates: bool) -> None:
        """Live, whether the next iteration's embeddings and router probabilities are copied out of the
        device (`SearchBudget.wants_maps`): not for an iteration fmoe will rest through."""
        kinds = ["update"] if updates else []
        kinds += ["trajectory"] if self.options.trajectory else []
        kinds += ["semantic"] if self.options.semantic else []
        record = self.budget.wants_maps(kinds)
        if record is not None:
            self._wants_maps = record and self.budget.covers("bookkeeping")

    # -- the next token ------------------------------------------------------------------------------------
    def _guesses_next(self) -> bool:
        """Whether the next-token guess may run: in decode, with a hint made this iteration or at the end of
        the last one (an older hint says little), not under hybrid execution (not measured there), and where
        the credit covers its host time (it runs on the engine thread)."""
        fresh = self._hint is not None and self._hinted >= self._iteration - 1
        if not (self.options.next_token and self._decoding and fresh and not self.admission.free_link):
            return False
        return self.budget.pay("next_token")

    def _loads_nothing(self, layer: int, needed: np.ndarray) -> bool:
        """Whether every expert `layer` needs is resident or arriving: the link has no miss of it to load."""
        return all(self.cache.entry((layer, e)) is not None for e in needed.tolist())

    def _guess_next(self, hint: np.ndarray) -> None:
        """Prefetches for the next token's first d layers (`Guides.guess_next`): after layer L - d when that
        layer loads nothing (its copies would otherwise wait behind these), and again when the iteration ends
        with the final hint (the link then idles until the next token's first misses)."""
        start = time.perf_counter()
        first = min(self.ctx.prefetch_distance, self.guides.current + 1)  # the next token's layers guessed
        items = self.guides.guess_next(
            hint,
            iteration=self._iteration,
            first=first,
            rows=len(self._active[1]),
            threshold=self.admission.threshold,
            counts=self.counts,
        )
        self.evictor.ask(self.cache.request_prefetch, items, replace=range(first))
        self.budget.record_engine("next_token", start)

    # -- the matcher's work (its thread, or inline) -----------------------------------------------------
    def _process(self, context: Context) -> None:
        timed = self.budget.measures_contexts
        start = time.thread_time() if timed else 0.0
        try:
            if context.kind == "update":
                self._update(context)
            else:
                self._search(context)
        finally:  # the price of the work: this thread's CPU time, what it takes from the engine's
            self.evictor.stale()
            self.budget.record_context(context.kind, time.thread_time() - start if timed else 0.0)

    def _update(self, context: Context) -> None:
        start = time.perf_counter()
        if self.learn:
            self._followers.learn(self.store, context, self._prefix_dots)
        if self.options.eviction == "reuse" and self.reuse_predictor is None:  # the next hint: what
            # followed the maps most like each row's last token's
            last = np.flatnonzero(np.append(context.rows[1:] != context.rows[:-1], True))
            hint = self.store.future_of(context.extra[last], HINT_NEIGHBOURS).max(axis=0)
            if context.token_hint is not None:  # either foretells a use (decision "token contexts")
                hint = 1.0 - (1.0 - hint) * (1.0 - context.token_hint)
            self._hint = hint
            self._hinted = context.iteration
        self.timers["store_update"] += time.perf_counter() - start

    def _search(self, context: Context) -> None:
        start, ctx = time.perf_counter(), self.ctx
        if context.kind == "semantic":
            scores, maps = self.store.match_embed(context.data)
            targets, current = range(0, min(ctx.prefetch_distance, ctx.num_layers)), -1
        else:
            scores, maps = self.store.match_traj(context.data, self._prefix_dots)
            current = context.layer
            if self.skips.repeats(context.iteration, self._iteration, current, maps):
                # The prefetches its last search asked for stand.
                self._record_match(context.kind, scores)
                self.counts["repeated_matches"] += 1
                self.timers["matching"] += time.perf_counter() - start
                self.evictor.ask(self.cache.drop_prefetches, before=current + 1)
                return
            if self.skips.confirming and context.iteration == self._iteration and len(self.store):
                self.skips.foresee(context.iteration, maps, current, self.sorted_maps)
            first = current + ctx.prefetch_distance
            band = self.options.band
            targets = range(first, ctx.num_layers) if band else range(first, first + 1)
        self._record_match(context.kind, scores)
        items = self._select(scores, maps, targets, current, fresh=context.iteration == self._iteration)
        self.timers["matching"] += time.perf_counter() - start
        replace = True if self.options.band or context.kind == "semantic" else targets
        self.evictor.ask(self.cache.request_prefetch, items, replace=replace, stale_before=current + 1)

    def _select(
        self, scores: np.ndarray, maps: np.ndarray, targets: range, current: int, *, fresh: bool
    ) -> list[tuple[Key, float]]:
        """The guided experts of `targets` whose need pays for their copy, as prefetches by priority."""
        if not len(targets):
            return []
        layers, picked, need = self.guides.guide(scores, maps, targets, current, fresh=fresh)
        return self.admission.prefetches(layers, picked, need, current)

    def _record_match(self, kind: str, scores: np.ndarray) -> None:
        self.counts[f"{kind}_matches"] += 1
        if len(self.scores[kind]) < 100_000:
            self.scores[kind].extend(scores.tolist())

    # -- eviction and admission (`Eviction`, `Admission`) ---------------------------------------------------
    @property
    def evicts_least_recent(self) -> bool:
        """While resting, eviction is LRU: the cache takes the least recently used without scoring."""
        return self._resting

    def keep_score(self, key: Key, entry: Entry) -> float:
        return float(entry.last_use) if self._resting else self.evictor.keep_score(key, entry)

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        if self._resting:  # every score ties: the cache takes the least recently used
            return np.zeros(len(layers))
        return self.evictor.keep_scores(layers, experts)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        return self._resting or self.evictor.admit_prefetch(key, victim)

    def refusal_stamp(self, key: Key, priority: float) -> tuple | None:
        return None if self._resting else self.evictor.refusal_stamp(key)

    def threshold(self, layer: int | np.ndarray, current: int) -> float | np.ndarray:
        """`Admission.threshold`: the need a prefetch for `layer` must have, deciding after `current`."""
        return self.admission.threshold(layer, current)

    def stats(self) -> dict[str, Any]:
        out = {"store_size": len(self.store) if self.store is not None else 0, **dict(self.counts)}
        if self.matcher is not None:
            if self.matcher.last_error is not None:
                out["last_error"] = self.matcher.last_error
            out |= self.admission.stats() | self.budget.stats()
        return out | {f"mean_{kind}_score": float(np.mean(v)) for kind, v in self.scores.items() if v}


__all__ = ["HINT_NEIGHBOURS", "FMoE", "FMoEOptions", "store_from_traces"]
