"""Where the gap between fMoE and the oracle lies on gpt-oss-20b's real decode routing (issue 57).

    python -m benchmarks.gap_analysis [--requests 12] [--budgets 0.125 0.25 0.5] [--no-sim]

Three parts, on a sample of the validation split (evenly spaced requests, `benchmarks/real_routing.py`), so
that nothing here is tuned on the evaluation split:

1. Eviction, counted (no link, no timing): the misses of one shared cache of `budget` x L x J slots replayed
   over the sampled requests one after another, per MoE layer, under LRU, under Belady's rule with 1, 2 and 4
   tokens of foresight (an expert not used again within them ranks as never needed, ties by LRU) and under
   Belady seeing the rest of the request (the next request unseen); beside them, eviction by the request's
   own history (`sticky`: iterations since last use, then how often the request used the expert).
2. Eviction against prefetch, simulated (RTX 3090 preset, gpt-oss-20b sizes, bf16): TPOT of on-demand LRU,
   fmoe, the oracle, the oracle without prefetch (Belady's eviction alone), the oracle that sees only the
   current token (perfect within-token prefetch, no foresight for eviction: the prefetch-only oracle) and
   the oracle with 1, 2 and 4 tokens of foresight; each as the share of the LRU-to-oracle gap it closes.
3. Prediction from the store, counted: after layer l of a token routes, the stored map most like the token's
   routing so far (cosine over layers 0..l, as fMoE's trajectory search) and the maps that followed it in its
   request forecast the token's layer l + 3 and the next tokens' experts; recall@k of those forecasts beside
   the request's own history (the experts of its previous token; its k most used so far), by store size and
   by how many tokens of its own the request has behind it.

Writes `gap_analysis.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness as h
from benchmarks import real_routing
from benchmarks.common import HelpFormatter, grouped_bars, print_table, save

NAME = "gap_analysis"
FORESIGHT = (1, 2, 4)  # tokens of foresight of the limited Belady rules and oracles
AHEAD = (1, 2, 4)  # tokens ahead the store's followers are scored at
DISTANCE = 3  # fMoE's prefetch distance d: a trajectory search after layer l guides layer l + d
STORE_SIZES = (1_000, 8_000, 61_020)  # maps of the store part searched (evenly spaced subsets; all)
HISTORY_BINS = ((1, 8), (8, 32), (32, 128), (128, 10**9))  # own tokens behind the query token


def used_sets(trace: Any) -> list[np.ndarray]:
    """Per request, `[T, L, J]` bool: the experts each decode step used."""
    out = []
    for request in trace.requests:
        ids = np.stack([it.ids[0] for it in request.iterations])  # [T, L, k]
        used = np.zeros((*ids.shape[:2], trace.meta["num_experts"]), bool)
        np.put_along_axis(used, ids, True, axis=2)
        out.append(used)
    return out


# -- 1. eviction, counted ----------------------------------------------------------------------------------
def replay_misses(
    requests: list[np.ndarray], slots: int, rule: str, foresight: int | None = None
) -> np.ndarray:
    """Misses per layer `[L]` of one cache of `slots` experts over `requests` in order. `rule`: "lru",
    "belady" (next use within `foresight` tokens of the same request; None: the rest of the request) or
    "sticky"."""
    num_layers, num_experts = requests[0].shape[1:]
    keys = num_layers * num_experts
    misses = np.zeros(num_layers, np.int64)
    resident = np.zeros(keys, bool)
    last = np.full(keys, -1, np.int64)  # step of last use (LRU order, ties)
    step, base = 0, 0
    for number, used in enumerate(requests):
        steps = used.shape[0] * num_layers
        nxt = _next_uses(requests, number, base) if rule == "belady" else None
        count = np.zeros(keys)  # sticky: uses by this request
        since = np.full(keys, 10**9)
        for t in range(used.shape[0]):
            for layer in range(num_layers):
                need = layer * num_experts + np.flatnonzero(used[t, layer])
                for key in need[~resident[need]]:
                    misses[layer] += 1
                    if resident.sum() >= slots:
                        resident[
                            _victim(
                                rule,
                                resident,
                                last,
                                need,
                                nxt,
                                step,
                                t,
                                foresight,
                                count,
                                since,
                                num_layers,
                                base,
                                steps,
                            )
                        ] = False
                    resident[key] = True
                last[need] = step
                if nxt is not None:
                    nxt[0][need] = nxt[1][step - base][: len(need)]
                step += 1
            row = used[t].ravel()
            since += 1
            since[row] = 0
            count += row
        base += steps
    return misses


def _next_uses(requests: list[np.ndarray], number: int, base: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """For Belady: the next-use step (global; beyond the request: after every later request's steps) of
    every key, as the request starts, and per step the next use of each key that step needs, in key order."""
    used = requests[number]
    num_layers, num_experts = used.shape[1:]
    flat = used.reshape(-1, num_experts)  # [T * L, J], one row per step
    future = base + flat.shape[0] + sum(r.size for r in requests[number + 1 :])  # "after this request"
    upcoming = np.full((num_layers, num_experts), future, np.int64)
    per_step: list[np.ndarray] = [None] * flat.shape[0]
    for s in range(flat.shape[0] - 1, -1, -1):
        layer = s % num_layers
        experts = np.flatnonzero(flat[s])
        per_step[s] = upcoming[layer, experts].copy()
        upcoming[layer, experts] = base + s
    return upcoming.ravel().copy(), per_step


def _victim(rule, resident, last, need, nxt, step, t, foresight, count, since, num_layers, base, steps):
    candidates = np.flatnonzero(resident)
    candidates = candidates[~np.isin(candidates, need)]
    if rule == "lru":
        return candidates[np.argmin(last[candidates])]
    if rule == "sticky":  # longest unused first, then least used by the request, then LRU
        order = np.lexsort((last[candidates], count[candidates], -since[candidates]))
        return candidates[order[0]]
    upcoming = nxt[0][candidates]
    if foresight is not None:  # beyond the horizon (or the request): never, ties by LRU
        horizon = base + (t + 1 + foresight) * num_layers
        upcoming = np.where(upcoming >= min(horizon, base + steps), np.iinfo(np.int64).max, upcoming)
    order = np.lexsort((last[candidates], -upcoming))
    return candidates[order[0]]


def eviction_rows(requests: list[np.ndarray], budgets: list[float]) -> list[dict[str, Any]]:
    num_layers, num_experts = requests[0].shape[1:]
    rules = [("lru", None), ("sticky", None), *[("belady", n) for n in FORESIGHT], ("belady", None)]
    rows = []
    for budget in budgets:
        slots = round(budget * num_layers * num_experts)
        per_rule = {}
        for rule, n in rules:
            label = rule if rule != "belady" else ("belady" if n is None else f"belady {n} token(s)")
            per_rule[label] = replay_misses(requests, slots, rule, n)
        total = sum(int(u.sum()) for u in requests)
        lru, best = per_rule["lru"], per_rule["belady"]
        for label, misses in per_rule.items():
            share = (lru.sum() - misses.sum()) / max(lru.sum() - best.sum(), 1)
            rows.append(
                dict(
                    budget=budget,
                    rule=label,
                    miss_rate=misses.sum() / total,
                    gap_closed=share,
                    by_layer=(misses / (total / num_layers)).round(4).tolist(),
                )
            )
    return rows


# -- 2. eviction against prefetch, simulated ----------------------------------------------------------------
def sim_variants() -> list[h.Variant]:
    oracles = [h.Variant("eviction only (Belady)", "oracle", (("prefetch", False),))]
    oracles += [h.Variant("prefetch only (current token)", "oracle", (("horizon", 0),))]
    oracles += [h.Variant(f"oracle, {n} token(s)", "oracle", (("horizon", n),)) for n in FORESIGHT]
    return [
        h.Variant("on_demand_lru", "on_demand_lru"),
        h.Variant("fmoe", "fmoe"),
        *oracles,
        h.Variant("oracle", "oracle"),
    ]


def sim_rows(args: argparse.Namespace, budgets: list[float]) -> list[dict[str, Any]]:
    args.split, args.routing_requests = "validation", args.requests
    w = real_routing.workload(real_routing.NAME, args)
    rows = []
    for budget in budgets:
        tpot = {}
        for v in sim_variants():
            print(f"[simulated] {budget:.3g} {args.hardware[0]}: {v.label}", flush=True)
            tpot[v.label] = h.run_sim(w, v, args.hardware[0], budget=budget).median_tpot_s
        lru, oracle = tpot["on_demand_lru"], tpot["oracle"]
        for label, value in tpot.items():
            rows.append(
                dict(
                    budget=budget,
                    policy=label,
                    tpot_ms=1e3 * value,
                    gap_closed=(lru - value) / (lru - oracle) if lru != oracle else float("nan"),
                )
            )
    return rows


# -- 3. prediction from the store, counted ------------------------------------------------------------------
def store_rows(
    store: list[np.ndarray],
    queries: list[np.ndarray],
    probs: list[np.ndarray],
    store_probs: list[np.ndarray],
    layers: tuple[int, ...],
    per_request: int,
) -> list[dict]:
    """Recall@k of each forecast of the experts used `a` tokens ahead (a in AHEAD) and at layer l + d of the
    query token itself, after layer l routes; per store size and own-history bin."""
    top_k = int(queries[0][0, 0].sum())
    maps = np.concatenate(store_probs)  # [N, L, J]
    used_store = np.concatenate(store)
    # index of the same request's map a tokens later (-1 past its end)
    ends = np.cumsum([len(s) for s in store])
    owner_end = np.repeat(ends, [len(s) for s in store])
    index = np.arange(len(maps))
    rng = np.random.default_rng(0)
    tallies: dict[tuple, list[float]] = collections.defaultdict(list)
    for size in STORE_SIZES:
        pick = np.linspace(0, len(maps) - 1, min(size, len(maps))).round().astype(int)
        for layer in layers:
            keys = maps[pick, : layer + 1].reshape(len(pick), -1)
            keys = keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-9)
            for used, p in zip(queries, probs, strict=True):
                ts = np.sort(rng.choice(np.arange(1, len(used) - max(AHEAD)), per_request, replace=False))
                q = p[ts, : layer + 1].reshape(len(ts), -1)
                best = pick[np.argmax(q @ keys.T, axis=1)]  # [n] the best match's index among all maps
                for t, match in zip(ts.tolist(), best.tolist(), strict=True):
                    hist = next(
                        f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"
                        for lo, hi in HISTORY_BINS
                        if lo <= t < hi
                    )
                    own_top = np.argsort(-used[:t].sum(0), axis=1, kind="stable")[:, :top_k]  # [L, k]
                    own = np.zeros_like(used[0])
                    np.put_along_axis(own, own_top, True, axis=1)
                    for a in AHEAD:
                        truth = used[t + a]
                        later = match + a if match + a < owner_end[match] else -1
                        preds = {
                            "store match": used_store[later] if later >= 0 else None,
                            "own previous token": used[t],
                            "own top-k so far": own,
                        }
                        for name, pred in preds.items():
                            if pred is not None:
                                hit = (pred & truth).sum() / truth.sum()
                                tallies[(size, layer, f"{a} ahead", name, hist)].append(hit)
                    target = layer + DISTANCE
                    if target < used.shape[1]:
                        truth = used[t, target]
                        for name, pred in (
                            ("store match", used_store[match, target]),
                            ("own previous token", used[t - 1, target]),
                            ("own top-k so far", own[target]),
                        ):
                            tallies[(size, layer, "layer l + d", name, hist)].append(
                                (pred & truth).sum() / top_k
                            )
    del index
    rows = []
    for (size, layer, ahead, name, hist), values in sorted(tallies.items(), key=str):
        rows.append(
            dict(
                store_maps=size,
                after_layer=layer,
                target=ahead,
                forecast=name,
                own_tokens=hist,
                recall=float(np.mean(values)),
                n=len(values),
            )
        )
    return rows


def summarise_store(rows: list[dict]) -> list[dict]:
    """Recall by store size, target and forecast, over layers and history bins (sample-weighted)."""
    groups: dict[tuple, list[tuple[float, int]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["store_maps"], r["target"], r["forecast"])].append((r["recall"], r["n"]))
    return [
        dict(store_maps=s, target=t, forecast=f, recall=sum(v * n for v, n in vals) / sum(n for _, n in vals))
        for (s, t, f), vals in sorted(groups.items(), key=str)
    ]


def summarise_history(rows: list[dict]) -> list[dict]:
    largest = max(STORE_SIZES)
    groups: dict[tuple, list[tuple[float, int]]] = collections.defaultdict(list)
    for r in rows:
        if r["store_maps"] == largest and r["target"] == "1 ahead":
            groups[(r["own_tokens"], r["forecast"])].append((r["recall"], r["n"]))
    return [
        dict(own_tokens=o, forecast=f, recall_1_ahead=sum(v * n for v, n in vals) / sum(n for _, n in vals))
        for (o, f), vals in sorted(groups.items(), key=str)
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.add_argument("--requests", type=int, default=12, help="validation requests sampled (evenly)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    parser.add_argument("--per-request", type=int, default=40, help="query tokens per request (part 3)")
    args = parser.parse_args(argv)
    path = real_routing.data_path(args)
    validation = real_routing.load("validation", path, limit=args.requests)
    store_trace = real_routing.load("store", path)
    requests = used_sets(validation)
    eviction = eviction_rows(requests, args.budgets)
    simulated = [] if args.no_sim else sim_rows(args, args.budgets)
    probs = [np.stack([it.probs[0] for it in r.iterations]) for r in validation.requests]
    store_probs = [np.stack([it.probs[0] for it in r.iterations]) for r in store_trace.requests]
    layers = tuple(range(0, requests[0].shape[1] - DISTANCE, 5))
    store = store_rows(used_sets(store_trace), requests, probs, store_probs, layers, args.per_request)
    steps = sum(len(u) for u in requests)
    tables = {
        "Eviction, counted: miss rate and share of the LRU-to-Belady gap closed": [
            {k: v for k, v in r.items() if k != "by_layer"} for r in eviction
        ],
        "Eviction against prefetch, simulated TPOT (RTX 3090 preset)": simulated,
        "Store's best match vs the request's own history: recall of the experts used": summarise_store(store),
        "By the request's own tokens behind the query (whole store, next token)": summarise_history(store),
    }
    for caption, rows in tables.items():
        print(f"\n{caption}")
        print_table(rows)
    notes = [
        f"{args.requests} validation requests of gpt-oss-20b's routing ({steps:,} decode steps), evenly "
        "spaced; "
        f"store part: {len(store_trace.requests)} requests ({sum(len(s) for s in store_probs):,} maps); "
        f"part 3 samples {args.per_request} query tokens per request and store size; layers {list(layers)}",
        "part 2 is simulated at gpt-oss-20b's sizes (bf16 experts) on the RTX 3090 preset, all 24 MoE layers",
    ]
    payload = dict(
        command=h.command_line(),
        notes=notes,
        tables=tables,
        eviction_by_layer=eviction,
        store_detail=store,
        args={k: str(v) for k, v in vars(args).items()},
    )
    save(NAME, payload, args.out)
    write_md(tables, notes, Path(args.out) / f"{NAME}.md")
    plot(payload, Path(args.out) / f"{NAME}.png")
    return payload


def write_md(tables: dict, notes: list[str], path: Path) -> None:
    from benchmarks.harness import markdown_table

    lines = ["# Gap analysis: gpt-oss-20b's real routing (validation split)", ""]
    for caption, rows in tables.items():
        if rows:
            lines += [f"### {caption}", "", markdown_table(rows)]
    lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    path.write_text("\n".join(lines))


def plot(payload: dict, path: Path) -> None:
    """Miss rate per layer (LRU, limited and full Belady) at each budget, and the gap each oracle closes."""
    panels: dict[str, dict[str, dict[str, float]]] = {}
    for r in payload["eviction_by_layer"]:
        panel = panels.setdefault(f"miss rate by layer, {r['budget']:.3g} cached", {})
        for layer, value in enumerate(r["by_layer"]):
            if layer % 4 == 0:
                panel.setdefault(f"layer {layer}", {})[r["rule"]] = value
    for r in payload["tables"]["Eviction against prefetch, simulated TPOT (RTX 3090 preset)"]:
        panels.setdefault("simulated: share of the LRU-to-oracle gap", {}).setdefault(
            f"{r['budget']:.3g}", {}
        )[r["policy"]] = r["gap_closed"]
    grouped_bars(path, "Where the gap is (gpt-oss-20b routing, validation split)", panels, ncols=2)


if __name__ == "__main__":
    main()
