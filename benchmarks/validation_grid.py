"""Design on the validation split: policy variants against a baseline, simulated at every (model, budget,
hardware preset) point. Issue 16's rule is to choose designs here and only report on the evaluation prompts;
this script cannot replay those.

    .venv/bin/python -m benchmarks.validation_grid --variant fmoe 'whole=fmoe:{"chunks": 1}'
    .venv/bin/python -m benchmarks.validation_grid --variant 'cap512=fmoe:{"store_capacity": 512}'

A variant is `policy`, `label=policy` or `label=policy:{json}`; the JSON holds policy options, plus three
settings that are not the policy's: "chunks" (the pieces a copy goes over the link in: 1 whole, 3 one per
matrix; default the simulator's), "store_capacity" (fmoe's store) and "execution" ("hybrid"). The first
`--baseline` (default on-demand LRU) is the ratio's denominator at each point; give it the same "chunks" as
a variant to compare like with like. Prints each point, then each variant's geometric mean and worst ratio;
`--out FILE` also saves them as JSON. The store prompts are split 7:3 again (`harness.split_prompts`) and
the 30 % replayed; traces and trained predictors are cached like every experiment's.

Each row also carries a `fingerprint` of everything its replay measured (`fingerprint`); `--compare FILE`
reports the points whose fingerprints differ from an earlier `--save`. A change meant to leave decisions as
they were (host-side speed, refactoring) shows as identical at every point, which spares rerunning the
simulated experiments:

    .venv/bin/python -m benchmarks.validation_grid --variant fmoe --save before.json   # then change the code
    .venv/bin/python -m benchmarks.validation_grid --variant fmoe --compare before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

SETTINGS = ("chunks", "store_capacity", "execution")  # variant keys that are not policy options


def parse_variant(spec: str) -> tuple[h.Variant, int | None]:
    """`label=policy:{json}` -> (the variant, its store capacity or None: the workload's)."""
    label, _, rest = spec.rpartition("=")
    policy, _, options = rest.partition(":")
    options = json.loads(options) if options else {}
    if not isinstance(options, dict):
        raise ValueError(f"variant {spec!r}: options must be a JSON object, got {options!r}")
    settings = {k: options.pop(k) for k in SETTINGS if k in options}
    variant = h.Variant(
        label or policy,
        policy,
        tuple(options.items()),
        chunks=settings.get("chunks"),
        execution=settings.get("execution", "copy"),
    )
    return variant, settings.get("store_capacity")


# `SimResult` fields added after saves that comparisons still read, with their default value: left out of a
# fingerprint while at it (engine costs' launches and syncs count only on hardware that charges them).
LATER_FIELDS = {"launches": 0, "syncs": 0}


def fingerprint(result: Any) -> str:
    """A short hash of every field of a simulated replay's `SimResult` (per-request TTFT and TPOT, every
    count, the policy's stats), floats written exactly: replays share it only if they came out the same."""

    def plain(value: Any) -> Any:  # NumPy values whole (an array's repr elides its middle)
        return value.tolist() if hasattr(value, "tolist") else repr(value)

    values = dataclasses.asdict(result)
    for name, default in LATER_FIELDS.items():  # at their default, as replays saved before they existed
        if values.get(name) == default:
            del values[name]
    fields = json.dumps(values, sort_keys=True, default=plain)  # floats as repr: exact
    return hashlib.sha256(fields.encode()).hexdigest()[:16]


def compare(rows: list[dict], earlier: list[dict]) -> tuple[int, list[str]]:
    """(points of `rows` identical to `earlier`'s, a line for each point that differs or is new)."""
    key = ("model", "hardware", "budget", "variant")
    before = {tuple(r[k] for k in key): r for r in earlier}
    same, lines = 0, []
    for r in rows:
        point = " ".join(str(r[k]) for k in key)
        old = before.get(tuple(r[k] for k in key))
        if old is None:
            lines.append(f"{point}: not in the earlier save")
        elif old.get("fingerprint") == r["fingerprint"]:
            same += 1
        else:
            lines.append(f"{point}: differs (TPOT {old['tpot_ms']:.4f} -> {r['tpot_ms']:.4f} ms)")
    return same, lines


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.add_argument("--variant", nargs="+", required=True, help="label=policy:{json} (see above)")
    parser.add_argument("--baseline", default="on_demand_lru", help="the ratios' denominator, a variant")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    parser.add_argument("--host", default=None, help="host CPU preset (hybrid execution)")
    parser.add_argument("--save", type=Path, default=None, help="also write the rows and summary as JSON")
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="an earlier --save: report the points that came out otherwise",
    )
    parser.set_defaults(split="validation")
    args = parser.parse_args(argv)
    if args.split != "validation":
        parser.error("validation_grid replays the validation split only: designs are not chosen on eval")
    baseline, *variants = [parse_variant(s) for s in (args.baseline, *args.variant)]
    labels = [v.label for v, _ in (baseline, *variants)]
    if len(set(labels)) != len(labels):
        parser.error(f"variant labels must differ, got {labels}")

    rows = []
    for name in args.model:
        workload = h.load_workload(name, args)
        for budget in args.budgets:
            for hardware in args.hardware:
                point = {}
                for variant, capacity in (baseline, *variants):
                    config = {} if capacity is None else {"store_capacity": capacity}
                    r = h.run_sim(workload, variant, hardware, host=args.host, budget=budget, **config)
                    point[variant.label] = r
                base = point[baseline[0].label].median_tpot_s
                for label, r in point.items():
                    rows.append(
                        dict(
                            model=workload.name,
                            hardware=hardware,
                            budget=budget,
                            variant=label,
                            tpot_ms=1e3 * r.median_tpot_s,
                            hit_rate=r.hit_rate,
                            vs_baseline=r.median_tpot_s / base,
                            fingerprint=fingerprint(r),
                        )
                    )
                cells = " ".join(
                    f"{k} {1e3 * r.median_tpot_s:.2f} ms ({r.median_tpot_s / base:.3f}x)"
                    for k, r in point.items()
                )
                print(f"{workload.name} {hardware} {budget:g}: {cells}", flush=True)
        if workload.model is not None:  # routing recorded elsewhere has no model to close
            workload.model.close()
    summary = {
        label: {
            "geomean_vs_baseline": geometric_mean([r["vs_baseline"] for r in rows if r["variant"] == label]),
            "worst_vs_baseline": max(r["vs_baseline"] for r in rows if r["variant"] == label),
        }
        for label in labels
    }
    for label, s in summary.items():
        print(
            f"{label}: {s['geomean_vs_baseline']:.4f}x {baseline[0].label} (geometric mean), "
            f"worst {s['worst_vs_baseline']:.3f}x"
        )
    payload = {"rows": rows, "summary": summary, "command": h.command_line()}
    if args.compare is not None:
        same, lines = compare(rows, json.loads(args.compare.read_text())["rows"])
        print(f"identical to {args.compare} at {same} of {len(rows)} points", *lines, sep="\n")
        payload["identical_points"] = same
    if args.save is not None:
        args.save.write_text(json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    main()
