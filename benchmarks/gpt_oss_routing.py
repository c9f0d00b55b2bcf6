"""gpt-oss-20b on one RTX 3090, simulated on its real routing (issue 55): TPOT and tokens per second of
on_demand_lru, fiddler, static_split (llama.cpp's `--n-cpu-moe` split) and fmoe, copy-only and hybrid, with
25 % and 50 % of the experts on the device.

    .venv/bin/python -m benchmarks.gpt_oss_routing [--eval 24] [--store 48] [--max-steps N]

Routing: `shared/data/routing/gpt-oss-20b` (real decode routing of openai/gpt-oss-20b recorded with
transformers: per request and decode step, the top-4 experts of each of its 24 MoE layers and their weights;
no prefill routing and no router distributions were recorded, so a request's replay starts at its first
decode step, whose one token stands in for the prefill, and no TTFT is reported). Each request replays on
its own (batch 1) through `RoutingTrace.from_external`.

Store / evaluation split: `benchmarks/real_routing.py`'s, by dataset (the one every experiment uses: store
mmlu_test; evaluation mmlu_validation, MMLU-Pro, Polyglot-or-Not and Tulu3 persona-IF; the validation part,
mmlu_dev, is not used here). `--eval` evaluation requests (evenly spaced over that part) are replayed and
measured; `--store` store requests (evenly spaced) are what the policies may learn from: fmoe's expert-map
store and expert popularity (`FMoE.from_traces`, trajectory matching only: the data has no embeddings),
fiddler's expert popularity (`Fiddler.from_traces`); the last `--warmup` of them are also replayed through
every policy before the measured requests (caches warm, fmoe's calibration and reuse forecast learned
online). Requests replay whole unless `--max-steps` cuts them to their first decode steps.

Sizes: gpt-oss-20b's (`cost_model.GPT_OSS_20B`: experts in MXFP4 as published, 4.25 bits per weight plus
their bf16 biases, 13.2 MB each; everything else bf16) on the RTX 3090 preset (PCIe 4.0 x16) beside a
desktop of its generation (`desktop_ddr4`: Ryzen 9 5950X, 2x DDR4-3200) for hybrid execution; the host's cost
of expanding MXFP4 is not modelled (the host model reads the stored bytes). fiddler and static_split place
experts and compute the rest on the host, so they run hybrid only; static_split places the last layers'
experts, as `--n-cpu-moe N` leaves them. Simulated only. Writes `gpt_oss_routing.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from benchmarks import harness as h
from benchmarks import real_routing
from benchmarks.common import HelpFormatter, grouped_bars

NAME = "gpt_oss_routing"
# (label, policy, execution, options)
VARIANTS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("on_demand_lru", "on_demand_lru", "copy", {}),
    ("fmoe", "fmoe", "copy", {"semantic": False, "asynchronous": False}),
    ("on_demand_lru+hybrid", "on_demand_lru", "hybrid", {}),
    ("fiddler", "fiddler", "hybrid", {}),
    ("static_split", "static_split", "hybrid", {"device_layers": "last"}),
    ("fmoe+hybrid", "fmoe", "hybrid", {"semantic": False, "asynchronous": False}),
]


def load(data: Path, part: str, limit: int, max_steps: int | None) -> list[Any]:
    """`limit` requests of one part of `real_routing`'s split (evenly spaced), one single-request
    `RoutingTrace` each, each cut to its first `max_steps` decode steps (None: whole)."""
    import fmoe_jax as fj

    trace = real_routing.load(part, data, limit=limit)
    meta = {**trace.meta, "family": "gpt_oss"}
    return [
        fj.RoutingTrace(
            {**meta, "requests": [record]}, [dataclasses.replace(r, iterations=r.iterations[:max_steps])]
        )
        for record, r in zip(trace.meta["requests"], trace.requests, strict=True)
    ]


def run(variant: tuple, budget: float, store: list[Any], warmup: list[Any], evaluated: list[Any]) -> dict:
    from fmoe_jax.offload.config import OffloadConfig
    from fmoe_jax.offload.cost_model import DESKTOP_DDR4, GPT_OSS_20B, RTX_3090
    from fmoe_jax.offload.policies import POLICIES
    from fmoe_jax.offload.simulator import simulate

    label, policy, execution, options = variant
    meta = evaluated[0].meta
    slots = round(budget * meta["num_layers"] * meta["num_experts"])
    made = POLICIES[policy].from_traces(store, prefetch_distance=3, store_capacity=1000, **options)
    offload = OffloadConfig(
        policy=made, cache_experts=slots, prefetch_distance=3, max_inflight=1, execution=execution
    )
    start = time.perf_counter()
    r = simulate(evaluated, offload, model=GPT_OSS_20B, hardware=RTX_3090, host=DESKTOP_DDR4, warmup=warmup)
    needed = r.hits + r.misses
    row = dict(
        policy=label,
        budget=budget,
        slots=slots,
        tpot_ms=1e3 * r.median_tpot_s,
        tokens_per_s=1.0 / r.median_tpot_s,
        hit_rate=r.hit_rate,
        host_share=r.host_computed / needed if needed else 0.0,
        gb_to_device=r.bytes_to_device / 1e9,
        stall_share=r.stall_s / r.total_s if r.total_s else 0.0,
    )
    print(
        f"{budget:.0%} {label}: TPOT {row['tpot_ms']:.1f} ms, {row['tokens_per_s']:.1f} tok/s, hit "
        f"{r.hit_rate:.3f}, host {row['host_share']:.3f} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--data", type=Path, default=real_routing.DEFAULT_PATH, help="the routing set")
    parser.add_argument("--eval", type=int, default=24, help="evaluation requests replayed and measured")
    parser.add_argument("--store", type=int, default=48, help="store requests the policies learn from")
    parser.add_argument("--warmup", type=int, default=8, help="of those, replayed before the measurement")
    parser.add_argument("--max-steps", type=int, default=None, help="decode steps kept per request (all)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5], help="cache budgets")
    parser.add_argument("--out", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    store = load(args.data, "store", args.store, args.max_steps)
    evaluated = load(args.data, "evaluation", args.eval, args.max_steps)
    store_keys, eval_keys = ([t.meta["requests"][0]["request"] for t in ts] for ts in (store, evaluated))
    warmup = store[len(store) - args.warmup :] if args.warmup else []
    rows = [run(v, b, store, warmup, evaluated) for b in args.budgets for v in VARIANTS]
    for row in rows:
        base = next(r for r in rows if r["budget"] == row["budget"] and r["policy"] == "on_demand_lru")
        row["tpot_vs_lru"] = row["tpot_ms"] / base["tpot_ms"]
    steps = [len(t.requests[0].iterations) for t in evaluated]
    datasets = {t.meta["requests"][0]["request"]: t.meta["requests"][0]["dataset"] for t in store + evaluated}
    notes = [
        "simulated at gpt-oss-20b sizes (24 MoE layers x 32 experts, top-4; MXFP4 experts of 13.2 MB) on "
        "the RTX 3090 preset beside a desktop_ddr4 host; batch 1, prefetch distance 3, one copy in flight; "
        f"TPOT the median over the {len(evaluated)} evaluation requests ({sum(steps)} decode steps, "
        f"{'whole requests' if args.max_steps is None else f'at most {args.max_steps} each'}), tokens/s its "
        "inverse",
        f"{len(eval_keys)} of the evaluation part's requests (benchmarks/real_routing.py: split by dataset), "
        f"from {sorted({datasets[k] for k in eval_keys})}; the policies learn from {len(store)} of the store "
        f"part's ({sorted({datasets[k] for k in store_keys})}), the last {len(warmup)} also replayed first",
        "fiddler and static_split run hybrid only (they place experts and compute the rest on the host); "
        "static_split keeps the last layers' experts on the device, as llama.cpp's --n-cpu-moe does",
        "routing: real gpt-oss-20b decode routing (shared/data/routing/gpt-oss-20b); no prefill, no TTFT",
    ]
    payload = {
        "rows": rows,
        "eval_requests": eval_keys,
        "store_requests": store_keys,
        "args": {k: str(v) for k, v in vars(args).items() if k != "data"},
    }
    h.write_results(
        NAME,
        "gpt-oss-20b on an RTX 3090, simulated on its real routing",
        payload,
        {"per budget and policy": rows},
        notes,
        args.out,
    )
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


def plot(payload: dict, path: Path) -> None:
    """Tokens per second and hit rate, per budget and policy."""
    panels: dict[str, dict[str, dict[str, float]]] = {"tokens / s (batch 1)": {}, "hit rate": {}}
    for row in payload["rows"]:
        group = f"{row['budget']:.0%} of the experts"
        panels["tokens / s (batch 1)"].setdefault(group, {})[row["policy"]] = row["tokens_per_s"]
        panels["hit rate"].setdefault(group, {})[row["policy"]] = row["hit_rate"]
    title = "Simulated: gpt-oss-20b (MXFP4 experts) on an RTX 3090 + DDR4 desktop, real routing"
    grouped_bars(path, title, panels, ncols=2)


if __name__ == "__main__":
    main()
