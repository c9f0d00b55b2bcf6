"""ProMoE re-implemented in our runtime: learned per-layer predictors that look d layers ahead from the
current hidden state (Song et al., "ProMoE: Fast MoE-based LLM Serving using Proactive Caching", 2024,
arXiv 2410.22134). Also `PredictedPrefetch`, the cache rules it shares with `duoserve`.

The engine builds the policy from `OffloadConfig(policy=ProMoE(predictor=PATH))`; the predictors come from
`benchmarks/train_predictors.py` (`offload/predictors.py`). Everything runs inline on the engine thread, so
the live engine and the trace-replay simulator see the same prefetch requests.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted
from ..predictors import Predictor
from .base import Policy, PolicyContext

# Keep scores (higher is kept longer). Unpredicted experts score below 1 (the subclass orders them), an
# expert predicted for a layer still to come 1 + its urgency (urgency in (0, 1]), and a needed expert of
# the layer being served that it has not used yet 3: a prefetch never evicts what this layer is about to use.
_PREDICTED = 1.0
_NEEDED_NOW = 3.0


class PredictedPrefetch(Policy):
    """Prefetches experts a predictor names for layers still to come, and keeps them until their layer runs.

    Shared by the learned-predictor baselines (`promoe`, `duoserve`). Per iteration it tracks the layer
    being served (`current`), that layer's needed experts, and `want`: urgency in (0, 1] of each predicted
    expert of a later layer (prefetch priority and eviction rank alike). Two rules keep prefetching from
    costing hits:
      - eviction order: needed-now experts not yet used > predicted experts (by urgency) > the rest (ordered
        by `idle_keep`, ties least recently used);
      - admission: a prefetch may evict only an expert ranked below it, and only while enough slots of low
        rank remain for the current layer's misses still to load (so in a layer that runs in chunks, the
        next layer's prefetches start only as the last chunk's slots free up).

    Args:
      predictor: a trained `Predictor` or the path of one (`path.npz` + `path.json`).
      prefetch_k: experts prefetched per token and layer: the predictor's top-k (default: the model's k).
    """

    kind = ""

    def __init__(self, *, predictor: Predictor | str | os.PathLike, prefetch_k: int | None = None):
        if prefetch_k is not None and prefetch_k < 1:
            raise ValueError(f"prefetch_k must be >= 1, got {prefetch_k}")
        self.predictor_source = predictor
        self.prefetch_k = prefetch_k
        self.timers = {"prediction": 0.0}
        self.counts: collections.Counter = collections.Counter()
        self.current = -1
        self.want: dict[Key, float] = {}
        self.need: dict[Key, int] = {}  # needed experts of the current layer -> their use count at routing
        self.rows = np.zeros(0, bool)
        self.predicted: dict[int, set[int]] = {}
        self.recall_sum = 0.0

    def _load_predictor(self, ctx: PolicyContext, **check: Any) -> Predictor:
        source = self.predictor_source
        predictor = source if isinstance(source, Predictor) else Predictor.load(source)
        where = "the predictor" if isinstance(source, Predictor) else f"predictor {os.fspath(source)}"
        predictor.check(
            kind=self.kind,
            model_id=ctx.model_id,
            num_layers=ctx.num_layers,
            num_experts=ctx.num_experts,
            top_k=ctx.top_k,
            source=where,
            **check,
        )
        self.k = min(self.prefetch_k or ctx.top_k, ctx.num_experts)
        return predictor

    # -- per-iteration state -----------------------------------------------------------------------------
    def _start_iteration(self, valid: np.ndarray) -> None:
        self.rows = valid.reshape(-1).astype(bool)
        self.current = -1
        self.want.clear()
        self.need = {}
        self.predicted = {}

    def _routed(self, event: LayerRouted) -> None:
        """A layer has routed: its needed experts become the protected ones, its predictions expire."""
        layer, needed = event.layer, event.needed
        if layer in self.predicted and needed:
            self.recall_sum += len(self.predicted[layer] & set(needed)) / len(needed)
            self.counts["scored_layers"] += 1
        self.current = layer
        self.want = {key: u for key, u in self.want.items() if key[0] > layer}
        self.need = {(layer, e): self.cache.freq((layer, e)) for e in needed}

    def _end_iteration(self) -> None:
        self.current = self.ctx.num_layers
        self.want.clear()
        self.need = {}

    def _select(self, target: int, probs: np.ndarray, distance: int) -> list[tuple[Key, float]]:
        """Prefetches for layer `target` from per-token probabilities `[n, J]`: each token's top-k, an
        expert's score the mean over tokens of its probability where picked (so for prefill, experts many
        tokens need come first); urgency = score / distance. Highest urgency first."""
        if not probs.shape[0]:
            return []
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : self.k]  # [n, k]
        picked = np.zeros_like(probs)
        np.put_along_axis(picked, top, np.take_along_axis(probs, top, axis=-1), axis=-1)
        score = picked.mean(0) / distance  # [J]
        experts = np.flatnonzero(score > 0)
        experts = experts[np.argsort(-score[experts], kind="stable")]
        self.predicted[target] = set(experts.tolist())
        items = [((target, int(e)), float(score[e])) for e in experts]
        self.want.update(items)
        self.counts["predictions"] += 1
        self.counts["predicted_experts"] += len(items)
        return items

    def _predict(self, probs_fn: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        """`probs_fn(*args)`, timed as the policy's "prediction" overhead."""
        start = time.perf_counter()
        out = probs_fn(*args)
        self.timers["prediction"] += time.perf_counter() - start
        return out

    # -- eviction and admission --------------------------------------------------------------------------
    def idle_keep(self, key: Key, entry: Entry) -> float:
        """Rank, in [0, 1), of an expert neither needed now nor predicted (ties: least recently used)."""
        return 0.0

    def _waiting(self, key: Key) -> bool:
        """A needed expert of the current layer that the layer has not used yet."""
        uses = self.need.get(key)
        return uses is not None and self.cache.freq(key) == uses

    def keep_score(self, key: Key, entry: Entry) -> float:
        if self._waiting(key):
            return _NEEDED_NOW
        urgency = self.want.get(key)
        if urgency is not None:
            return _PREDICTED + urgency
        return self.idle_keep(key, entry)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        urgency = self.want.get(key)
        if urgency is None:  # its layer has run (the cache drops such requests, this is the last guard)
            return False
        if self.keep_score(victim, self.cache.entry(victim)) >= _PREDICTED + urgency:
            return False
        device = self.cache.device_of(victim)  # the device whose slot is at stake
        to_load = sum(
            1
            for k in self.need
            if self.cache.device_of(k) == device and self.cache.entry(k) is None and self._waiting(k)
        )
        if not to_load:
            return True
        low = sum(
            1
            for k, entry in self.cache.entries(near=victim)
            if k != victim and self.keep_score(k, entry) < _PREDICTED
        )
        return low + self.cache.free_slots(near=victim) >= to_load

    def stats(self) -> dict[str, Any]:
        out = dict(self.counts)
        if self.counts["scored_layers"]:
            out["predictor_recall"] = self.recall_sum / self.counts["scored_layers"]
        return out


class ProMoE(PredictedPrefetch):
    """ProMoE's learned predictors with stride prefetching, in the variant described below.

    Source: ProMoE (arXiv 2410.22134), its learned predictor and stride prefetching: "utilizes intermediate
    results to predict subsequent expert usage", predictors trained offline, prefetching `stride` layers
    ahead, plus chunked prefetching, early preemption and reordered inference. The paper's full text was not
    available to us (no section numbers, layer sizes or loss are taken from it); we worked from its abstract
    and published summaries. Variant implemented:
      - one small MLP per target MoE layer t (default one hidden layer of 128, ReLU, sigmoid outputs; trained
        with binary cross-entropy on recorded traces, `offload/predictors.py`), whose input is the router
        input (post-attention hidden state) of MoE layer t - d, d = `OffloadConfig.prefetch_distance` (the
        stride). After layer l routes, the policy predicts layer l + d and prefetches it.
      - layers t < d have no hidden state d layers earlier in the same iteration; their predictors read the
        token embedding (the input of the first layer) at iteration start, each looking t + 1 <= d layers
        ahead. This first-layer coverage is our choice; the paper's handling of the first layers is not
        reproduced here.
      - per token the predicted top-k experts are prefetched (the union over the batch, prefill included),
        priority p / distance; the predictions are never fed back as inputs (no iterative prediction).
      - not reproduced: the paper's chunked prefetching, early preemption and reordered inference are
        mechanisms of its transfer engine. Ours already loads on-demand misses ahead of queued prefetches
        (like early preemption) and computes resident experts first in chunked layers (like reordering).
      - eviction (not specified in what we reproduce): predicted experts of later layers are kept, the rest
        leave least recently used first (`PredictedPrefetch`).
    Why this variant: it needs only what our engine publishes (the router input per layer and the embedding),
    keeps predictor latency to a few small matrix products on the host, and is deterministic.

    Args:
      predictor: a `Predictor` of kind "promoe", or its path (from `benchmarks/train_predictors.py`); its
        stride must equal `prefetch_distance` and its model identity the served model's.
      prefetch_k: experts per token and layer to prefetch (default: the model's top-k).
    """

    name = "promoe"
    kind = "promoe"
    needs_semantic = True  # the embedding feeds the predictors of layers [0, d)
    needs_hidden = True

    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> ProMoE:
        """ProMoE with predictors trained on recorded traces (with hidden states), stride d; a
        `predictor` in `options` is used as it is."""
        if "predictor" not in options:
            from ..predictor_training import train_promoe

            options["predictor"] = train_promoe(traces, stride=prefetch_distance, progress=False)
        return cls(**options)

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        self.predictor = self._load_predictor(ctx, input_dim=ctx.embed_dim, stride=ctx.prefetch_distance)
        self.stride = ctx.prefetch_distance

    def on_iteration_start(self, event: IterationStart) -> None:
        self._start_iteration(event.valid)
        x = event.embeds[self.rows]  # [n, H]
        items = []
        for target in range(min(self.stride, self.ctx.num_layers)):
            probs = self._predict(self.predictor.probs, x, target)
            items += self._select(target, probs, target + 1)
        items.sort(key=lambda item: -item[1])
        self.cache.request_prefetch(items, replace=True)

    def on_layer_routed(self, event: LayerRouted) -> None:
        self._routed(event)
        layer = event.layer
        target = layer + self.stride
        if target >= self.ctx.num_layers:
            return
        probs = self._predict(self.predictor.probs, event.hidden[self.rows], target)
        items = self._select(target, probs, self.stride)
        self.cache.request_prefetch(items, replace=[target], stale_before=layer + 1)

    def on_iteration_end(self) -> None:
        self._end_iteration()
