"""The trace-replay simulator's own speed: layer events (one MoE layer of one decode step routed and served)
replayed per second, for on_demand_lru, fmoe and the oracle, on real gpt-oss-20b routing.

    .venv/bin/python -m benchmarks.sim_speed [--requests 20] [--repeats 3] [--store 48]

Workload: `--requests` requests of `benchmarks/real_routing.py`'s evaluation split (evenly spaced over it),
each replayed as its own batch of one, one after another, through one policy and cache (as `fmoe-sim`
replays routing recorded elsewhere); all 24 of gpt-oss-20b's MoE layers, at its sizes
(`cost_model.GPT_OSS_20B`, MXFP4 experts) on the RTX 3090 preset, 25 % of the experts cached. fmoe matches
on routing alone (`semantic=False`, inline) with a store built from `--store` requests of the store split
(`FMoE.from_traces`, not timed); the oracle is built from the replayed requests themselves (not timed).
Each replay is timed whole, wall clock and this process's CPU time, the median of `--repeats`; the
simulated TPOT and hit rate show what was replayed (the same at every repeat). The machine's load average
is recorded beside the numbers: on a shared machine wall time stretches with the load, CPU time less so.
Writes `sim_speed.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import harness as h
from benchmarks import real_routing
from benchmarks.common import HelpFormatter, grouped_bars

NAME = "sim_speed"
POLICIES = ("on_demand_lru", "fmoe", "oracle")


def batches(part: str, path: Path, limit: int) -> list[Any]:
    """The part's first `limit` requests (evenly spaced), one single-request trace each."""
    from fmoe_jax.trace import RoutingTrace

    trace = real_routing.load(part, path, limit=limit)
    return [RoutingTrace(trace.meta, [request]) for request in trace.requests]


def make_policy(name: str, replayed: list[Any], store: list[Any]) -> Any:
    """A fresh policy for one replay (its construction is not timed)."""
    from fmoe_jax.offload.policies import POLICIES as ALL
    from fmoe_jax.offload.policies.oracle import Oracle

    if name == "oracle":
        return Oracle(replayed)
    if name == "fmoe":
        return ALL["fmoe"].from_traces(
            store, prefetch_distance=3, store_capacity=512, semantic=False, asynchronous=False
        )
    return ALL[name]()


def replay(name: str, replayed: list[Any], store: list[Any], budget: float) -> dict[str, Any]:
    """One timed replay: wall and CPU seconds, and what it simulated."""
    from fmoe_jax.offload.config import OffloadConfig
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, RTX_3090
    from fmoe_jax.offload.simulator import simulate

    meta = replayed[0].meta
    slots = round(budget * meta["num_layers"] * meta["num_experts"])
    offload = OffloadConfig(policy=make_policy(name, replayed, store), cache_experts=slots)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(replayed, offload, model=GPT_OSS_20B, hardware=RTX_3090)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return dict(wall_s=wall, cpu_s=cpu, tpot_ms=1e3 * result.median_tpot_s, hit_rate=result.hit_rate)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--data", type=Path, default=real_routing.DEFAULT_PATH, help="the routing set")
    parser.add_argument("--requests", type=int, default=20, help="evaluation requests replayed")
    parser.add_argument("--store", type=int, default=48, help="store requests fmoe's store is built from")
    parser.add_argument("--repeats", type=int, default=3, help="timed replays per policy (median)")
    parser.add_argument("--budget", type=float, default=0.25, help="cache, a share of all experts")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    replayed = batches("evaluation", args.data, args.requests)
    store = batches("store", args.data, args.store) if "fmoe" in args.policies else []
    steps = sum(len(t.requests[0].iterations) for t in replayed)
    events = steps * replayed[0].meta["num_layers"]
    rows = []
    for name in args.policies:
        load = os.getloadavg()[0]
        runs = [replay(name, replayed, store, args.budget) for _ in range(args.repeats)]
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        rows.append(
            dict(
                policy=name,
                layer_events=events,
                events_per_s=events / wall,
                events_per_cpu_s=events / cpu,
                wall_s=wall,
                cpu_s=cpu,
                load_before=round(load, 2),
                load_after=round(os.getloadavg()[0], 2),
                sim_tpot_ms=runs[0]["tpot_ms"],
                sim_hit_rate=runs[0]["hit_rate"],
            )
        )
        print(f"{name}: {events / wall:,.0f} layer events/s ({events / cpu:,.0f} per CPU second)", flush=True)
    notes = [
        f"{len(replayed)} requests of the evaluation split of gpt-oss-20b's real routing ({steps:,} decode "
        f"steps, all 24 of its 24 MoE layers: {events:,} layer events), each its own batch, replayed at "
        f"gpt-oss-20b sizes (MXFP4 experts) on the RTX 3090 preset with {args.budget:.0%} of the experts "
        "cached; the TPOT and hit rate columns are simulated",
        f"events/s: layer events over the replay's wall time, median of {args.repeats}; per CPU second: over "
        "this process's CPU time (less sensitive to other jobs on a shared machine); load: the 1-minute "
        "load average before and after each policy's replays",
        f"fmoe: semantic=False, inline, store from {args.store} store-split requests (not timed); oracle: "
        "built from the replayed requests (not timed)",
    ]
    payload = {"rows": rows, "args": {k: str(v) for k, v in vars(args).items() if k != "data"}}
    title = "Simulator speed: layer events replayed per second"
    h.write_results(NAME, title, payload, {"per policy": rows}, notes, args.out)
    plot(rows, args.out / f"{NAME}.png")
    return payload


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    panels = {
        "layer events / s (wall)": {"": {r["policy"]: r["events_per_s"] for r in rows}},
        "layer events / CPU s": {"": {r["policy"]: r["events_per_cpu_s"] for r in rows}},
    }
    title = "Simulator speed on gpt-oss-20b's real routing (RTX 3090 preset, 25 % cached)"
    grouped_bars(path, title, panels, ncols=2)


if __name__ == "__main__":
    main()
