"""MoE-Infinity baseline: request-level expert activation matrices (EAMs) matched against a bounded
collection, multi-layer prefetch by proximity, and cache priorities from request-level counts (Xue et al.,
"MoE-Infinity: Offloading-Efficient MoE Model Serving", `seeds/003_*` sections 4-5; code:
EfficientMoE/MoE-Infinity, `moe_infinity/memory/`).

Built by `make_policy` from `OffloadConfig(policy=MoEInfinity(...))`; the engine and the trace-replay
simulator drive it through the `Policy` hooks. Matching runs inline (no I/O thread): deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted, RequestStart
from .base import Policy, PolicyContext

PHASES = ("prefill", "decode")
PROTECTED = 1e12  # keep score of an expert the current prediction wants (above any count-based score)


class ActivationMatrixCollection:
    """The EAMC (section 4.2): at most `capacity` request-level EAMs `[L, J]` (token counts per expert).

    When full, a new EAM replaces the stored one most similar to it (largest cosine), which keeps the
    newest pattern and the collection's diversity. (The authors' code instead replaces the entry matched
    least often; we follow the paper.)
    """

    def __init__(self, capacity: int, num_layers: int, num_experts: int):
        if capacity < 1:
            raise ValueError(f"the EAM collection needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.matrices = np.zeros((capacity, num_layers, num_experts), np.float64)  # [C, L, J]
        self.size = 0
        self.replacements = 0
        self._norms: np.ndarray | None = None  # [n] each stored EAM's norm over every layer, once worked out

    def __len__(self) -> int:
        return self.size

    @property
    def stored(self) -> np.ndarray:
        return self.matrices[: self.size]  # [n, L, J]

    def add(self, eam: np.ndarray) -> None:
        """Stores a finished request's EAM `[L, J]` (an empty one, from a request that never ran, is not)."""
        if eam.shape != self.matrices.shape[1:]:
            raise ValueError(f"EAM of shape {eam.shape}, the collection holds {self.matrices.shape[1:]}")
        if not eam.any():
            return
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
        else:
            slot = int(np.argmax(self.similarity(eam, np.ones(eam.shape[0], bool))))
            self.replacements += 1
        self.matrices[slot] = eam
        self._norms = None

    def similarity(self, query: np.ndarray, observed: np.ndarray) -> np.ndarray:
        """Cosine of a query EAM `[L, J]` with each stored EAM over the `observed` layers `[L]` -> `[n]`."""
        if observed.all():  # every layer (the usual case): the stored EAMs as they lie, their norms kept
            stored = self.stored.reshape(self.size, -1)  # [n, L * J]
            if self._norms is None:
                self._norms = np.linalg.norm(stored, axis=1)
            stored_norms = self._norms
        else:
            stored = self.stored[:, observed].reshape(self.size, -1)  # [n, L_obs * J]
            stored_norms = np.linalg.norm(stored, axis=1)
        q = query[observed].ravel()
        norms = stored_norms * np.linalg.norm(q)
        return np.divide(stored @ q, norms, out=np.zeros(self.size), where=norms > 0)

    def mean(self) -> np.ndarray:
        """The average stored EAM `[L, J]` (the most popular experts across all history)."""
        return self.stored.mean(axis=0)


class MoEInfinity(Policy):
    """Activation-aware prefetching and caching, as in MoE-Infinity (paper sections 4-5).

    Tracing. Each request keeps a request-level EAM `[L, J]` per phase (prefill and decode are traced
    separately, section 4.1): token counts per expert, accumulated over its iterations. A finished
    request's EAMs join the prefill / decode collection (`ActivationMatrixCollection`) when `learn`: the
    prefill EAM after the prefill iteration, the decode EAM when the next batch starts (or at `close`).

    Prefetching (section 5.1). After MoE layer l routes, each active request's running EAM of the current
    phase (earlier iterations plus this one so far) is matched by cosine similarity against the phase's
    collection, over the layers observed so far: layers <= l on a phase's first iteration, every layer
    afterwards (the paper flattens whole matrices; a stored EAM's unobserved rows would only scale its
    norm). The batch's matched EAMs are summed and normalised per row into activation probabilities P,
    and expert (i, j) for each later layer i gets priority P[i, j] * (1 - (i - l) / L) (layer proximity).
    The K highest, K = the cache's slots, are requested, replacing waiting ones. At iteration start
    (before any routing, l = -1) the same runs with the requests' EAMs of earlier iterations, or, on a
    phase's first iteration, with the collection's mean (the fMoE paper, section 4.2, describes
    MoE-Infinity prefetching the most popular historical experts for the first layers). The authors'
    code differs: it matches one EAM per request on the layers after l only, weights by
    1 - (i - l) / (L + 1), and compares with the request's accumulated counts.

    Caching (section 5.2). Experts the current prediction wants keep the maximal priority (ordered by their
    prefetch priority) until used or dropped from the prediction; every other expert's priority is its
    request-level count (both phases, all requests of the batch) plus one, times 1 - i / L, which favours
    early layers (they gain least from prefetching). The "plus one" lets the layer boost order experts the
    current requests have not used yet; the linear decay is the code's `decay_from_first`. A prefetch may
    evict a wanted expert only of lower prefetch priority.

    Args:
      capacity: EAMs per phase collection (default 1000).
      eamc: prebuilt collections by phase (`eamc_from_traces`), e.g. prepared before an
        evaluation as the fMoE paper does for this baseline.
      learn: add finished requests' EAMs to the collections (online).
      prefetch_limit: experts requested per prediction (None: the cache's slots, the paper's top-K).
      prefetch_at_start: predict at iteration start too (off: the first layer is never prefetched).
    """

    name = "moe_infinity"

    def __init__(
        self,
        *,
        capacity: int = 1000,
        eamc: Mapping[str, ActivationMatrixCollection] | None = None,
        learn: bool = True,
        prefetch_limit: int | None = None,
        prefetch_at_start: bool = True,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 EAM, got {capacity}")
        if prefetch_limit is not None and prefetch_limit < 0:
            raise ValueError(f"prefetch_limit must be >= 0, got {prefetch_limit}")
        if eamc is not None and set(eamc) != set(PHASES):
            raise ValueError(f"eamc must map {PHASES} to EAM collections, got keys {sorted(eamc)}")
        self.capacity = capacity
        self.collections = dict(eamc) if eamc is not None else None
        self.learn = learn
        self.prefetch_limit = prefetch_limit
        self.prefetch_at_start = prefetch_at_start
        self.timers = {"matching": 0.0}
        self.matches = 0
        self.similarity_sum = 0.0
        self.last_match: list[int] = []  # stored EAM matched per active request at the last prediction
        self._rows = 0
        self._iteration = 0  # iterations since the current requests began (0: prefill)
        self._eams: dict[str, np.ndarray] = {}  # phase -> [B, L, J]
        self._active = np.zeros(0, bool)
        self._wanted: dict[Key, float] = {}
        self._wanted_grid = np.zeros((0, 0))  # [L, J] `_wanted` as an array, NaN where not wanted

    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> MoEInfinity:
        """Starts from EAM collections of recorded requests (as the fMoE paper prepares this baseline); with
        no traces, from empty collections of `store_capacity` EAMs."""
        if traces:
            options["eamc"] = eamc_from_traces(traces, capacity=store_capacity)
        return cls(capacity=store_capacity, **options)

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        shape = (ctx.num_layers, ctx.num_experts)
        if self.collections is None:
            self.collections = {p: ActivationMatrixCollection(self.capacity, *shape) for p in PHASES}
        for phase, c in self.collections.items():
            if c.matrices.shape[1:] != shape:
                raise ValueError(
                    f"the {phase} EAM collection holds [L, J] = {list(c.matrices.shape[1:])}; the model "
                    f"has {list(shape)}"
                )
        self.layer_weight = 1.0 - np.arange(ctx.num_layers) / ctx.num_layers  # [L] early-layer boost
        self._begin(0)

    # -- requests ----------------------------------------------------------------------------------------
    def _begin(self, batch: int) -> None:
        self._finish()
        shape = (batch, self.ctx.num_layers, self.ctx.num_experts)
        self._eams = {p: np.zeros(shape) for p in PHASES}
        self._request_counts = np.zeros(shape[1:])  # [L, J] both phases, the whole batch
        self._rows, self._iteration = batch, 0
        self._want([])

    def _finish(self) -> None:
        """The current requests are over: their decode EAMs join the collection."""
        if self.learn and self._eams:
            for eam in self._eams["decode"]:
                self.collections["decode"].add(eam)
        self._eams = {}

    @property
    def phase(self) -> str:
        return "prefill" if self._iteration == 0 else "decode"

    def on_request_start(self, event: RequestStart) -> None:
        self._begin(event.batch)

    def on_iteration_start(self, event: IterationStart) -> None:
        valid = event.valid
        rows, tokens = valid.shape
        # Engines driven without `on_request_start` still start new requests with a multi-token prefill.
        if rows != self._rows or (tokens > 1 and self._iteration > 0):
            self._begin(rows)
        self._active = valid.any(axis=1)  # [B]
        self._want([])
        if self.prefetch_at_start:
            self._predict(-1)

    def on_layer_routed(self, event: LayerRouted) -> None:
        layer, valid = event.layer, event.valid
        rows, tokens = valid.shape
        chosen = event.ids.reshape(rows, tokens, -1)  # [B, T, k]
        eams = self._eams[self.phase]
        for b in np.flatnonzero(self._active):
            counts = np.bincount(chosen[b][valid[b]].ravel(), minlength=self.ctx.num_experts)  # [J]
            eams[b, layer] += counts
            self._request_counts[layer] += counts
        if layer + 1 < self.ctx.num_layers:
            self._predict(layer)
        else:  # nothing ahead in this iteration: drop what still waits
            self._want([])
            self.cache.request_prefetch([], replace=True)

    def on_iteration_end(self) -> None:
        if self.learn and self.phase == "prefill":
            for b in np.flatnonzero(self._active):
                self.collections["prefill"].add(self._eams["prefill"][b])
        self._iteration += 1
        self._want([])

    def close(self) -> None:
        self._finish()

    # -- prefetching -------------------------------------------------------------------------------------
    def predicted_activation(self, layer: int) -> np.ndarray:
        """Activation probabilities `[L, J]` from the EAMs matching the active requests after `layer`
        (-1: iteration start); zeros when the phase's collection is empty. Each row sums to 1 (or 0)."""
        collection = self.collections[self.phase]
        num_layers = self.ctx.num_layers
        self.last_match = []
        if not len(collection):
            return np.zeros((num_layers, self.ctx.num_experts))
        # A phase's first iteration has seen the layers up to `layer`; later ones have seen every layer.
        first = self._iteration <= (0 if self.phase == "prefill" else 1)
        observed = np.arange(num_layers) <= layer if first else np.ones(num_layers, bool)  # [L]
        total = np.zeros((num_layers, self.ctx.num_experts))
        for b in np.flatnonzero(self._active):
            if not observed.any():
                total += collection.mean()
                continue
            scores = collection.similarity(self._eams[self.phase][b], observed)  # [n]
            best = int(np.argmax(scores))
            self.last_match.append(best)
            self.matches += 1
            self.similarity_sum += float(scores[best])
            total += collection.stored[best]
        rows = total.sum(axis=1, keepdims=True)
        return np.divide(total, rows, out=np.zeros_like(total), where=rows > 0)

    def _predict(self, layer: int) -> None:
        start = time.perf_counter()
        num_layers = self.ctx.num_layers
        probs = self.predicted_activation(layer)  # [L, J]
        proximity = np.array([1.0 - (target - layer) / num_layers for target in range(layer + 1, num_layers)])
        later = probs[layer + 1 :]  # [L - l - 1, J]
        targets, experts = np.nonzero(later)
        priority = later[targets, experts] * proximity[targets]
        # Highest priority first, ties by (layer, expert); the first `limit`, less those of priority 0.
        limit = self.ctx.capacity if self.prefetch_limit is None else self.prefetch_limit
        order = np.lexsort((experts, targets, -priority))[:limit]
        order = order[priority[order] > 0]
        chosen = zip(targets[order].tolist(), experts[order].tolist(), priority[order].tolist(), strict=True)
        items = [((layer + 1 + t, e), p) for t, e, p in chosen]
        self._want(items)
        self.timers["matching"] += time.perf_counter() - start
        self.cache.request_prefetch(items, replace=True, stale_before=layer + 1)

    def _want(self, items: list[tuple[Key, float]]) -> None:
        """The experts the current prediction wants, with their prefetch priorities."""
        self._wanted = dict(items)
        if self._wanted_grid.shape != (self.ctx.num_layers, self.ctx.num_experts):
            self._wanted_grid = np.full((self.ctx.num_layers, self.ctx.num_experts), np.nan)
        else:
            self._wanted_grid.fill(np.nan)
        for key, priority in items:
            self._wanted_grid[key] = priority

    # -- caching -----------------------------------------------------------------------------------------
    def keep_score(self, key: Key, entry: Entry) -> float:
        wanted = self._wanted.get(key)
        if wanted is not None:
            return PROTECTED + wanted
        return float((self._request_counts[key] + 1.0) * self.layer_weight[key[0]])

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_score` of many experts at once (the same floats)."""
        wanted = self._wanted_grid[layers, experts]
        counted = (self._request_counts[layers, experts] + 1.0) * self.layer_weight[layers]
        return np.where(np.isnan(wanted), counted, PROTECTED + wanted)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        wanted = self._wanted.get(victim)
        return wanted is None or wanted < priority

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"eamc_{p}": len(c) for p, c in (self.collections or {}).items()}
        out["eam_matches"] = self.matches
        if self.matches:
            out["mean_match_similarity"] = self.similarity_sum / self.matches
        return out


def eamc_from_traces(
    traces: Iterable[Any], *, capacity: int, num_layers: int | None = None, num_experts: int | None = None
) -> dict[str, ActivationMatrixCollection]:
    """Prefill and decode EAM collections built from recorded `RoutingTrace`s, request by request in order
    (iteration 0 is the prefill, the rest the decode), for `MoEInfinity(eamc=..., learn=False)`."""
    traces = list(traces)
    if not traces:
        raise ValueError("eamc_from_traces needs at least one RoutingTrace")
    meta = traces[0].meta
    num_layers = num_layers or meta["num_layers"]
    num_experts = num_experts or meta["num_experts"]
    out = {p: ActivationMatrixCollection(capacity, num_layers, num_experts) for p in PHASES}
    for trace in traces:
        for request in trace.requests:
            eams = {p: np.zeros((num_layers, num_experts)) for p in PHASES}
            for i, it in enumerate(request.iterations):
                eam = eams["prefill" if i == 0 else "decode"]
                for layer in range(num_layers):
                    eam[layer] += np.bincount(it.ids[:, layer].ravel(), minlength=num_experts)
            for phase in PHASES:
                out[phase].add(eams[phase])
    return out
