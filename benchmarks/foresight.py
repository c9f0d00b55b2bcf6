"""What fMoE's simulated TPOT is worth in tokens of foresight: its share of the gap between the best baseline
and the oracle, beside the same oracle allowed to see only the rest of the current token and the next n.

    python -m benchmarks.foresight [--split eval|validation] [--budgets 0.125 0.25 0.5] [--horizons 0 1 2 4]

Issue 16 asks fMoE to close half of the gap between the fastest baseline and the oracle (`Oracle`: Belady
eviction and perfect prefetch one layer ahead, knowing every future routing). A causal policy cannot know
the next tokens' routing; the oracle limited to `horizon` = n tokens (`Oracle(horizon=n)`: it sees the rest
of the current decode iteration and the next n, and ranks an expert it does not see again as never needed)
measures what each token of foresight is worth under the same transfer engine. n = 0 is perfect knowledge
of the current token alone (what within-token prediction could at best give); fMoE's reuse forecast tries
to guess what n >= 1 knows.

For every model, `--hardware` preset and budget, every policy is simulated at the preset's real sizes (and
Mixtral-family routing also at Phi-3.5-MoE's, as in experiment 8) on the replayed prompts (each after
warming on the first store prompts, as in experiment 4). `--model gpt-oss-20b-routing[@int4]` replays
gpt-oss-20b's real routing (`benchmarks/real_routing.py`'s split, the baselines its traces can drive);
`--merge` keeps the saved rows of the other models. Each row gives the best baseline (lowest median
TPOT among the non-oracle policies other than fmoe), the oracle's TPOT and
the closure of fmoe and of each limited oracle: (best - x) / (best - oracle); 1 is the oracle, 0 the best
baseline, below 0 slower than it. `fmoe_matches` is the most tokens of foresight whose oracle fmoe is at
least as fast as (-1: slower than the oracle that knows the current token). Simulated only.
Writes `foresight.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

NAME = "foresight"
BASELINES = tuple(p for p in h.POLICIES if p not in ("fmoe", "oracle"))


def oracle_label(horizon: int) -> str:
    return f"oracle, {horizon} token(s)"


def variants(horizons: list[int]) -> list[h.Variant]:
    limited = [h.Variant(oracle_label(n), "oracle", (("horizon", n),)) for n in horizons]
    return [*h.variants(BASELINES), h.Variant("fmoe", "fmoe"), *limited, h.Variant("oracle", "oracle")]


def closure(best: float, oracle: float, tpot: float) -> float:
    """The share of the gap between the best baseline's TPOT and the oracle's that `tpot` closes."""
    return (best - tpot) / (best - oracle) if best != oracle else float("nan")


def summarise(tpot: dict[str, float], horizons: list[int]) -> dict[str, Any]:
    """One row from the median TPOT (s) of every variant at one (model, preset, budget) point (the best
    baseline: the fastest of those run)."""
    best = min((p for p in tpot if p not in ("fmoe", "oracle") and not p.startswith("oracle,")), key=tpot.get)
    oracle = tpot["oracle"]
    row: dict[str, Any] = dict(best_baseline=best, best_tpot_s=tpot[best], oracle_tpot_s=oracle)
    row["fmoe_tpot_s"] = tpot["fmoe"]
    row["fmoe_closure"] = closure(tpot[best], oracle, tpot["fmoe"])
    for n in horizons:
        row[f"closure_{n}_tokens"] = closure(tpot[best], oracle, tpot[oracle_label(n)])
    beaten = [n for n in sorted(horizons) if tpot["fmoe"] <= tpot[oracle_label(n)]]
    row["fmoe_matches"] = max(beaten) if beaten else -1
    return row


def sizes(workload: h.Workload) -> list:
    """The real models a workload's traces replay at: its own family's, and also Phi-3.5-MoE's for Mixtral's
    traces (both top-2 over 4096-wide experts; the trace keeps its 8 experts a layer), as in experiment 8."""
    from fmoe_jax.offload.cost_model import PHI35_MOE

    if not workload.recorded or workload.args.sim_model == "own" or workload.config.family != "mixtral":
        return [workload.preset]
    return [workload.preset, PHI35_MOE]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    parser.add_argument("--horizons", type=int, nargs="+", default=[0, 1, 2, 4], help="tokens of foresight")
    h.add_merge_argument(parser)
    args = parser.parse_args(argv)
    rows, notes = [], []
    for name in args.model:
        w = h.load_workload(name, args)
        group = h.runnable(w, variants(args.horizons))
        notes.append(h.settings_note(w) + " (the budget varies here)")
        for size in sizes(w):
            label = w.name if size is w.preset else f"{w.name} @ {size.name}"
            for budget in args.budgets:
                for hw in args.hardware:
                    tpot = {}
                    for v in group:
                        print(f"[{label}] {budget:.3g} {hw}: {v.label}", flush=True)
                        tpot[v.label] = h.run_sim(w, v, hw, budget=budget, model=size).median_tpot_s
                    point = dict(model=label, hardware=hw, budget=budget, slots=w.slots(budget))
                    point["split"] = args.split
                    rows.append(point | summarise(tpot, args.horizons) | {"tpot_s": tpot})
        w.close()
    payload = {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.merge and (args.out / f"{NAME}.json").exists():
        payload, notes = merged(h.saved(NAME, args.out), payload, notes)
    rows = payload["rows"]
    table = [{k: v for k, v in r.items() if k != "tpot_s"} for r in rows]
    splits = sorted({r["split"] for r in rows})
    split = f"{splits[0]} split" if len(splits) == 1 else "each row's split"
    notes.append(
        "closure: (best baseline's TPOT - x) / (best baseline's - oracle's), x fmoe's or the oracle's "
        "limited to n tokens of foresight (the rest of the current token and the next n); fmoe_matches: the "
        "most tokens whose limited oracle fmoe is at least as fast as (-1: none); simulated at the presets' "
        f"sizes, {split}"
    )
    caption = f"fmoe and the oracle with limited foresight: the gap closed ({split}, simulated)"
    h.write_results(NAME, "Foresight: what fMoE's TPOT is worth", payload, {caption: table}, notes, args.out)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


def merged(saved: dict, payload: dict, notes: list[str]) -> tuple[dict, list[str]]:
    """`--merge`: the saved rows and settings notes of the models not run now, then this run's; the saved
    arguments stay (each row names its split), and this run's command is listed under `merged`."""
    models = {r["model"] for r in payload["rows"]}

    def mine(note: str) -> bool:
        return any(note.startswith(f"{m}:") for m in models)

    kept = [r for r in saved["rows"] if r["model"] not in models]
    for r in kept:  # rows saved before each row named its split: the whole run's
        r.setdefault("split", saved["args"].get("split", "eval"))
    old_notes = [n for n in saved["notes"] if not mine(n) and not n.startswith("closure:")]
    out = {"rows": kept + payload["rows"], "args": saved.get("args", payload["args"])}
    out["command"] = saved["command"]  # the whole run's, which `rerun` repeats
    out["merged"] = [*saved.get("merged", []), {"command": h.command_line(), "models": sorted(models)}]
    return out, old_notes + notes


def plot(payload: dict, path) -> None:
    """Per model and preset: the share of the gap closed at each budget, fmoe beside the limited oracles."""
    split = payload["args"].get("split", "eval")
    panels: dict[str, dict[str, dict[str, float]]] = {}
    splits = {r.get("split", split) for r in payload["rows"]}
    split = f"{split} split" if len(splits) == 1 else "each panel's split"
    for r in payload["rows"]:
        bars = {"fmoe": r["fmoe_closure"]}
        bars |= {oracle_label(int(k.split("_")[1])): v for k, v in r.items() if k.startswith("closure_")}
        panel = f"{r['model']}, {h.mode_title(r['hardware'])}"
        panels.setdefault(panel, {})[f"{r['budget']:.3g} cached"] = bars
    title = f"Share of the gap between the best baseline and the oracle closed ({split})"
    h.grouped_bars(path, title, panels, ncols=2)


if __name__ == "__main__":
    main()
