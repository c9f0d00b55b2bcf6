"""A reuse forecast learned offline (`FMoEOptions.learned_reuse`): logistic models of whether a request uses
each expert again within the next `horizon` iterations, fit on recorded routing by `FMoE.from_traces` and used
by fMoE's eviction in place of the online count tables' scores (`LearnedReuseForecast`).

Why: the count tables bin a few coarse features and learn them online from the request being served; a model
fit on a whole store of requests can afford finer features (the gap since last use to 32 iterations, uses in
the last 1 to 32 iterations, the request's position, the expert's popularity) at the price of one small
matrix product per iteration. Decision "learned reuse".

Letters: T iterations, L MoE layers, J experts per layer, F features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .forecast import ReuseForecast

# Gap bins (iterations since the request last used the expert): 0, 1, 2, 3, 4, 5-6, 7-9, 10-15, 16-31, 32+,
# and "never" its own bin. The online counter is held at `_CAP` (32+) or `_NEVER`; `_GAP_BIN` maps it to its
# bin.
GAP_EDGES = np.array([1, 2, 3, 4, 5, 7, 10, 16, 32])
WINDOWS = (1, 2, 4, 8, 16, 32)  # uses in the last w iterations, as a share of them
_CAP, _NEVER = 32, 33


def gaps_since_use(used: np.ndarray) -> np.ndarray:
    """`[T, L, J]` bool uses -> each step's iterations since the expert's last use before it, capped at
    `_CAP` (`_NEVER`: not used yet)."""
    gap = np.empty(used.shape, np.int64)
    since = np.full(used.shape[1:], _NEVER, np.int64)
    for step in range(len(used)):
        gap[step] = since
        since = np.where(since < _CAP, since + 1, since)
        since[used[step]] = 0
    return gap


_GAP_BIN = np.append(np.searchsorted(GAP_EDGES, np.arange(_CAP + 1), side="right"), len(GAP_EDGES) + 1)
GAP_BINS = len(GAP_EDGES) + 2
NUM_FEATURES = GAP_BINS + len(WINDOWS) + 4  # + share of the request so far, position, popularity, bias
# The three heads of a model: P(reuse | features) before the expert's layer routes in the iteration, and
# after, given that the iteration used it or did not.
HEADS = ("pending", "used", "missed")
ROWS_PER_HEAD = 400_000  # training rows sampled per head (the fit's cost is linear in them)


def feature_matrix(
    gap_bin: np.ndarray, windows: np.ndarray, share: np.ndarray, iteration: np.ndarray, popularity: np.ndarray
) -> np.ndarray:
    """Features `[..., F]` from each expert's gap bin `[...]`, window shares `[..., len(WINDOWS)]`, share of
    the request's iterations `[...]`, the iteration's index in the request (broadcast) and the log popularity
    (broadcast)."""
    shape = gap_bin.shape
    columns = [
        np.eye(GAP_BINS, dtype=np.float32)[gap_bin],
        windows.astype(np.float32),
        share.astype(np.float32)[..., None],
        np.broadcast_to(np.log1p(iteration) / 6.0, shape)[..., None].astype(np.float32),
        np.broadcast_to(popularity, shape)[..., None].astype(np.float32),
        np.ones((*shape, 1), np.float32),
    ]
    return np.concatenate(columns, axis=-1)


def log_popularity(counts: np.ndarray | None, shape: tuple[int, int], top_k: int) -> np.ndarray:
    """`[L, J]` the log of each expert's share of a token's routing relative to uniform routing (0 without
    counts: every expert uniform)."""
    if counts is None or not np.asarray(counts).any():
        return np.zeros(shape)
    counts = np.asarray(counts, np.float64)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0) * shape[1] / top_k
    return np.log(share + 1e-3)


def request_features(used: np.ndarray, popularity: np.ndarray) -> np.ndarray:
    """`[T, L, J, F]` what the forecast knows of each expert as each iteration of a request starts (`used`
    `[T, L, J]` bool: the experts each iteration used)."""
    return feature_matrix(*request_parts(used, popularity))


def request_parts(used: np.ndarray, popularity: np.ndarray) -> tuple[np.ndarray, ...]:
    """`request_features`' arguments of `feature_matrix`, each `[T, L, J, ...]`."""
    steps = used.shape[0]
    cumulative = np.concatenate([np.zeros((1, *used.shape[1:])), np.cumsum(used, axis=0)])  # uses in [0, t)
    t = np.arange(steps)
    windows = np.stack(
        [
            (cumulative[t] - cumulative[np.maximum(t - w, 0)])
            / np.maximum(np.minimum(t, w), 1)[:, None, None]
            for w in WINDOWS
        ],
        axis=-1,
    )
    gap = gaps_since_use(used)
    share = cumulative[t] / np.maximum(t, 1)[:, None, None]
    position = np.broadcast_to(t[:, None, None], used.shape)
    popularity = np.broadcast_to(popularity, used.shape)
    return _GAP_BIN.take(gap), windows, share, position, popularity


def reused_within(used: np.ndarray, horizon: int) -> np.ndarray:
    """`[T - horizon, L, J]` whether each expert is used in the `horizon` iterations after each iteration."""
    steps = used.shape[0] - horizon
    out = np.zeros((steps, *used.shape[1:]), bool)
    for ahead in range(1, horizon + 1):
        out |= used[ahead : ahead + steps]
    return out


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-4, steps: int = 30) -> np.ndarray:
    """Weights `[F]` of a logistic regression of `y` `[N]` on `x` `[N, F]`, by Newton's method with a ridge of
    `ridge` per row (which keeps a feature no row varies at 0)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    weights = np.zeros(x.shape[1])
    penalty = ridge * len(y) * np.eye(x.shape[1])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ weights)))
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hessian, x.T @ (p - y) + penalty @ weights)
        weights -= step
        if np.abs(step).max() < 1e-6:
            break
    return weights


def used_sets(traces: Sequence[Any]) -> list[np.ndarray]:
    """Per recorded request, `[T, L, J]` bool: the experts each iteration used (any of its tokens)."""
    out = []
    for trace in traces:
        layers, experts = int(trace.meta["num_layers"]), int(trace.meta["num_experts"])
        for request in trace.requests:
            used = np.zeros((len(request.iterations), layers, experts), bool)
            for step, iteration in enumerate(request.iterations):
                ids = np.asarray(iteration.ids)  # [t, L, k]
                for layer in range(layers):
                    used[step, layer, ids[:, layer].ravel()] = True
            out.append(used)
    return out


def fit_next_use(
    requests: Sequence[np.ndarray], popularity: np.ndarray, horizon: int, seed: int = 0
) -> np.ndarray:
    """Weights `[F, 3]` of the three heads (`HEADS`) for reuse within `horizon` iterations, from recorded
    requests' `used_sets`; `ROWS_PER_HEAD` rows of each head sampled evenly over the requests."""
    rng = np.random.default_rng(seed)
    long_enough = [u for u in requests if u.shape[0] > horizon]
    if not long_enough:
        raise ValueError(f"no recorded request is longer than the reuse horizon ({horizon} iterations)")
    rows = max(1, ROWS_PER_HEAD // len(long_enough))
    xs: dict[str, list[np.ndarray]] = {head: [] for head in HEADS}
    ys: dict[str, list[np.ndarray]] = {head: [] for head in HEADS}
    for used in long_enough:
        flat = [part.reshape(-1, *part.shape[3:]) for part in request_parts(used, popularity)]
        y = reused_within(used, horizon).ravel()
        now = used[: used.shape[0] - horizon].ravel()
        for head, mask in (("pending", None), ("used", now), ("missed", ~now)):
            index = np.arange(len(y)) if mask is None else np.flatnonzero(mask)
            pick = rng.choice(index, min(rows, len(index)), replace=False) if len(index) else index
            xs[head].append(feature_matrix(*(part[pick] for part in flat)))
            ys[head].append(y[pick])
    return np.stack([fit_logistic(np.concatenate(xs[h]), np.concatenate(ys[h])) for h in HEADS], axis=1)


class LearnedReuseForecast(ReuseForecast):
    """`ReuseForecast` whose scores come from offline-fit logistic heads (`fit_next_use`): before an expert's
    layer routes, the "pending" head; after, the "used" or "missed" head (`mark_used`, `refresh`). The count
    tables still learn (the calibration reads their recency bins); the reuse hint is not a feature."""

    def __init__(
        self, num_layers: int, num_experts: int, weights: np.ndarray, popularity: np.ndarray, *, horizon: int
    ):
        if weights.shape != (NUM_FEATURES, len(HEADS)):
            raise ValueError(f"next-use weights are {weights.shape}, expected {(NUM_FEATURES, len(HEADS))}")
        self.weights, self.log_popularity = weights, popularity
        super().__init__(num_layers, num_experts, horizon=horizon)

    def start_request(self) -> None:
        shape = self.shape
        self._gap = np.full(shape, _NEVER, np.int64)
        self._recent = np.zeros((WINDOWS[-1], *shape), bool)  # the last iterations' uses, a ring
        self._windows = np.zeros((*shape, len(WINDOWS)))  # uses in each window
        self._uses = np.zeros(shape)
        self._predict(0)
        super().start_request()

    def _predict(self, iteration: int) -> None:
        """Each head's probability `[L, J]` for the iteration about to start."""
        seen = np.array([max(min(iteration, w), 1) for w in WINDOWS], np.float64)
        share = self._uses / max(iteration, 1)
        gap = _GAP_BIN.take(self._gap)
        x = feature_matrix(gap, self._windows / seen, share, iteration, self.log_popularity)
        p = 1.0 / (1.0 + np.exp(-(x @ self.weights)))  # [L, J, 3]
        self._learned = p[..., 0], p[..., 1], p[..., 2]

    def _score(self, hint: np.ndarray | None) -> np.ndarray:
        bins = super()._score(hint)
        self.scores, self._if_used, self._if_missed = (a.copy() for a in self._learned)
        return bins

    def end_iteration(self, used: np.ndarray) -> None:
        used = np.asarray(used, bool)
        slot = self.iteration % WINDOWS[-1]
        self._uses += used
        for column, w in enumerate(WINDOWS):  # the iteration w back leaves window w as this one joins it
            leaving = self._recent[(self.iteration - w) % WINDOWS[-1]] if self.iteration >= w else False
            self._windows[..., column] += used.astype(np.float64) - leaving
        self._recent[slot] = used
        self._gap = np.where(self._gap < _CAP, self._gap + 1, self._gap)
        self._gap[used] = 0
        self._predict(self.iteration + 1)
        super().end_iteration(used)


class NextUseTraining:
    """What `FMoE.from_traces(learned_reuse=True)` learns from: the recorded requests' `used_sets` and their
    experts' popularity; `forecast` fits the heads for a horizon once (a policy bound again beside a cache
    of another size fits again) and makes the forecast."""

    def __init__(self, traces: Sequence[Any], counts: np.ndarray):
        meta = traces[0].meta
        self.shape = (int(meta["num_layers"]), int(meta["num_experts"]))
        self.requests = used_sets(traces)
        self.popularity = log_popularity(counts, self.shape, int(meta["top_k"]))
        self._weights: dict[int, np.ndarray] = {}

    def __deepcopy__(self, memo: dict) -> NextUseTraining:
        # What the traces teach is shared, not copied: copies of a policy built once from the traces (the
        # experiments' fresh copy per run) then fit each horizon once between them.
        return self

    def forecast(self, horizon: int) -> LearnedReuseForecast:
        if horizon not in self._weights:
            self._weights[horizon] = fit_next_use(self.requests, self.popularity, horizon)
        return LearnedReuseForecast(*self.shape, self._weights[horizon], self.popularity, horizon=horizon)
