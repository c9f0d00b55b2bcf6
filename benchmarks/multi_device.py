"""Expert-parallel serving on 1, 2 and 4 emulated CPU devices ("bench-s"): overhead against one device,
and per-device bytes moved and hit rates.

    python -m benchmarks.multi_device [--checkpoint DIR] [--policy on_demand_lru] [--budget 0.25]

Emulated CPU devices share the same two cores, so this measures correctness and the cost of the
multi-device path (replicated dense compute, per-device expert steps, the combine), not a speed-up.
On a machine with several accelerators the same script measures the real thing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, save, saved  # noqa: E402


def main() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", max(4, jax.config.jax_num_cpu_devices))  # before JAX starts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="HF or converted directory (default: bench-s)")
    from fmoe_jax.offload.policies import POLICIES

    parser.add_argument("--policy", default="on_demand_lru", choices=sorted(POLICIES), help="offload policy")
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of experts cached (all devices)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats (the median is reported)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown results"
    )
    args = parser.parse_args()

    import fmoe_jax as fj
    from fmoe_jax.testing import ensure_checkpoint

    path = args.checkpoint or ensure_checkpoint("bench-s")
    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    counts = [n for n in (1, 2, 4) if n <= len(jax.devices())]
    results, tokens = {}, {}
    cfg = fj.load_model(path).config
    for n in counts:
        slots = max(n, round(args.budget * cfg.num_moe_layers * cfg.num_experts))
        offload = fj.OffloadConfig(policy=args.policy, cache_experts=slots, devices=n)
        with fj.load_model(path, offload=offload) as model:
            fj.generate(model, [prompt], max_new_tokens=args.new_tokens, stop_at_eos=False)  # compile
            steps, outs = [], []
            for _ in range(args.repeats):
                out = fj.generate(model, [prompt], max_new_tokens=args.new_tokens, stop_at_eos=False)
                steps.extend(out.stats.decode_step_s)
                outs.append(out)
        tokens[n] = outs[-1].tokens
        per_device = outs[-1].stats.extra.get("per_device") or [
            dict(hit_rate=outs[-1].stats.hit_rate, bytes_to_device=outs[-1].stats.bytes_to_device)
        ]
        results[n] = dict(
            devices=n,
            slots=slots,
            tpot_ms=float(np.median(steps) * 1e3),
            ttft_ms=float(np.median([o.stats.ttft_s for o in outs]) * 1e3),
            hit_rate=float(np.mean([o.stats.hit_rate for o in outs])),
            per_device_hit_rate=[d["hit_rate"] for d in per_device],
            per_device_mb=[d["bytes_to_device"] / 1e6 for d in per_device],
        )
    same = all(tokens[n] == tokens[counts[0]] for n in counts)
    base = results[counts[0]]["tpot_ms"]
    rows = [
        dict(
            devices=n,
            tpot_ms=r["tpot_ms"],
            vs_one=r["tpot_ms"] / base,
            ttft_ms=r["ttft_ms"],
            hit_rate=r["hit_rate"],
            mb_per_device=" ".join(f"{x:.0f}" for x in r["per_device_mb"]),
            hit_per_device=" ".join(f"{x:.2f}" for x in r["per_device_hit_rate"]),
        )
        for n, r in results.items()
    ]
    setting = f"{args.policy} at {args.budget:.0%}, prompt {args.prompt_len}, {args.new_tokens} new tokens"
    print(f"\n{path.name}, {setting}")
    print_table(rows)
    print(f"tokens identical across device counts: {same}")
    save(
        "multi_device",
        dict(policy=args.policy, budget=args.budget, results=results, tokens_identical=same),
        args.out,
    )
    plot(saved("multi_device", args.out), args.out / "multi_device.png")


def plot(payload: dict, path: Path) -> None:
    """The figure from the saved results."""
    results = payload["results"]
    groups = {
        "TPOT (ms)": {f"{n} dev": r["tpot_ms"] for n, r in results.items()},
        "hit rate": {f"{n} dev": r["hit_rate"] for n, r in results.items()},
    }
    title = f"bench-s, {payload['policy']} at {payload['budget']:.0%} (emulated CPU devices)"
    bar_plot(path, title, groups, "", backend=payload["machine"]["backend"])


if __name__ == "__main__":
    main()
