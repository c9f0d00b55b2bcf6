"""Experiment 2 (paper figure 9): expert hit rate, TTFT and TPOT of every policy, live and simulated.

    .venv/bin/python -m benchmarks.exp2_overall [--model NAME_OR_DIR ...] [--prompts domains|FILE]

Live: each policy serves the evaluation prompts one at a time on this machine's JAX backend (medians over
requests), the policies taking turns request by request (`harness.run_live_interleaved`). Simulated: the
same requests replayed at a real model's sizes on each `--hardware` preset, with asynchronous copies (hit
rate, TTFT, TPOT) and with synchronous ones (`hit_rate_sync`: prediction and caching alone, no copy
arrives late). `resident` (every expert on the device) is the reference.
Writes `exp2_overall.{json,md,png}` to --out.

`--model gpt-oss-20b-routing[@int4]` (add `--merge` to keep the shipped models' tables) replays gpt-oss-20b's
real decode routing instead, simulated only, at its sizes with bf16 (or int4, int8, mxfp4) experts:
`benchmarks/real_routing.py`'s split, policies learning from its store part, `--routing-requests` of its
evaluation part replayed (`--split validation`: its validation part).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

NAME = "exp2_overall"


def live_row(label: str, r: dict) -> dict:
    return dict(
        policy=label,
        hit_rate=r["hit_rate"],
        ttft_ms=1e3 * r["median_ttft_s"],
        tpot_ms=1e3 * r["median_tpot_s"],
        mb_to_device_per_token=r["bytes_to_device"] / r["iterations"] / 1e6,
        requests=r["requests"],
        compilations=r["compilations"],
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser, model=h.default_models() + list(h.PRESET_REPLAYS))
    h.add_merge_argument(parser)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["resident", *h.POLICIES],
        choices=["resident", *h.POLICIES],
        help="policies compared (resident: every expert on the device, the reference)",
    )
    args = parser.parse_args(argv)

    tables, payload, notes, gaps = {}, {"models": {}}, [], []
    for name in args.model:
        w = h.load_workload(name, args)
        notes.append(h.settings_note(w))
        result = payload["models"][w.name] = {"live": {}, "sim": {}}
        if not args.no_live and not w.simulated_only:
            rows = []
            print(f"[{w.name}] live, the policies interleaved request by request", flush=True)
            result["live"] = h.run_live_interleaved(w, h.variants(args.policies))
            for label, r in result["live"].items():
                rows.append(live_row(label, r))
            tables[f"{w.name}, live ({jax.default_backend()})"] = rows
            tables[f"{w.name}, live: fmoe against each"] = h.versus_fmoe(rows, "tpot_ms")
        if not args.no_sim:
            for hw in args.hardware:
                rows = []
                for v in h.runnable(w, h.variants(args.policies)):
                    print(f"[{w.name}] simulated {v.label} on {hw}", flush=True)
                    r = h.run_sim(w, v, hw)
                    sync = h.run_sim(w, v, hw, synchronous=True)
                    result["sim"].setdefault(hw, {})[v.label] = {"async": r.as_dict(), "sync": sync.as_dict()}
                    rows.append(
                        dict(
                            policy=v.label,
                            hit_rate=r.hit_rate,
                            hit_rate_sync=sync.hit_rate,
                            ttft_s=r.median_ttft_s,
                            tpot_s=r.median_tpot_s,
                            stall_share=r.stall_s / r.total_s,
                            gb_to_device=r.bytes_to_device / 1e9,
                            requests=len(r.ttft_s),
                            fits_device=r.fits_device,
                        )
                    )
                tables[f"{w.name}, simulated at {w.sizes()} on {hw}"] = rows
                tables[f"{w.name}, simulated on {hw}: fmoe against each"] = h.versus_fmoe(rows, "tpot_s")
                gap = h.gap_closed({r["policy"]: r["tpot_s"] for r in rows})
                if gap:
                    gaps.append(dict(model=w.name, hardware=hw, budget=args.budget, **gap))
        w.close()
    if gaps:
        tables["The share of the best baseline's gap to the oracle fmoe closes (simulated TPOT)"] = gaps
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    h.write_results(
        NAME,
        "Experiment 2: overall TTFT, TPOT and hit rate (figure 9)",
        payload,
        tables,
        notes,
        args.out,
        merge=args.merge,
    )
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


def plot(payload: dict, path) -> None:
    """Figure 9 from the saved results: per source of numbers (live, each simulated preset) the hit rate and
    the TPOT relative to resident, one group of bars per model."""
    backend = payload["machine"]["backend"]
    panels, ylabels = {}, {}
    for model, result in payload["models"].items():
        modes = {"live": result["live"]} if result["live"] else {}
        modes |= {
            hw: {p: r["async"] for p, r in by_policy.items()} for hw, by_policy in result["sim"].items()
        }
        for mode, by_policy in modes.items():
            where = h.mode_title(mode, backend)
            group = model if mode == "live" else f"{model} (at {h.simulated_sizes(payload, model)})"
            ref = "resident" if "resident" in by_policy else next(iter(by_policy))
            reference = by_policy[ref]["median_tpot_s"]
            hit, tpot = f"{where}: expert hit rate", f"{where}: TPOT / {ref}'s"
            panels.setdefault(hit, {})[group] = {p: r["hit_rate"] for p, r in by_policy.items()}
            panels.setdefault(tpot, {})[group] = {
                p: r["median_tpot_s"] / reference for p, r in by_policy.items()
            }
            ylabels[tpot] = f"median TPOT, relative to {ref}"
    h.grouped_bars(path, "Overall performance per policy (figure 9)", panels, ncols=2, ylabels=ylabels)


if __name__ == "__main__":
    main()
