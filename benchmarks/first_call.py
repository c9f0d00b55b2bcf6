"""A process's first `generate` call against its later ones: statistics must not include compilation.

    python -m benchmarks.first_call [--model fmoe-tiny-mixtral] [--processes 5] [--new-tokens 32]

Each configuration (resident, and offloaded at `--budget` with `on_demand_lru` and `fmoe`) runs in
`--processes` fresh Python processes. Each loads the model and calls `generate` three times with the same
prompt; the first call compiles every program it needs (reported as `compile_s`, which also holds each new
program's first run, see `fmoe_jax/engines/programs.py`). Reported per configuration: the medians over the
processes of the first and the second call's TTFT and TPOT (the mean decode step, as `tpot_s` is) and their
ratios, first over second (target: TPOT within 20 %). A later call is the reference because it compiles
nothing. An offloaded model's first call also starts with an empty expert cache (its hit rates are
reported): its prefill loads every expert it routes to, and its first decode steps miss more often.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, print_table, save

PROMPT = "def fibonacci(n):\n    "
CALLS = 3
CONFIGS = ("resident", "on_demand_lru", "fmoe")


def child(model_name: str, policy: str | None, budget: float, new_tokens: int) -> None:
    """One fresh process: load, call `generate` three times, print each call's statistics as JSON."""
    import fmoe_jax as fj

    offload = None
    if policy is not None:
        cfg = fj.load_model(model_name).config
        slots = max(1, round(budget * cfg.num_moe_layers * cfg.num_experts))
        offload = fj.OffloadConfig(policy=policy, cache_experts=slots)
    model = fj.load_model(model_name, offload=offload)
    calls = []
    for _ in range(CALLS):
        stats = fj.generate(model, PROMPT, max_new_tokens=new_tokens, stop_at_eos=False).stats
        calls.append(
            dict(
                ttft_ms=stats.ttft_s * 1e3,
                tpot_ms=stats.tpot_s * 1e3,
                median_step_ms=float(np.median(stats.decode_step_s) * 1e3),
                compile_s=stats.compile_s,
                hit_rate=stats.hit_rate,
            )
        )
    print(json.dumps(calls))


def run_child(args: argparse.Namespace, policy: str | None) -> list[dict]:
    command = [sys.executable, "-m", "benchmarks.first_call", "--child", "--model", args.model]
    command += ["--budget", str(args.budget), "--new-tokens", str(args.new_tokens)]
    if policy is not None:
        command += ["--policy", policy]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the child process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="fmoe-tiny-mixtral", help="a shipped model or a checkpoint path")
    parser.add_argument("--processes", type=int, default=5, help="fresh processes per configuration")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per call")
    parser.add_argument("--budget", type=float, default=0.25, help="offloaded: fraction of experts cached")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="resident, and offloaded with these policies",
    )
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    args = parser.parse_args()
    if args.child:
        child(args.model, args.policy, args.budget, args.new_tokens)
        return

    rows, runs = [], {}
    for config in args.configs:
        policy = None if config == "resident" else config
        name = config
        if policy is not None:
            name += f", {args.budget:.0%}"
        runs[name] = [run_child(args, policy) for _ in range(args.processes)]
        first = {k: float(np.median([r[0][k] for r in runs[name]])) for k in runs[name][0][0]}
        second = {k: float(np.median([r[1][k] for r in runs[name]])) for k in runs[name][0][1]}
        ratios = [r[0]["tpot_ms"] / r[1]["tpot_ms"] for r in runs[name]]
        rows.append(
            dict(
                config=name,
                ttft_first_ms=first["ttft_ms"],
                ttft_second_ms=second["ttft_ms"],
                tpot_first_ms=first["tpot_ms"],
                tpot_second_ms=second["tpot_ms"],
                tpot_ratio=float(np.median(ratios)),
                tpot_ratio_max=float(np.max(ratios)),
                compile_s=first["compile_s"],
                hit_rate_first=first["hit_rate"],
                hit_rate_second=second["hit_rate"],
            )
        )
    print(f"\n{args.model}: {args.new_tokens} new tokens, batch 1, {args.processes} processes per config")
    print_table(rows)
    print("tpot_ratio: median over processes of first-call TPOT / second-call TPOT (target <= 1.20)")
    save(
        "first_call",
        dict(model=args.model, new_tokens=args.new_tokens, processes=args.processes, rows=rows, runs=runs),
        args.out,
    )


if __name__ == "__main__":
    main()
