"""What offloading costs: the offload engine against the resident model, in one run (default "bench-s").

    python -m benchmarks.offload_overhead [--checkpoint DIR | --model NAME] [--prompt-len 128]
        [--new-tokens 64]

Rows: the resident engine (one jitted program per step); the offload engine with a cache that holds every
expert, filled by the warm-up request alone (no `preload`: once every expert is resident each step is one
launch; its TPOT over the resident one is the engine's own overhead, target <= 1.15x); the offload engine
at a 25 % budget with `on_demand_lru` and with `fmoe` (TPOT, hit rate, bytes moved, the policy's share of
the critical path, target <= 2 % of TPOT for fmoe). The engine's host path per decode token: device
programs launched and host waits for device results (at most MoE layers + 2), and the host time per MoE
layer outside those waits and outside copy waits (on a CPU backend a launch runs its program before it
returns, so there this includes the compute). Timings are medians over decode steps of `--repeats`
generations after a warm-up generation, the rows taking turns (one generation each per round) so that a
change in the machine's speed falls on every row alike; the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, save, saved

STEP_FIELDS = ("step_launches", "step_syncs", "step_host_s")


def measure(model, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """One model's row: `measure_in_turn` of it alone."""
    return measure_in_turn({"": model}, prompt, new_tokens, repeats)[""]


def measure_in_turn(models: dict[str, Any], prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """Every model's row. Each is warmed up (compiled, its cache filled), then the timed generations go round
    the models `repeats` times, so that drift in the machine's speed (other jobs, clocks) falls on all alike
    and the ratios between rows compare like with like."""
    import fmoe_jax as fj

    def run(model):
        return fj.generate(model, [prompt], max_new_tokens=new_tokens, stop_at_eos=False).stats

    for model in models.values():
        run(model)  # compile, warm the cache
    runs: dict[str, list] = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():
            runs[label].append(run(model))
    return {label: summary(models[label], stats) for label, stats in runs.items()}


def summary(model, runs: list) -> dict:
    """A row from one model's timed generations (`GenerationStats`)."""
    steps = [t for r in runs for t in r.decode_step_s]
    ttft = [r.ttft_s for r in runs]
    s = runs[-1]
    tokens = sum(len(r.decode_step_s) + 1 for r in runs)
    overhead = {k: sum(r.overhead_s.get(k, 0.0) for r in runs) / tokens * 1e3 for k in s.overhead_s}
    # The decode steps (after each run's prefill): launches, syncs, host seconds.
    launches, syncs, host_s = (np.concatenate([getattr(r, f)[1:] for r in runs]) for f in STEP_FIELDS)
    return dict(
        launches_per_token=float(np.mean(launches)),
        syncs_per_token=float(np.mean(syncs)),
        host_ms_per_moe_layer=float(np.median(host_s)) * 1e3 / model.config.num_moe_layers,
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
    parser.add_argument("--model", help="a shipped model's name instead (results: offload_overhead_<name>)")
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
    from fmoe_jax.engines.offload import OffloadEngine
    from fmoe_jax.testing import ensure_checkpoint

    path = args.model or args.checkpoint or ensure_checkpoint("bench-s")
    name = "offload_overhead" if args.model is None else f"offload_overhead_{args.model}"
    load_before = os.getloadavg()
    resident = fj.load_model(path)
    cfg = resident.config
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, args.prompt_len).tolist()
    total = cfg.num_moe_layers * cfg.num_experts
    slots = max(1, round(args.budget * total))
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

    # One copy of the weights (experts in pinned host memory) under one engine per configuration.
    base = fj.load_model(path, offload=fj.OffloadConfig(cache_experts=1))
    base.close()
    models = {"resident engine": resident}
    for label, offload in configs.items():
        engine = OffloadEngine(base.module, offload, programs=base.engine.programs)
        models[label] = dataclasses.replace(base, engine=engine, offload=offload)
    try:
        rows = measure_in_turn(models, prompt, args.new_tokens, args.repeats)
    finally:
        for model in models.values():
            model.close()
    base = rows["resident engine"]["tpot_ms"]
    warm = rows["offload, cache = all (warm)"]["tpot_ms"]
    table = []
    for label, r in rows.items():
        table.append(
            dict(
                config=label,
                tpot_ms=r["tpot_ms"],
                vs_resident=r["tpot_ms"] / base,
                ttft_ms=r["ttft_ms"],
                hit_rate=r["hit_rate"],
                mb_per_token=r["mb_to_device_per_token"],
                launches=r["launches_per_token"],
                syncs=r["syncs_per_token"],
                host_ms_per_layer=r["host_ms_per_moe_layer"],
                policy_ms_per_token=r["critical_path_policy_ms"],
                policy_share=r["critical_path_policy_ms"] / r["tpot_ms"],
            )
        )
    load_after = os.getloadavg()
    print(
        f"\n{Path(path).name}: prompt {args.prompt_len}, {args.new_tokens} new tokens, batch 1, "
        f"cache {slots}/{total} experts at {args.budget:.0%}, {cfg.num_moe_layers} MoE layers; "
        f"launches and syncs per decode token; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after ({os.cpu_count()} CPUs)"
    )
    print_table(table)
    per_layer_us = (warm - base) / cfg.num_layers * 1e3
    print(f"engine host overhead per layer (warm offload - resident) / layers: {per_layer_us:.0f} us")
    lru, fmoe = (rows[f"{policy}, {args.budget:.0%}"]["tpot_ms"] for policy in ("on_demand_lru", "fmoe"))
    ratios = dict(
        warm_vs_resident=warm / base, on_demand_lru_vs_resident=lru / base, fmoe_vs_on_demand_lru=fmoe / lru
    )
    print(", ".join(f"{k.replace('_vs_', ' / ')} {v:.2f}x" for k, v in ratios.items()))
    print(
        "targets: warm offload <= 1.15x resident; on_demand_lru <= 2.0x resident (CPU, fmoe-tiny-mixtral); "
        f"launches and syncs per token <= MoE layers + 2 = {cfg.num_moe_layers + 2}; fmoe <= 1.05x "
        "on_demand_lru; fmoe policy share of TPOT <= 2 %"
    )
    save(
        name,
        dict(
            model=Path(path).name,
            moe_layers=cfg.num_moe_layers,
            load_average=dict(before=load_before, after=load_after),
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            slots=slots,
            total_experts=total,
            rows=rows,
            engine_overhead_per_layer_us=per_layer_us,
            ratios=ratios,
        ),
        args.out,
    )
    plot(saved(name, args.out), args.out / f"{name}.png")


def plot(payload: dict, path: Path) -> None:
    """The figure from the saved results."""
    rows = payload["rows"]
    groups = {
        "TPOT (ms)": {k.split(",")[0]: v["tpot_ms"] for k, v in rows.items()},
        "expert hit rate": {k.split(",")[0]: v["hit_rate"] for k, v in rows.items()},
    }
    model = payload.get("model", "bench-s")
    bar_plot(path, f"{model} decode, batch 1", groups, "", backend=payload["machine"]["backend"])


if __name__ == "__main__":
    main()
