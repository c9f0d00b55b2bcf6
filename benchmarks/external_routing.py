"""fMoE on routing without embeddings, each request after warming on the others: issue 16's held-out protocol,
on routing you bring (`--trace`) or drawn in regimes where prediction is hard (`--regimes`).

    python -m benchmarks.external_routing [--trace PATH ...] [--regimes heldout_like recency topic ...]

The issue's check replays real decode routing of a production-size MoE (top-k ids per token and layer, no
embeddings) through the simulator at the model's real sizes on the RTX 3090 preset at a 25 % cache, each
request after warming on the others, with trajectory matching only. This script runs that protocol: every
request is replayed once after all the others (`--warm` caps how many) through one policy and cache, and
measured alone. fmoe matches trajectories only (`semantic=False`) and learns its store, calibration and
reuse forecast online from the warm-up requests. Policies: on-demand LRU and LFU, fmoe, Belady's eviction
(on-demand loads, no prefetch) seeing 1, 2 or 4 tokens ahead or the whole future, and the oracle.

Routing: `--trace` takes `RoutingTrace`s saved with `RoutingTrace.save` (for instance built with
`RoutingTrace.from_external` from published top-k ids), each request replayed at batch 1; `--regimes` draws
synthetic routing (`fmoe_jax.research.synthetic_routing`; `heldout_like` has the held-out routing's LRU,
LFU and Belady hit rates) at Mixtral-8x7B's 32 layers x 8 experts, top 2. Reports per policy the median over
requests of each request's TPOT, the mean hit rate, the GB copied, and the TPOT over on-demand LRU's (same
run). Simulated only. Writes `external_routing.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from fmoe_jax.offload.policies.base import Policy

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, grouped_bars

NAME = "external_routing"
# (label, policy, options): fmoe matches on routing alone; the Belady rows are the foresight analysis.
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("on_demand_lru", "on_demand_lru", {}),
    ("on_demand_lfu", "on_demand_lfu", {}),
    ("fmoe", "fmoe", {"semantic": False, "asynchronous": False}),
    *((f"Belady, {n} token(s)", "oracle", {"prefetch": False, "horizon": n}) for n in (1, 2, 4)),
    ("Belady, whole future", "oracle", {"prefetch": False}),
    ("oracle", "oracle", {}),
]
# Synthetic routing only: the best a policy that does not see the future can keep when tokens are drawn
# independently from their request's distribution (`KnownShares`).
KNOWN = "request's shares known"


class KnownShares(Policy):
    """Eviction by each request's true expert shares (`synthetic_routing.generate_with_shares`): on-demand
    loads, and the expert its request chooses least often goes first (ties: least recently used). No causal
    policy knows the shares; one that learns them can at best approach this row, since a token's draw says
    nothing more about the next one (beyond the regime's `persistence`). Belady's rows see the draws.

    `shares`: one `[L, J]` array per request the policy will be told of (`RequestStart`), in that order."""

    name = "known_shares"

    def __init__(self, shares: list[np.ndarray]):
        self.shares, self.request = shares, -1

    def on_request_start(self, event: Any) -> None:
        self.request += 1

    def keep_score(self, key: Any, entry: Any) -> float:
        layer, expert = key
        return float(self.shares[self.request][layer, expert]) + 1e-12 * entry.last_use


def leave_one_out(
    requests: list[Any],
    policy: str,
    options: dict[str, Any],
    *,
    preset: Any,
    hardware: Any,
    budget: float,
    prefetch_distance: int,
    max_inflight: int,
    warm: int | None,
    shares: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Each request replayed after the others (the first `warm` of them, in order, when set), through a fresh
    policy and cache; the medians and means over requests. `shares` (synthetic routing): each request's
    expert shares, for the `KNOWN` row."""
    from fmoe_jax.offload.config import OffloadConfig
    from fmoe_jax.offload.policies import POLICIES as ALL
    from fmoe_jax.offload.simulator import simulate

    meta = requests[0].meta
    slots = max(1, round(budget * meta["num_layers"] * meta["num_experts"]))
    tpot, hits, gb = [], [], []
    for i, target in enumerate(requests):
        order = [j for j in range(len(requests)) if j != i][:warm]
        others = [requests[j] for j in order]
        if policy == KNOWN:
            made = KnownShares([shares[j] for j in (*order, i)])
        elif policy == "oracle":
            made = ALL[policy](traces=[*others, target], **options)
        else:
            made = ALL[policy](**options)
        offload = OffloadConfig(
            policy=made, cache_experts=slots, prefetch_distance=prefetch_distance, max_inflight=max_inflight
        )
        result = simulate([target], offload, model=preset, hardware=hardware, warmup=others)
        tpot.append(result.median_tpot_s)
        hits.append(result.hit_rate)
        gb.append(result.bytes_to_device / 1e9)
    return dict(
        median_tpot_s=float(np.median(tpot)),
        hit_rate=float(np.mean(hits)),
        gb_to_device=float(np.mean(gb)),
        slots=slots,
        requests=len(requests),
    )


def routing_sets(args: argparse.Namespace) -> dict[str, tuple[list[Any], list[np.ndarray] | None]]:
    """Name -> (one single-request trace per request, each request's expert shares: synthetic only)."""
    from fmoe_jax.research import synthetic_routing

    import fmoe_jax as fj

    sets = {}
    for path in args.trace:
        whole = fj.RoutingTrace.load(path)
        sets[Path(path).stem] = ([fj.RoutingTrace(whole.meta, [r]) for r in whole.requests], None)
    for name in args.regimes:
        sets[name] = synthetic_routing.generate_with_shares(
            synthetic_routing.REGIMES[name], requests=args.requests, seed=args.seed
        )
    return sets


def main(argv: list[str] | None = None) -> dict:
    from fmoe_jax.offload.cost_model import HARDWARE, MODELS
    from fmoe_jax.research.synthetic_routing import REGIMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--trace", nargs="*", default=[], help="saved RoutingTrace files (path stems)")
    parser.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--requests", type=int, default=12, help="synthetic requests per regime")
    parser.add_argument("--seed", type=int, default=0, help="synthetic routing")
    parser.add_argument(
        "--preset", default="mixtral", choices=list(MODELS), help="sizes the simulator charges"
    )
    parser.add_argument("--hardware", default="rtx_3090", choices=list(HARDWARE))
    parser.add_argument("--budget", type=float, default=0.25, help="expert cache, fraction of all experts")
    parser.add_argument("--prefetch-distance", type=int, default=3)
    parser.add_argument("--max-inflight", type=int, default=4)
    parser.add_argument("--warm", type=int, default=None, help="warm on at most this many other requests")
    parser.add_argument("--out", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    preset, hardware = MODELS[args.preset], HARDWARE[args.hardware]
    rows, layers = [], set()
    for name, (requests, shares) in routing_sets(args).items():
        layers.add(requests[0].meta["num_layers"])
        base = None
        for label, policy, options in [*POLICIES, *([(KNOWN, KNOWN, {})] if shares is not None else [])]:
            start = time.perf_counter()
            r = leave_one_out(
                requests,
                policy,
                options,
                preset=preset,
                hardware=hardware,
                budget=args.budget,
                prefetch_distance=args.prefetch_distance,
                max_inflight=args.max_inflight,
                warm=args.warm,
                shares=shares,
            )
            base = r["median_tpot_s"] if base is None else base
            rows.append(dict(routing=name, policy=label, **r, tpot_vs_lru=r["median_tpot_s"] / base))
            print(
                f"[{name}] {label}: TPOT {1e3 * r['median_tpot_s']:.1f} ms ({r['median_tpot_s'] / base:.3f}x "
                f"LRU), hit {r['hit_rate']:.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    sizes = ", ".join(h.sizes_phrase(preset, n) for n in sorted(layers))
    notes = [
        f"simulated at {sizes} on {hardware.name}, cache {args.budget:.0%} of the experts, d = "
        f"{args.prefetch_distance}, {args.max_inflight} copies in flight; each request replayed after the "
        f"{'others' if args.warm is None else f'first {args.warm} others'} through one policy and cache, "
        "TPOT the median over requests",
        "fmoe: trajectory matching only (semantic=False), store, calibration and reuse forecast learned "
        "online from the warm-up requests; Belady: on-demand loads, eviction by the next use it can see",
        f"{KNOWN} (synthetic routing): on-demand loads, eviction of the expert the request chooses least "
        "often by its true distribution, which no causal policy knows; with tokens drawn independently, "
        "the most that learning the request's habits can reach",
    ]
    if args.regimes:
        notes.append(
            "synthetic routing (fmoe_jax.research.synthetic_routing, seed "
            f"{args.seed}, {args.requests} requests a regime): "
            + "; ".join(f"{n}: {REGIMES[n]}" for n in args.regimes)
        )
    payload = {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
    h.write_results(
        NAME,
        "fMoE on routing without embeddings (issue 16's held-out protocol)",
        payload,
        {"per routing set and policy": rows},
        notes,
        args.out,
    )
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


def plot(payload: dict, path: Path) -> None:
    """TPOT over on-demand LRU's and hit rate, per routing set and policy."""
    panels: dict[str, dict[str, dict[str, float]]] = {"TPOT / on-demand LRU's": {}, "hit rate": {}}
    for row in payload["rows"]:
        panels["TPOT / on-demand LRU's"].setdefault(row["routing"], {})[row["policy"]] = row["tpot_vs_lru"]
        panels["hit rate"].setdefault(row["routing"], {})[row["policy"]] = row["hit_rate"]
    title = "Simulated: fMoE on routing without embeddings, each request after the others"
    grouped_bars(path, title, panels, ncols=2)


if __name__ == "__main__":
    main()
