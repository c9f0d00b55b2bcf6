"""Eviction by a forecast alone, counted: how much of the LRU-to-Belady gap each reuse forecast closes on
gpt-oss-20b's real routing, outside the policy (no prefetch, no guides, no popularity prior).

    python -m benchmarks.next_use_eviction [--requests 8] [--store-requests 40] [--budgets 0.125 0.25 0.5]

One cache of `budget` x all experts replays the validation requests in order (as `gap_analysis` part 1);
on a miss the resident expert with the lowest score goes (ties: least recently used). Scores at layer l of
iteration t: for the layers up to l, which have routed, the forecast's score given whether t used the expert;
for the later layers, its score before they route. Forecasts:
- "table": fMoE's online `ReuseForecast` (gap, recent share; no reuse hint: no store here), warmed on the
  store requests, for the horizon `auto_reuse_horizon` gives the cache;
- "learned h": `next_use.py`'s logistic heads (`FMoEOptions.learned_reuse`), fit on the store requests for
  reuse within h iterations;
- "distance": `distance.py`'s expected next-use distance (`FMoEOptions.reuse_distance`), its table fit on
  the store requests and learning on (no guides here: need 0).
The fMoE policy itself adds prefetching, the guides' need and the popularity prior on top: what a forecast
wins here is an upper bound on what it wins there (decision "learned reuse"). Writes
`results/next_use_eviction.{json,png}`.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from fmoe_jax.offload.policies.fiddler import expert_usage
from fmoe_jax.offload.policies.fmoe.distance import DistanceForecast, fit_counts
from fmoe_jax.offload.policies.fmoe.eviction import auto_reuse_horizon
from fmoe_jax.offload.policies.fmoe.forecast import ReuseForecast
from fmoe_jax.offload.policies.fmoe.next_use import LearnedReuseForecast, fit_next_use, log_popularity

from benchmarks import real_routing
from benchmarks.common import HelpFormatter, grouped_bars, print_table, save
from benchmarks.gap_analysis import replay_misses, used_sets

HORIZONS = (1, 2, 4)
NAME = "next_use_eviction"


def forecast_scores(forecast: ReuseForecast, used: np.ndarray) -> tuple[np.ndarray, ...]:
    """`[T, L, J]` each expert's score before its layer routes, and once it has, used or not; the forecast
    learns the request as it goes (and keeps what it learned for the next)."""
    pending, if_used, if_missed = (np.empty(used.shape) for _ in range(3))
    forecast.start_request()
    for t in range(used.shape[0]):
        forecast.begin_iteration()
        pending[t], if_used[t], if_missed[t] = forecast.scores, forecast._if_used, forecast._if_missed
        forecast.end_iteration(used[t])
    return pending, if_used, if_missed


def replay(requests: list[np.ndarray], slots: int, forecast: ReuseForecast) -> int:
    """Misses of one cache of `slots` experts over `requests` in order, evicting the lowest score."""
    num_layers, num_experts = requests[0].shape[1:]
    resident = np.zeros(num_layers * num_experts, bool)
    last = np.full(num_layers * num_experts, -1)
    step = misses = 0
    for used in requests:
        pending, if_used, if_missed = forecast_scores(forecast, used)
        for t in range(used.shape[0]):
            routed = np.where(used[t], if_used[t], if_missed[t]).ravel()
            for layer in range(num_layers):
                need = layer * num_experts + np.flatnonzero(used[t, layer])
                split = (layer + 1) * num_experts
                score = np.concatenate([routed[:split], pending[t].ravel()[split:]])
                for key in need[~resident[need]]:
                    misses += 1
                    if resident.sum() >= slots:
                        candidates = np.flatnonzero(resident)
                        candidates = candidates[~np.isin(candidates, need)]
                        resident[candidates[np.lexsort((last[candidates], score[candidates]))[0]]] = False
                    resident[key] = True
                last[need] = step
                step += 1
    return misses


def replay_distance(requests: list[np.ndarray], slots: int, forecast: DistanceForecast) -> int:
    """Misses of one cache of `slots` experts over `requests` in order, evicting the expert whose next use
    `forecast` expects furthest ahead (ties: least recently used)."""
    num_layers, num_experts = requests[0].shape[1:]
    resident = np.zeros(num_layers * num_experts, bool)
    last = np.full(num_layers * num_experts, -1)
    need = np.zeros((num_layers, num_experts))
    step = misses = 0
    for used in requests:
        forecast.start_request()
        for t in range(used.shape[0]):
            forecast.begin_iteration()
            for layer in range(num_layers):
                forecast.mark_used(layer, np.flatnonzero(used[t, layer]))
                keys = layer * num_experts + np.flatnonzero(used[t, layer])
                for key in keys[~resident[keys]]:
                    misses += 1
                    if resident.sum() >= slots:
                        candidates = np.flatnonzero(resident)
                        candidates = candidates[~np.isin(candidates, keys)]
                        score = forecast.keep_scores(candidates, need, layer)
                        resident[candidates[np.lexsort((last[candidates], score))[0]]] = False
                    resident[key] = True
                last[keys] = step
                step += 1
            forecast.end_iteration(used[t])
    return misses


def rows_for(
    store: list[np.ndarray],
    requests: list[np.ndarray],
    popularity: np.ndarray,
    budgets: list[float],
    top_k: int,
) -> list[dict[str, Any]]:
    """One row per budget and rule: the miss rate and the share of the LRU-to-Belady gap it closes."""
    num_layers, num_experts = requests[0].shape[1:]
    weights = {h: fit_next_use(store, popularity, h) for h in HORIZONS}
    counts = fit_counts(store)
    total = sum(int(u.sum()) for u in requests)
    rows = []
    for budget in budgets:
        slots = round(budget * num_layers * num_experts)
        auto = auto_reuse_horizon(slots, num_layers, top_k)
        table = ReuseForecast(num_layers, num_experts, horizon=auto)
        for used in store:
            forecast_scores(table, used)
        misses = {
            "lru": int(replay_misses(requests, slots, "lru").sum()),
            "belady": int(replay_misses(requests, slots, "belady").sum()),
            f"table (h {auto})": replay(requests, slots, table),
        }
        for h, w in weights.items():
            learned = LearnedReuseForecast(num_layers, num_experts, w, popularity, horizon=h)
            misses[f"learned h {h}"] = replay(requests, slots, learned)
        distance = DistanceForecast(num_layers, num_experts, top_k, counts)
        misses["distance"] = replay_distance(requests, slots, distance)
        lru, best = misses["lru"], misses["belady"]
        for rule, m in misses.items():
            rows.append(
                dict(budget=budget, rule=rule, miss_rate=m / total, gap_closed=(lru - m) / (lru - best))
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--requests", type=int, default=8, help="validation requests replayed (evenly spaced)"
    )
    parser.add_argument(
        "--store-requests", type=int, default=40, help="store requests fit on (evenly spaced)"
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    parser.add_argument("--routing-data", default=None, help="routing set (default: the shared gpt-oss-20b)")
    parser.add_argument("--out", default=str(real_routing.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    path = real_routing.data_path(args)
    store_trace = real_routing.load("store", path)
    meta = store_trace.meta
    shape = (meta["num_layers"], meta["num_experts"])
    popularity = log_popularity(expert_usage([store_trace]), shape, meta["top_k"])
    store = used_sets(real_routing.load("store", path, limit=args.store_requests))
    requests = used_sets(real_routing.load("validation", path, limit=args.requests))
    rows = rows_for(store, requests, popularity, args.budgets, meta["top_k"])
    print_table(rows)
    note = (
        f"{len(requests)} validation requests of gpt-oss-20b's routing "
        f"({sum(len(u) for u in requests):,} decode steps), counted (no simulator); forecasts fit or "
        f"warmed on {len(store)} store requests, popularity from all {len(store_trace.requests)}"
    )
    payload = dict(command=f"python -m benchmarks.{NAME}", note=note, rows=rows, args=vars(args))
    save(NAME, payload, args.out)
    panels = {
        f"{b:g}": {"gap_closed": {r["rule"]: r["gap_closed"] for r in rows if r["budget"] == b}}
        for b in args.budgets
    }
    grouped_bars(real_routing.Path(args.out) / f"{NAME}.png", "LRU-to-Belady gap closed, counted", panels)
    return payload


if __name__ == "__main__":
    main()
