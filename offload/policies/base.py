"""The policy interface every offloading policy implements, driven by the iteration driver's events.

Events (`offload/events.py`; same order in the live engine and the simulator, `offload/driver.py`):
`RequestStart`, `IterationStart` (semantic context), `LayerRouted` (trajectory context), and
`on_iteration_end()`. A policy answers with prefetch requests (`self.cache.request_prefetch`) and with the
eviction order (`keep_score`, `admit_prefetch`); it reads the cache only through its `CacheView`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted, RequestStart


@dataclasses.dataclass(frozen=True)
class PolicyContext:
    """What a policy learns about the model and the cache when the engine or the simulator starts it."""

    num_layers: int  # MoE layers (an expert map has this many rows); "layer" in policies means MoE layer
    num_experts: int  # J
    top_k: int
    embed_dim: int  # H, width of the semantic context
    prefetch_distance: int  # d
    capacity: int  # cache slots (all devices together)
    model_id: str = ""
    # Router kernels `[D, J]` float32 of each MoE layer, for policies that `needs_hidden` (speculation).
    router_weights: tuple[np.ndarray, ...] = ()
    # Cost hints for a policy that weighs a prefetch against the link time it takes (fmoe's admission):
    # seconds to copy one expert to the device, and to compute one MoE layer of a decode step. The
    # simulator passes its cost model's; the live engine leaves them None (such a policy measures them).
    copy_s: float | None = None
    layer_s: float | None = None
    # Host seconds a predicting policy's matcher spends per search or update (fmoe's `pay_for_matching`
    # weighs them against the link time they could save). The simulator passes its `matcher_s` (default 0:
    # a free, instantaneous matcher). None: measured as the policy runs (the live engine).
    matcher_s: float | None = None
    # The simulated clock (seconds), when the simulator models the matcher's host time (`matcher_s` > 0): an
    # inline matcher then finishes each context that long after it was published, behind its earlier ones
    # (fmoe's `_catch_up`). None: the live engine (a matcher thread takes real time) or a free matcher.
    clock: Callable[[], float] | None = None
    # The pieces a copy goes over the link in: an on-demand load waits behind at most the one piece under
    # way (the simulator's `SimulatedLink`, the live `ChunkedJaxMover`); 1: whole copies.
    copy_chunks: int = 1
    # `OffloadConfig.execution`: "copy", or "hybrid" (a miss may be computed on the host instead of waiting
    # for its copy, so a wasted prefetch delays other prefetches but no miss).
    execution: str = "copy"
    # Host seconds per MoE layer of a policy's own bookkeeping on the engine thread (its event handlers'
    # work beyond the floor `simulate(policy_s=...)` charges at every layer), as the simulator prices it: a
    # policy that weighs its host work against what it saves (fmoe's `pay_for_matching`) prices it so, and
    # reports the layers it did the work for (`Policy.charged_s`), so that an iteration it leaves the work
    # out of costs nothing. None: free, and never left out (the simulator's default); the live engine
    # leaves it None (the policy measures its own).
    bookkeeping_s: float | None = None


class Policy:
    """Base policy: on-demand loading only, least-recently-used eviction.

    Subclasses override the hooks they need. Hooks run on the engine thread, so anything slow belongs on
    a thread of the policy's own (see `fmoe`). Construct a policy with its options (a name and
    `OffloadConfig.policy_options` do the same through `make_policy`), or with `from_traces` to start from
    what recorded routing teaches.
    """

    name = "base"
    # What the engine copies out of the device for the policy (ids are always given), at defined points:
    # - `needs_semantic` (the embeddings) and `needs_probs` (every layer's router probabilities) are read
    #   as each iteration starts, and hold for the whole iteration: a policy may change them only in
    #   `on_iteration_end` (fmoe, live, stops wanting them while it could not pay for their use);
    # - `needs_hidden` (each MoE layer's router input) is read before each layer routes: a policy may change
    #   it in `on_layer_routed`, for the next layer;
    # - `needs_tokens` (the token ids the iteration feeds, `IterationStart.tokens`) is read as each iteration
    #   starts; a trace without them gives None.
    # The simulator reads them once, at the start, for what a trace must hold. Class attributes here; a
    # policy that changes them makes them read-only properties.
    needs_semantic = False
    needs_probs = False
    needs_hidden = False
    needs_tokens = False
    # The policy works on a thread of its own, whose timing a simulated clock cannot follow.
    threaded = False
    preload_all = False  # the cache starts with every expert (the resident policy)
    # Hybrid execution: an expert the host computed is also copied to the cache in the background, behind
    # every prefetch (True), so that a cache without prediction still follows what is used (on_demand_lru);
    # "idle": only when the link is idle at the time, so that such a copy never delays a prediction's (fmoe).
    # Off by default (Fiddler and the static split keep their placement).
    host_fill: bool | str = False
    # A cache with room for every expert copies in those no request has needed yet (`Driver.fill_free_slots`),
    # so that no step of the engine stops for a miss. Off for a policy that places experts itself and
    # computes the rest on the host (Fiddler, the static split).
    fill_free_slots = True

    @classmethod
    def accepted_options(cls) -> set[str]:
        """The keyword options the constructor takes (`OffloadConfig.policy_options`)."""
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = inspect.signature(cls.__init__).parameters.values()
        return {p.name for p in parameters if p.name != "self" and p.kind in kinds}

    @classmethod
    def required_options(cls) -> list[str]:
        """The options the policy cannot start without (e.g. a trained predictor): none for most."""
        return [
            p.name
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self"
            and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> Policy:
        """The policy, learned offline from recorded routing (`RoutingTrace`s of other requests) where it
        learns anything: fmoe's expert-map store, MoE-Infinity's activation matrices, the predictors of
        ProMoE and DuoServe. `store_capacity` bounds what is kept. The base learns nothing."""
        return cls(**options)

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        self.ctx = ctx
        self.cache = cache
        if "timers" not in vars(self):  # seconds by stage ("matching", ...), added to out.stats.overhead_s
            self.timers: dict[str, float] = {}

    def initial_experts(self) -> list[Key]:
        """Experts to place in the cache before serving, in order (a fixed placement: fiddler, static_split);
        called after `bind`. The base places none (`OffloadConfig(preload=True)` still fills the cache)."""
        return []

    def on_request_start(self, event: RequestStart) -> None:
        """A new batch of requests begins (a `generate` call)."""

    def on_iteration_start(self, event: IterationStart) -> None:
        """An iteration over N = B * T new tokens starts."""

    def on_layer_routed(self, event: LayerRouted) -> None:
        """An MoE layer has routed (the trajectory context); its experts run next."""

    def on_iteration_end(self) -> None:
        """Every layer of the iteration has run."""

    def keep_score(self, key: Key, entry: Entry) -> float:
        """Eviction order: the lowest score is evicted first."""
        return float(entry.last_use)

    # Optional: `keep_scores(layers, experts) -> [n]`, `keep_score` of many resident experts at once, given
    # as int64 arrays of their layers and experts (a policy whose scores are array lookups saves a Python
    # call per entry each time the cache picks a victim).
    keep_scores: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
    # `keep_score` is the entry's last use (LRU), so the cache takes the least recently used evictable
    # expert without scoring the others. True here; a subclass that defines `keep_score` or `keep_scores`
    # is False unless it says otherwise (`__init_subclass__`).
    evicts_least_recent = True

    # The policy acts on `LayerRouted` (it defines `on_layer_routed`), so the driver makes the event for it
    # at every layer: False here (the base hook does nothing), True for a subclass that defines the hook
    # (or inherits one) unless it says otherwise.
    hears_layers = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if ("keep_score" in own or "keep_scores" in own) and "evicts_least_recent" not in own:
            cls.evicts_least_recent = False
        if "hears_layers" not in own:
            cls.hears_layers = cls.on_layer_routed is not Policy.on_layer_routed

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        return True

    def refusal_stamp(self, key: Key, priority: float) -> Hashable | None:
        """Optional, for a policy whose `admit_prefetch(key, priority, victim)` is "the victim's keep score is
        below a bar": a value that stands for the bar and every keep score (equal stamps: equal bar and
        scores). While it stays equal and no expert has become evictable, a refused prefetch is refused
        again (the lowest-scored candidate can only score higher), and the cache asks no victim for it.
        None (here): no such promise."""
        return None

    def charged_s(self) -> float:
        """Simulated host seconds of the policy's own bookkeeping since the simulator last asked, at the
        price `PolicyContext.bookkeeping_s` gave: what the policy did (work it left out costs nothing). The
        simulator asks after each layer, when it gave a price. 0.0 here: the base prices nothing."""
        return 0.0

    def stats(self) -> dict[str, Any]:
        """Policy-specific statistics merged into `out.stats.extra`."""
        return {}

    def doing_without(self, need: str) -> str:
        """How to run the policy without `need`: a trace field ("embeds", "probs", "hidden") or its own
        "thread", for the error that refuses a replay lacking it; "" when it cannot."""
        return ""

    def wait_idle(self) -> None:
        """Blocks until the policy's background work on the events so far is done (tests, benchmarks)."""

    @contextlib.contextmanager
    def paused_learning(self) -> Iterator[None]:
        """Events meanwhile teach the policy nothing it keeps (a warm-up's random tokens); what it learns
        from served requests, it learns again after. The base learns nothing."""
        yield

    def close(self) -> None:
        """Stops threads and saves state; the engine calls it once."""
