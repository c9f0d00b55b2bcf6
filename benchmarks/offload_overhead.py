"""What offloading costs on "bench-s": the per-layer engine against the resident model, in one run.

    python -m benchmarks.offload_overhead [--checkpoint DIR] [--prompt-len 128] [--new-tokens 64]

Rows: the resident engine (one jitted program per step); the offload engine with a cache that holds every
expert, filled by the warm-up request alone (no `preload`: the full-cache fast path takes over once every
expert is resident; its TPOT over the resident one is the engine's own overhead, target <= 1.15x); the
offload engine at a 25 % budget with `on_demand_lru` and with `fmoe` (TPOT, hit rate, bytes moved, and the
policy's share of the critical path, target <= 2 % of TPOT for fmoe). Timings are medians over decode
steps of `--repeats` generations after a warm-up generation.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, save, saved


def measure(model, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    import fmoe_jax as fj

    fj.generate(model, [prompt], max_new_tokens=new_tokens, stop_at_eos=False)  # compile, warm the cache
    steps, ttft, runs = [], [], []
    for _ in range(repeats):
        out = fj.generate(model, [prompt], max_new_tokens=new_tokens, stop_at_eos=False)
        steps.extend(out.stats.decode_step_s)
        ttft.append(out.stats.ttft_s)
        runs.append(out.stats)
    s = runs[-1]
    tokens = sum(len(r.decode_step_s) + 1 for r in runs)
    overhead = {k: sum(r.overhead_s.get(k, 0.0) for r in runs) / tokens * 1e3 for k in s.overhead_s}
    return dict(
        tpot_ms=float(np.median(steps) * 1e3),
        ttft_ms=float(np.median(ttft) * 1e3),
        hit_rate=float(np.mean([r.hit_rate for r in runs])),
        mb_to_device_per_token=sum(r.bytes_to_device for r in runs) / tokens / 1e6,
        peak_cache_mb=s.peak_cache_bytes / 1e6,
        overhead_ms_per_token=overhead,
        critical_path_policy_ms=overhead.get("policy_events", 0.0) + overhead.get("context_collection", 0.0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="HF or converted directory (default: bench-s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of experts the cache holds")
    parser.add_argument(
        "--chunked", action="store_true", help="also both policies with `OffloadConfig(transfer='chunked')`"
    )
    parser.add_argument(
        "--thread", action="store_true", help="also both policies with `OffloadConfig(transfer='thread')`"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown results"
    )
    args = parser.parse_args()

    import fmoe_jax as fj
    from fmoe_jax.testing import ensure_checkpoint

    path = args.checkpoint or ensure_checkpoint("bench-s")
    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    resident = fj.load_model(path)
    cfg = resident.config
    total = cfg.num_moe_layers * cfg.num_experts
    slots = max(1, round(args.budget * total))
    rows = {"resident engine": measure(resident, prompt, args.new_tokens, args.repeats)}
    del resident
    configs = {
        "offload, cache = all (warm)": fj.OffloadConfig(policy="on_demand_lru", cache_experts=total),
        f"on_demand_lru, {args.budget:.0%}": fj.OffloadConfig(policy="on_demand_lru", cache_experts=slots),
        f"fmoe, {args.budget:.0%}": fj.OffloadConfig(policy="fmoe", cache_experts=slots, prefetch_distance=1),
    }
    for flag, transfer in ((args.chunked, "chunked"), (args.thread, "thread")):
        for policy in ("on_demand_lru", "fmoe") if flag else ():  # copies from the transfer thread
            configs[f"{policy} {transfer}, {args.budget:.0%}"] = dataclasses.replace(
                configs[f"{policy}, {args.budget:.0%}"], transfer=transfer
            )

    for name, offload in configs.items():
        with fj.load_model(path, offload=offload) as model:
            rows[name] = measure(model, prompt, args.new_tokens, args.repeats)
    base = rows["resident engine"]["tpot_ms"]
    warm = rows["offload, cache = all (warm)"]["tpot_ms"]
    table = []
    for name, r in rows.items():
        table.append(
            dict(
                config=name,
                tpot_ms=r["tpot_ms"],
                vs_resident=r["tpot_ms"] / base,
                ttft_ms=r["ttft_ms"],
                hit_rate=r["hit_rate"],
                mb_per_token=r["mb_to_device_per_token"],
                policy_ms_per_token=r["critical_path_policy_ms"],
                policy_share=r["critical_path_policy_ms"] / r["tpot_ms"],
            )
        )
    print(
        f"\n{path.name}: prompt {args.prompt_len}, {args.new_tokens} new tokens, batch 1, "
        f"cache {slots}/{total} experts at {args.budget:.0%}"
    )
    print_table(table)
    per_layer_us = (warm - base) / cfg.num_layers * 1e3
    print(f"engine host overhead per layer (warm offload - resident) / layers: {per_layer_us:.0f} us")
    print("targets: warm offload <= 1.15x resident; fmoe policy share of TPOT <= 2 %")
    save(
        "offload_overhead",
        dict(
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            slots=slots,
            total_experts=total,
            rows=rows,
            engine_overhead_per_layer_us=per_layer_us,
        ),
        args.out,
    )
    plot(saved("offload_overhead", args.out), args.out / "offload_overhead.png")


def plot(payload: dict, path: Path) -> None:
    """The figure from the saved results."""
    rows = payload["rows"]
    groups = {
        "TPOT (ms)": {k.split(",")[0]: v["tpot_ms"] for k, v in rows.items()},
        "expert hit rate": {k.split(",")[0]: v["hit_rate"] for k, v in rows.items()},
    }
    bar_plot(path, "bench-s decode, batch 1", groups, "", backend=payload["machine"]["backend"])


if __name__ == "__main__":
    main()
