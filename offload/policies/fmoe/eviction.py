"""fMoE's eviction: which resident expert a miss or a prefetch replaces. The paper keeps the highest
p * freq; ours by default ("reuse") keeps the experts most likely needed soon: later in this iteration (a
guide's need probability), in the next iterations (the reuse forecast, from the request's own routing and a
reuse hint), or in any token (the experts' popularity). A prefetch evicts only an expert worth less than the
one it brings, net of what a wrong copy costs.
Decisions "reuse horizon", "popularity prior", "prefetch against its victim", "eviction rule".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...cache import CacheView, Entry, Key
from ...predictors import Predictor
from .distance import DistanceForecast
from .forecast import ReuseForecast
from .guides import Guides
from .select import keep_priority

# `reuse_horizon="auto"` looks at most this many iterations ahead (`auto_reuse_horizon`).
MAX_AUTO_HORIZON = 4


def auto_reuse_horizon(capacity: int, num_layers: int, top_k: int) -> int:
    """The reuse forecast's horizon for a cache of `capacity` experts: ceil(capacity / (L * k)) + 1
    iterations, at most `MAX_AUTO_HORIZON`. A layer's slots hold the experts of about slots / k tokens, so an
    expert the cache could evict is one that, unused, would fall out within that many tokens anyway; the
    forecast should tell the experts used again before then from the rest, and a bigger cache needs to look
    further ahead to do so (Belady's foresight, issue 16). Decision "reuse horizon"."""
    per_layer = -(-capacity // (num_layers * top_k))  # ceil, in integers
    return int(min(MAX_AUTO_HORIZON, per_layer + 1))


class Popularity:
    """Tokens routed to each expert `[L, J]` (`counts`): a given profile, or else what a loaded store saved
    plus every token served (`counting`). `rate` is each expert's share of a token's routing above uniform
    routing (top_k / J), scaled to [0, 1]: an expert routed no more often than any other says nothing about
    reuse. None while nothing is counted (or with popularity=False). Decision "popularity prior"."""

    def __init__(
        self, given: np.ndarray | bool | None, saved: object, num_layers: int, num_experts: int, top_k: int
    ):
        shape = (num_layers, num_experts)
        self.top_k, self.num_experts = top_k, num_experts
        self.counts: np.ndarray | None = None
        self.counting = given is None
        if isinstance(given, np.ndarray):
            if given.shape != shape:
                raise ValueError(
                    f"fmoe's popularity profile is {given.shape} but the model has {shape} (MoE "
                    "layers, experts): profile requests of this model"
                )
            self.counts = given.copy()
        elif given is None:
            self.counts = np.zeros(shape) if np.shape(saved) != shape else np.asarray(saved, np.float64)
        self.rate: np.ndarray | None = None
        self.unlikely: np.ndarray | None = None  # [L, J] 1 - rate: eviction's "anytime" factor
        self.update()

    def count_layer(self, layer: int, ids: np.ndarray, token_valid: np.ndarray) -> None:
        """A routed layer of several tokens (one token's experts are counted at the iteration's end)."""
        if self.counting and len(ids) > 1:
            routed = np.asarray(ids)[token_valid].ravel()
            self.counts[layer] += np.bincount(routed, minlength=self.num_experts)

    def end_iteration(self, used: np.ndarray, tokens: int) -> None:
        """The iteration's end: a lone token's experts (`used` `[L, J]`, one count each) join the counts."""
        if self.counting:
            if tokens == 1:
                self.counts += used
            self.update()

    def update(self) -> None:
        if self.counts is None or not self.counts.any():
            return
        total = self.counts.sum(axis=1, keepdims=True)
        share = self.top_k * self.counts / np.maximum(total, 1.0)
        uniform = self.top_k / self.num_experts
        self.rate = np.minimum(np.maximum((share - uniform) / (1.0 - uniform), 0.0), 1.0)  # np.clip's
        self.unlikely = 1.0 - self.rate  # once per iteration


class PredictedReuse:
    """The reuse hint from a learned predictor (decision "reuse predictor"), after each layer: the chance each
    expert is used by any active row in the iterations after this one, from each row's last token's router
    input at the layers routed so far (their mean log-odds: an early layer alone says little)."""

    def __init__(self, predictor: Predictor, num_layers: int, num_experts: int):
        self.predictor, self.shape = predictor, (num_layers, num_experts)
        self._logits: np.ndarray | None = None  # the sum of this iteration's log-odds
        self._predicted = 0  # the layers whose predictions `_logits` sums

    def begin_iteration(self) -> None:
        self._predicted = 0

    def predict(self, hidden: np.ndarray, layer: int) -> np.ndarray:  # [rows, D] -> [L, J]
        logits = self.predictor.logits(hidden, layer)  # [rows, L * J]
        if self._predicted and self._logits is not None and self._logits.shape == logits.shape:
            self._logits += logits
            self._predicted += 1
        else:  # the iteration's first prediction
            self._logits, self._predicted = logits, 1
        p = 0.5 * (np.tanh(0.5 / self._predicted * self._logits) + 1.0)  # the sigmoid of the mean
        # Used by any row. (One row: its own p, which bins as 1 - (1 - p) does: they differ below 1e-9.)
        hint = p[0].astype(np.float64) if len(p) == 1 else 1.0 - np.prod(1.0 - p.astype(np.float64), axis=0)
        return hint.reshape(self.shape)


class Eviction:
    """Keep scores (higher is kept longer) and prefetch admission against a victim, by the rule of
    `FMoEOptions.eviction`.

    Args:
      rule: "reuse", "fmoe", "lfu" or "lru".
      cache: what the policy sees of the cache (frequencies).
      guides: the iteration's guides (need probabilities, latest map probabilities).
      forecast: the reuse forecast of the next iterations.
      popularity: the experts' popularity.
      price: what a wrong prefetch of a layer's expert costs, in need probability (`Admission.price`).
      distance: ranks the victims by expected next-use distance instead (`reuse_distance`); admission
        still compares keep scores.
    """

    def __init__(
        self,
        rule: str,
        cache: CacheView,
        guides: Guides,
        forecast: ReuseForecast,
        popularity: Popularity,
        price: Callable[[int], float],
        distance: DistanceForecast | None = None,
    ):
        self.rule, self.cache, self.guides = rule, cache, guides
        self.forecast, self.popularity, self.price = forecast, popularity, price
        self.distance = distance
        # `table`, kept until the policy's state may change (`stale`); None: computed at each use. Its
        # version changes only when a table computed afresh differs from the last (`refusal_stamp`).
        self._table: np.ndarray | None = None
        self._last: tuple[np.ndarray, int] = (np.zeros(0), 0)
        self.keeps_table = False  # whether `_table` is kept: only where the policy says when to drop it

    def keep_score(self, key: Key, entry: Entry) -> float:
        """ "reuse": the probability the expert is needed soon: later in this iteration (its need probability,
        for a layer still to route) or in the next iterations (the reuse forecast) or in any token (its
        popularity, when profiled), combined as independent chances. "fmoe": the paper's p * freq."""
        if self.rule == "lru":
            return float(entry.last_use)
        if self.rule == "lfu":
            return float(self.cache.freq(key))
        layer, expert = key
        if self.rule == "fmoe":
            return float(keep_priority(self._latest_p(layer, expert), self.cache.freq(key)))
        return self.reuse_score(layer, expert)

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_score` of the resident experts `(layers[i], experts[i])`, as one array expression for
        "reuse"."""
        table = self._table  # kept: "reuse", ranked by keep score
        if table is not None:
            return table.take(layers * table.shape[1] + experts)
        if self.rule == "fmoe":  # `keep_priority` once over the candidates: the same doubles as per key
            latest = np.where(self.guides.latest[layers], self.guides.latest_p[layers, experts], 0.0)
            keys = zip(layers.tolist(), experts.tolist(), strict=True)
            return keep_priority(latest, np.array([self.cache.freq(key) for key in keys], np.float64))
        if self.rule != "reuse":
            keys = zip(layers.tolist(), experts.tolist(), strict=True)
            return np.array([self.keep_score(key, self.cache.entry(key)) for key in keys], np.float64)
        flat = layers * self.guides.need.shape[1] + experts  # layer * J + expert
        if self.distance is not None:
            return self.distance.keep_scores(flat, self.guides.need, self.guides.current)
        return self._kept_table().take(flat)

    def _kept_table(self) -> np.ndarray:
        table = self.table()
        if self.keeps_table:
            self._table = table
        return table

    def refusal_stamp(self, key: Key) -> tuple | None:
        """`Policy.refusal_stamp`: ("reuse", with the table kept, victims ranked by keep score: not by
        `distance`) the key, its bar (`admit_prefetch`) and the table's version (a table equal to the last
        versioned one takes its place and version), and this."""
        if self.rule != "reuse" or not self.keeps_table or self.distance is not None:
            return None
        table = self._table if self._table is not None else self._kept_table()
        last, version = self._last
        if table is not last:
            if table.tobytes() == last.tobytes():  # the same doubles (so the same victims): cheaper to copy
                self._table = table = last
            else:
                self._last = (table, version + 1)
        return key, table.item(key) - self.price(key[0]), self, self._last[1]  # (a rebound policy's own)

    def ask(self, request: Callable[..., None], *args: Any, **how: Any) -> None:
        """A call of the policy's to the cache (`request_prefetch`, `drop_prefetches`): its victim searches
        score the policy's state as it is now."""
        self.stale()
        request(*args, **how)

    def stale(self) -> None:
        """The policy's state may have changed: the next `keep_scores` computes the table afresh. The policy
        calls it at the end of each of its events and before each call it makes to the cache (one thread:
        matching inline), so that between them the cache's victim searches share one table."""
        self._table = None

    def table(self) -> np.ndarray:  # [L, J]
        """The "reuse" `keep_score` of every expert, as one array expression: whole-array operations cost less
        than gathering the candidates' inputs first, and give each element the same double."""
        now = self.guides.need  # at each layer's next routing: this iteration's, or the next's
        stays = (1.0 - now) * (1.0 - self.forecast.scores)  # not needed now, nor in the next iterations
        if self.popularity.rate is not None:
            stays *= self.popularity.unlikely  # nor in any token
        return 1.0 - stays

    def reuse_score(self, layer: int, expert: int) -> float:
        if self._table is not None:  # kept since the policy's last change: the same double
            return self._table.item(layer, expert)
        now = self.guides.need[layer, expert]
        later = 1.0 - self.forecast.scores[layer, expert]
        anytime = 1.0 if self.popularity.rate is None else self.popularity.unlikely[layer, expert]
        return float(1.0 - (1.0 - now) * later * anytime)

    def admit_prefetch(self, key: Key, victim: Key) -> bool:
        """A prefetch evicts only an expert worth less than the one it brings ("reuse": both scored as they
        would be once resident, the incoming one less its price: a wrong copy costs that share of its link
        time in on-demand waits, on top of the victim's misses)."""
        if self.rule in ("lru", "lfu"):
            return True
        layer, expert = key
        if self.rule == "fmoe":
            incoming = float(keep_priority(self._latest_p(layer, expert), self.cache.freq(key)))
            return self.keep_score(victim, self.cache.entry(victim)) < incoming
        return self.reuse_score(*victim) < self.reuse_score(layer, expert) - self.price(layer)

    def _latest_p(self, layer: int, expert: int) -> float:
        return self.guides.latest_p[layer, expert] if self.guides.latest[layer] else 0.0
