"""How much can eviction know about reuse? Forecasts of each expert's use in the next two decode iterations,
from each set of features fMoE could use, against a forecast that knows the next token's routing.

    python -m benchmarks.reuse_forecast [--split validation] [--model NAME ...]

fMoE's eviction (`offload/policies/fmoe/forecast.py`, `ReuseForecast`) ranks resident experts by the
probability that the request needs them within the next two iterations, from binned counts over the iterations
since the
expert's last use (gap), its decayed share of iterations (share) and the reuse hint (what followed the
stored maps most like the last token's; `ExpertMapStore.future_of`). This script replays the recorded
routing of the prompts (the validation split by default: no evaluation prompt is seen) outside the
simulator, collects those features and the outcomes for every (iteration, layer, expert), fits each
forecast on the first half of the requests and scores it on the second half:

- auc: the chance a reused expert scores above one that is not (ranking is what eviction uses);
- log_loss: of the probabilities (calibration);
- next_token_hit: of the experts the next iteration uses, the share among the top `--budget` of all
  experts by score (a cache refilled from the forecast at each iteration).

The last rows are ceilings: the same counts given the next iteration's routing itself (what Belady with
one token of foresight knows). The distance between fMoE's forecast and that ceiling is what better
prediction could still win for eviction; the rows between them say how much of it each extra feature wins.
Prints the tables and writes `results/reuse_forecast.{json,png}`.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
from fmoe_jax.offload.policies.fmoe import HINT_NEIGHBOURS

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, grouped_bars, print_table, save

# Iterations since the expert's last use; "never used by the request" is its own bin (`GAP_NEVER`).
GAP_NEVER = 10**6
DECAY = 0.8  # `ReuseForecast`'s share decay
SLOW_DECAY = 0.97  # the long share's (`ReuseForecast`'s sticky feature, `FMoEOptions.sticky`)
HORIZON = 2  # iterations ahead (`FMoE(reuse_horizon="auto")` looks 2-4 ahead, by the cache's size)
# The store here holds every store prompt's followers from the start; the simulator's fmoe records them only
# for the requests it serves. (Recording them offline too changed its simulated TPOT by 0.98-1.03x, 1.000x
# in geometric mean over the validation grid: the hint was already as good as the followers allow.)


def collect(workload: h.Workload, neighbours: int) -> dict[str, np.ndarray]:
    """Features and outcomes `[N, L*J]`, one row per decode iteration t of each replayed request that has
    two iterations after it. Features are what the policy knows as t starts, plus (`hint_now`, `used_now`)
    what it knows once t has routed. The store starts from the store prompts and learns each replayed request
    after it, as fMoE's does online."""
    from fmoe_jax.offload.policies.fmoe.store import ExpertMapStore

    meta = workload.store[0].trace.meta
    layers, experts = meta["num_layers"], meta["num_experts"]
    store = ExpertMapStore(
        capacity=workload.args.store_capacity,
        num_layers=layers,
        num_experts=experts,
        embed_dim=meta["embed_dim"] or 1,  # routing without embeddings: one zero column
        prefetch_distance=min(workload.args.prefetch_distance, layers),
    )
    for request in workload.store:
        learn(store, request.trace.requests[0].iterations)
    rows: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for number, request in enumerate(workload.eval):
        iterations = request.trace.requests[0].iterations
        used = [routed(it.ids, experts) for it in iterations]  # [T][L, J]
        last_use = np.full((layers, experts), -1)
        share = np.zeros((layers, experts))
        slow = np.zeros((layers, experts))
        hint = None  # what followed maps like the previous iteration's last token: a forecast of this one
        for t, iteration in enumerate(iterations):
            hint_now = store.future_of(iteration.probs[-1:], neighbours)[0]  # forecast of t + 1
            if 1 <= t < len(iterations) - HORIZON:
                gap = np.where(last_use < 0, GAP_NEVER, t - 1 - last_use)
                rows["gap"].append(gap)
                rows["share"].append(share)
                rows["slow_share"].append(slow / max(1.0 - SLOW_DECAY**t, 1e-9))
                rows["hint"].append(hint)
                rows["hint_now"].append(hint_now)
                rows["used_now"].append(used[t])
                rows["used_next"].append(used[t + 1])
                rows["reused"].append(np.logical_or.reduce(used[t + 1 : t + 1 + HORIZON]))
                rows["layer"].append(np.broadcast_to(np.arange(layers)[:, None], (layers, experts)))
                rows["request"].append(np.full((layers, experts), number))
            hint = hint_now
            last_use = np.where(used[t], t, last_use)
            share = DECAY * share + (1 - DECAY) * used[t]
            slow = SLOW_DECAY * slow + (1 - SLOW_DECAY) * used[t]
        learn(store, iterations)
    return {k: np.stack(v).reshape(len(v), -1) for k, v in rows.items()}


def routed(ids: np.ndarray, experts: int) -> np.ndarray:  # [t, L, k] -> [L, J] bool
    used = np.zeros((ids.shape[1], experts), bool)
    for layer in range(ids.shape[1]):
        used[layer, np.unique(ids[:, layer])] = True
    return used


def learn(store: Any, iterations: list[Any]) -> None:
    """Adds a request's maps to the store in token order, each recorded as a follower of the `HORIZON`
    tokens before it (what `FMoE._learn` does as it serves)."""
    recent: collections.deque[int] = collections.deque(maxlen=HORIZON)
    for iteration in iterations:
        for slot, token_map in zip(
            store.add(embeds(iteration), iteration.probs), iteration.probs, strict=True
        ):
            if recent:
                store.add_future(np.fromiter(recent, np.int64), np.repeat(token_map[None], len(recent), 0))
            recent.append(int(slot))


def embeds(iteration: Any) -> np.ndarray:
    """The iteration's embeddings, or one zero column per token where the routing has none."""
    if iteration.embeds is not None:
        return iteration.embeds
    return np.zeros((len(iteration.probs), 1), np.float32)


def binned(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The policy's bins (`offload/policies/fmoe/forecast.py`) of each feature."""
    from fmoe_jax.offload.policies.fmoe.forecast import GAP_EDGES, P_EDGES, SHARE_EDGES

    gap = np.where(
        data["gap"] == GAP_NEVER, len(GAP_EDGES) + 1, np.searchsorted(GAP_EDGES, data["gap"], side="right")
    )
    return {
        "gap": gap,
        "share": np.searchsorted(SHARE_EDGES, data["share"]),
        "slow_share": np.searchsorted(SHARE_EDGES, data["slow_share"]),
        "hint": np.searchsorted(P_EDGES, data["hint"]),
        "hint_now": np.searchsorted(P_EDGES, data["hint_now"]),
        "used_now": data["used_now"].astype(np.int64),
        "used_next": data["used_next"].astype(np.int64),
        "layer": data["layer"],
    }


def table_forecast(bins: list[np.ndarray], reused: np.ndarray, train: np.ndarray) -> np.ndarray:
    """Counts per joint bin on the training rows, smoothed by one pseudo-observation at the base rate."""
    index = np.zeros_like(bins[0])
    for b in bins:
        index = index * (int(b.max()) + 1) + b
    size = int(index.max()) + 1
    seen = np.bincount(index[train].ravel(), minlength=size)
    hits = np.bincount(index[train].ravel(), reused[train].ravel().astype(float), minlength=size)
    return (hits[index] + reused[train].mean()) / (seen[index] + 1.0)


def logistic_forecast(
    data: dict[str, np.ndarray], bins: dict[str, np.ndarray], train: np.ndarray, *, routed: bool = True
) -> np.ndarray:
    """A logistic model over every feature the policy has once the iteration has routed: gap (one-hot), share
    and its square, the log of both hints, the current routing, the layer (one-hot), and gap and share
    crossed with the hint. Fit by Newton's method with a small ridge."""
    gap = np.eye(int(bins["gap"].max()) + 1)[bins["gap"]]
    log_hint = np.log(data["hint"] + 1e-3)[..., None]
    share = data["share"][..., None]
    columns = [gap, share, share**2, log_hint, np.eye(int(bins["layer"].max()) + 1)[bins["layer"]]]
    columns += [gap * log_hint, share * log_hint, np.ones_like(share)]
    if routed:
        columns += [np.log(data["hint_now"] + 1e-3)[..., None], data["used_now"][..., None].astype(float)]
    features = np.concatenate(columns, axis=-1)  # [N, L*J, F]
    x, y = features[train].reshape(-1, features.shape[-1]), data["reused"][train].ravel().astype(float)
    weights = np.zeros(x.shape[1])
    ridge = 1e-3 * len(y) * np.eye(x.shape[1])
    for _ in range(25):
        p = 1.0 / (1.0 + np.exp(-(x @ weights)))
        step = np.linalg.solve(x.T @ (x * (p * (1 - p))[:, None]) + ridge, x.T @ (p - y) + ridge @ weights)
        weights -= step
        if np.abs(step).max() < 1e-6:
            break
    return 1.0 / (1.0 + np.exp(-(features @ weights)))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve, ties counted half (Mann-Whitney U)."""
    scores, labels = scores.ravel(), labels.ravel().astype(bool)
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # average rank of each tie group, from 1
    positives = labels.sum()
    return float(
        (ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * (len(labels) - positives))
    )


def score(
    forecast: np.ndarray, data: dict[str, np.ndarray], test: np.ndarray, budget: float
) -> dict[str, float]:
    reused, used_next = data["reused"][test], data["used_next"][test]
    p = np.clip(forecast[test], 1e-4, 1 - 1e-4)
    top = np.argsort(-forecast[test], axis=1, kind="stable")[:, : max(1, round(budget * forecast.shape[1]))]
    kept = np.take_along_axis(used_next, top, axis=1).sum()
    return {
        "auc": auc(forecast[test], reused),
        "log_loss": float(-np.where(reused, np.log(p), np.log(1 - p)).mean()),
        "next_token_hit": float(kept / used_next.sum()),
    }


def evaluate(data: dict[str, np.ndarray], budget: float) -> list[dict[str, Any]]:
    requests = data["request"][:, 0]
    train = requests < np.median(np.unique(requests))  # the first half of the requests
    test = ~train
    b, reused = binned(data), data["reused"]
    forecasts = {
        "gap, share": table_forecast([b["gap"], b["share"]], reused, train),
        "gap, share, hint (fmoe)": table_forecast([b["gap"], b["share"], b["hint"]], reused, train),
        "+ long share (sticky)": table_forecast(
            [b["gap"], b["share"], b["slow_share"], b["hint"]], reused, train
        ),
        "+ layer": table_forecast([b["gap"], b["share"], b["hint"], b["layer"]], reused, train),
        "gap, share, hint of this token": table_forecast(
            [b["gap"], b["share"], b["hint_now"]], reused, train
        ),
        "+ this token's routing": table_forecast(
            [b["gap"], b["share"], b["used_now"], b["hint_now"]], reused, train
        ),
        "logistic: gap, share, hint, layer": logistic_forecast(data, b, train, routed=False),
        "logistic, every feature": logistic_forecast(data, b, train),
        "ceiling: next token known": table_forecast([b["gap"], b["share"], b["used_next"]], reused, train),
    }
    rows = [{"forecast": name, **score(f, data, test, budget)} for name, f in forecasts.items()]
    floor, ceiling = rows[0]["log_loss"], rows[-1]["log_loss"]
    for row in rows:  # the share of the log loss between recency alone and the ceiling the forecast removes
        row["to_ceiling"] = (floor - row["log_loss"]) / (floor - ceiling) if floor > ceiling else float("nan")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.set_defaults(split="validation")
    parser.add_argument(
        "--neighbours", type=int, default=HINT_NEIGHBOURS, help="stored maps the hint averages over"
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.model:
        workload = h.load_workload(name, args)
        data = collect(workload, args.neighbours)
        rows = evaluate(data, args.budget)
        iterations, experts = data["reused"].shape
        print(
            f"\n{name} ({args.split} split): reuse within {HORIZON} iterations, base rate "
            f"{data['reused'].mean():.3f}, {iterations} iterations x {experts} experts"
        )
        print_table(rows)
        results[name] = {
            "rows": rows,
            "base_rate": float(data["reused"].mean()),
            "iterations": len(data["reused"]),
        }
    payload = {"command": "python -m benchmarks.reuse_forecast", "models": results}
    path = save("reuse_forecast", payload | {"args": {k: str(v) for k, v in vars(args).items()}}, args.out)
    plot(json.loads(path.read_text()), args.out / "reuse_forecast.png")


def plot(payload: dict[str, Any], path: Path) -> None:
    split = payload["args"]["split"]
    panels = {
        name: {
            metric: {r["forecast"]: r[metric] for r in result["rows"]} for metric in ("auc", "next_token_hit")
        }
        for name, result in payload["models"].items()
    }
    title = f"forecasts of reuse within {HORIZON} iterations (recorded routing replayed, {split} split)"
    grouped_bars(path, title, panels, ncols=len(panels))


if __name__ == "__main__":
    main()
