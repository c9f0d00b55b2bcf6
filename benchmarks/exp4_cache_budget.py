"""Experiment 4 (paper figure 11): TPOT and hit rate of every policy against the expert cache budget.

    .venv/bin/python -m benchmarks.exp4_cache_budget [--budgets 0.125 0.25 ...] [--model ...]

Budgets are fractions of all routed experts (the simulated tables also give them in GB of the real model's
experts). Live: each policy serves `--live-requests` evaluation prompts one at a time per budget, the
policies taking turns request by request (`run_live_interleaved`); simulated:
every evaluation request, asynchronous copies, on each `--hardware` preset. Each table has one row per
budget and one column per policy (median TPOT over requests, or hit rate). Writes
`exp4_cache_budget.{json,md,png}` to --out.

`--model gpt-oss-20b-routing[@int4]` (add `--merge` to keep the shipped models' tables) replays gpt-oss-20b's
real decode routing instead, simulated only, at its sizes with bf16 (or int4, int8, mxfp4) experts:
`benchmarks/real_routing.py`'s split, policies learning from its store part, `--routing-requests` of its
evaluation part replayed (`--split validation`: its validation part).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png

NAME = "exp4_cache_budget"


def pivot(rows: list[dict], key: str, budget_gb: dict | None = None) -> list[dict]:
    out = {}
    for r in rows:
        row = out.setdefault(r["budget"], {"budget": r["budget"], "slots": r["slots"]})
        if budget_gb is not None:
            row["cache_gb"] = budget_gb[r["budget"]]
        row[r["policy"]] = r[key]
    return list(out.values())


def gaps(rows: list[dict]) -> list[dict]:
    """Per budget, the share of the gap from the best baseline's TPOT to the oracle's that fmoe closes."""
    out = []
    for budget in dict.fromkeys(r["budget"] for r in rows):
        gap = h.gap_closed({r["policy"]: r["median_tpot_s"] for r in rows if r["budget"] == budget})
        if gap:
            out.append(dict(budget=budget, **gap))
    return out


def plot(payload: dict, path) -> None:
    """Figure 11 from the saved results: median TPOT against the budget, one panel per model and source of
    numbers (live, each simulated preset), one line per policy (the same colours in every figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend = payload["machine"]["backend"]
    curves = {}
    for model, result in payload["models"].items():
        sources = {"live": (result["live"], "tpot_ms", "ms")} if result["live"] else {}
        sources |= {hw: (rows, "median_tpot_s", "s") for hw, rows in result["sim"].items()}
        for mode, (rows, key, unit) in sources.items():
            sizes = "" if mode == "live" else f" at {h.simulated_sizes(payload, model)}"
            title = f"{h.mode_title(mode, backend)}\n{model}{sizes}"
            by_policy = {}
            for r in rows:
                by_policy.setdefault(r["policy"], {})[r["budget"]] = r[key]
            curves[title] = (by_policy, f"median TPOT ({unit}, log scale)")
    colour = h.colours([p for by_policy, _ in curves.values() for p in by_policy])
    ncols = min(3, len(curves))
    nrows = -(-len(curves) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows + 0.8), squeeze=False)
    for ax, (title, (by_policy, ylabel)) in zip(axes.flat, curves.items(), strict=False):
        for policy, points in by_policy.items():
            xs = sorted(points)
            ax.plot(
                xs,
                [points[x] for x in xs],
                marker="o",
                color=colour[policy],
                lw=2.2 if policy == "fmoe" else 1.2,
            )
        ax.set_title(title, fontsize=9)
        ax.set(xlabel="expert cache budget (fraction of experts)", ylabel=ylabel, yscale="log")
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=c, marker="o", lw=2) for c in colour.values()]
    fig.legend(handles, list(colour), loc="lower center", ncol=len(colour), fontsize=8, frameon=False)
    fig.suptitle("TPOT against the expert cache budget (figure 11)", fontsize=11)
    fig.tight_layout(rect=(0, 0.8 / (3.6 * nrows + 0.8), 1, 1))
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser, live_requests=8, model=h.default_models() + list(h.PRESET_REPLAYS))
    h.add_merge_argument(parser)
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.125, 0.25, 0.375, 0.5, 0.75],
        help="expert cache budgets, fractions of all routed experts",
    )
    parser.add_argument(
        "--policies", nargs="+", default=list(h.POLICIES), choices=h.POLICIES, help="policies compared"
    )
    args = parser.parse_args(argv)

    tables, payload, notes = {}, {"models": {}}, []
    for name in args.model:
        w = h.load_workload(name, args)
        notes.append(h.settings_note(w) + " (the budget varies here)")
        result = payload["models"][w.name] = {"live": [], "sim": {}}
        if not args.no_live and not w.simulated_only:
            for budget in args.budgets:
                print(
                    f"[{w.name}] live, budget {budget}, the policies interleaved request by request",
                    flush=True,
                )
                for label, r in h.run_live_interleaved(w, h.variants(args.policies), budget=budget).items():
                    result["live"].append(
                        dict(
                            budget=budget,
                            slots=w.slots(budget),
                            policy=label,
                            hit_rate=r["hit_rate"],
                            tpot_ms=1e3 * r["median_tpot_s"],
                            ttft_ms=1e3 * r["median_ttft_s"],
                            requests=r["requests"],
                            compilations=r["compilations"],
                        )
                    )
            rows = result["live"]
            tables[f"{w.name}, live: median TPOT (ms)"] = pivot(rows, "tpot_ms")
            tables[f"{w.name}, live: hit rate"] = pivot(rows, "hit_rate")
        if not args.no_sim:
            for hw in args.hardware:
                rows = result["sim"][hw] = []
                gb = {b: w.slots(b) * w.preset.expert_bytes / 1e9 for b in args.budgets}
                for budget in args.budgets:
                    for v in h.runnable(w, h.variants(args.policies)):
                        print(f"[{w.name}] simulated {v.label} on {hw}, budget {budget}", flush=True)
                        r = h.run_sim(w, v, hw, budget=budget)
                        rows.append(
                            dict(
                                budget=budget,
                                slots=w.slots(budget),
                                policy=v.label,
                                **h.sim_row(r),
                                fits_device=r.fits_device,
                            )
                        )
                caption = f"{w.name}, simulated at {w.sizes()} on {hw}"
                tables[f"{caption}: median TPOT (s)"] = pivot(rows, "median_tpot_s", gb)
                tables[f"{caption}: hit rate"] = pivot(rows, "hit_rate", gb)
                tables[f"{caption}: share of the best baseline's gap to the oracle fmoe closes"] = gaps(rows)
                unfit = sorted({r["budget"] for r in rows if not r["fits_device"]})
                if unfit:
                    notes.append(f"{hw}: budgets {unfit} exceed the device memory (cache + dense weights)")
        w.close()
    for caption, rows in list(tables.items()):
        policies = [p for p in (rows[0] if rows else {}) if p not in ("budget", "slots", "cache_gb", "fmoe")]
        if "fmoe" in (rows[0] if rows else {}) and "TPOT" in caption:
            wins = {p: int(np.sum([r["fmoe"] <= r[p] for r in rows])) for p in policies}
            notes.append(f"{caption}: budgets where fmoe's TPOT <= each policy's (of {len(rows)}): {wins}")
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    h.write_results(
        NAME,
        "Experiment 4: TPOT against the expert cache budget (figure 11)",
        payload,
        tables,
        notes,
        args.out,
        merge=args.merge,
    )
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
