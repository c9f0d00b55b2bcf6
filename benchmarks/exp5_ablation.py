"""Experiment 5 (paper figure 12): ablations of fMoE's expert-pattern tracking and of its caching.

    .venv/bin/python -m benchmarks.exp5_ablation [--model ...]

(a) Pattern tracking: `speculate` (Mixtral-Offloading's next-layer gate, the `mixtral_offload` policy), `hit
count` (MoE-Infinity's request-level activation counts, `moe_infinity`), `map(T)` (fmoe with trajectory search
only and exactly top-k per layer), `map(T+S)` (plus semantic search), `map(T+S+delta)` (plus similarity-aware
selection: full fMoE), each prefetching every selected expert as the paper does, then `+ cost admission` (the
default fmoe: prefetch only what pays for its copy). Unlike the paper, which ported speculation and hit counts
into fMoE's matcher, the first two rows are the complete baselines with their own cache rules. (b) Caching:
full fMoE prediction (every selected expert prefetched) with LRU, LFU, fMoE's p * freq or our reuse eviction.
Hit rates live, simulated with synchronous copies (prediction and caching alone) and asynchronous ones (with
TPOT), on each `--hardware` preset. (c) What the default fmoe is made of (issue 16), simulated only: the reuse
forecast without the learned reuse predictor (the store's hint instead), each eviction rule with its cost
admission, calibration, the next-token guess, the popularity prior and (on routing recorded elsewhere,
where no reuse predictor replaces them) the token contexts off, the searches resting only
2 ** (n - 1) layers after n repeated matches in a row (`resting="doubling"`, the rule before 2026-11-28; the
default rests the iteration out after its first repeat), the two earlier admission rules (as if the
link were free; after the copies and misses queued ahead), no prefetch at all, whole copies and one chunk
per matrix (the default is the cost model's choice, `HardwarePreset.copy_chunks`: per matrix on the RTX
3090, whole on the H100), started prefetches cancelled between chunks, and Belady's eviction with 1, 2 or 4
tokens of foresight or the whole future (on-demand loads, no prefetch) beside the oracle (Belady plus
perfect prefetch one layer ahead).
Writes `exp5_ablation.{json,md,png}` to --out.

`--model gpt-oss-20b-routing[@int4]` (add `--merge` to keep the shipped models' tables) replays gpt-oss-20b's
real decode routing instead, simulated only, at its sizes with bf16 (or int4, int8, mxfp4) experts:
`benchmarks/real_routing.py`'s split, policies learning from its store part, `--routing-requests` of its
evaluation part replayed (`--split validation`: its validation part).
"""

from __future__ import annotations

import argparse

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

NAME = "exp5_ablation"
ALL = (("admission", "all"),)  # prefetch every selected expert, as the paper: the rows compare prediction
TRACKING = [
    h.Variant("speculate", "mixtral_offload"),
    h.Variant("hit count", "moe_infinity"),
    h.Variant("map(T)", "fmoe", (("semantic", False), ("dynamic_delta", False), *ALL)),
    h.Variant("map(T+S)", "fmoe", (("dynamic_delta", False), *ALL)),
    h.Variant("map(T+S+delta)", "fmoe", ALL),
    h.Variant("+ cost admission", "fmoe"),  # the default fmoe policy
]
CACHING = [
    h.Variant("LRU", "fmoe", (("eviction", "lru"), *ALL)),
    h.Variant("LFU", "fmoe", (("eviction", "lfu"), *ALL)),
    h.Variant("fMoE", "fmoe", (("eviction", "fmoe"), *ALL)),
    h.Variant("reuse", "fmoe", (("eviction", "reuse"), *ALL)),
]
PARTS = [
    h.Variant("fmoe (default: reuse eviction)", "fmoe"),
    h.Variant("no reuse predictor", "fmoe", (("reuse_predictor", None),)),
    h.Variant("eviction fMoE (p * freq)", "fmoe", (("eviction", "fmoe"),)),
    h.Variant("eviction LFU", "fmoe", (("eviction", "lfu"),)),
    h.Variant("eviction LRU", "fmoe", (("eviction", "lru"),)),
    h.Variant("calibration off", "fmoe", (("calibrate", False),)),
    h.Variant("no next-token guess", "fmoe", (("next_token", False),)),
    h.Variant("doubling rest after repeated matches", "fmoe", (("resting", "doubling"),)),
    h.Variant("no popularity prior", "fmoe", (("popularity", False),)),
    h.Variant("no token contexts", "fmoe", (("token_contexts", False),)),
    h.Variant("admission: lands in time, pays for its stalls", "fmoe", (("link", "stalls"),)),
    h.Variant("admission after the link's queue", "fmoe", (("link", "queue"),)),
    h.Variant("no prefetch", "fmoe", (("admission", 2.0),)),  # no probability reaches 2
    h.Variant("whole copies", "fmoe", chunks=1),
    h.Variant("one chunk per matrix", "fmoe", chunks=3),
    h.Variant("cancel between chunks", "fmoe", finish_started=False),
    *(h.Variant(f"Belady, {n} token(s)", "oracle", (("prefetch", False), ("horizon", n))) for n in (1, 2, 4)),
    h.Variant("Belady, whole future", "oracle", (("prefetch", False),)),
    h.Variant("oracle", "oracle"),
]


def groups(w: h.Workload) -> tuple[list[h.Variant], list[h.Variant], list[h.Variant]]:
    """(tracking, caching, parts) for the workload: on routing recorded elsewhere (no embeddings, no router
    inputs) speculation, semantic search and the reuse predictor are out, and map(T+delta) stands for
    map(T+S+delta); where the default fmoe has its reuse predictor, the token contexts are off already."""
    if w.recorded:
        return TRACKING, CACHING, [v for v in PARTS if v.label != "no token contexts"]
    tracking = [v for v in TRACKING if v.label in ("hit count", "map(T)")]
    tracking += [h.Variant("map(T+delta)", "fmoe", (("semantic", False), *ALL)), TRACKING[-1]]
    return tracking, CACHING, [v for v in PARTS if v.label != "no reuse predictor"]


def rows_for(w: h.Workload, group: list[h.Variant], args, *, live: bool = True) -> list[dict]:
    rows = []
    for v in group:
        row = {"variant": v.label}
        if live and not args.no_live and not w.simulated_only:
            print(f"[{w.name}] live {v.label}", flush=True)
            r = h.run_live(w, v)
            row |= dict(live_hit_rate=r["hit_rate"], live_tpot_ms=1e3 * r["median_tpot_s"])
        if not args.no_sim:
            for hw in args.hardware:
                print(f"[{w.name}] simulated {v.label} on {hw}", flush=True)
                if hw == args.hardware[0]:
                    row["sim_hit_rate_sync"] = h.run_sim(w, v, hw, synchronous=True).hit_rate
                r = h.run_sim(w, v, hw)
                row |= {f"{hw}_hit_rate": r.hit_rate, f"{hw}_tpot_s": r.median_tpot_s}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    h.add_merge_argument(parser)
    args = parser.parse_args(argv)
    tables, payload, notes = {}, {"models": {}}, []
    for name in args.model:
        w = h.load_workload(name, args)
        notes.append(h.settings_note(w))
        tracking_group, caching_group, parts_group = groups(w)
        tracking, caching = rows_for(w, tracking_group, args), rows_for(w, caching_group, args)
        parts = rows_for(w, parts_group, args, live=False)
        payload["models"][w.name] = {"tracking": tracking, "caching": caching, "parts": parts}
        tables[f"{w.name}: (a) expert-pattern tracking"] = tracking
        tables[f"{w.name}: (b) prefetching and caching (eviction)"] = caching
        tables[f"{w.name}: (c) the default fmoe's parts, and Belady's foresight (simulated)"] = parts
        w.close()
    notes.append("sim_hit_rate_sync: simulated on the first --hardware preset with synchronous copies")
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    title = "Experiment 5: ablation study (figure 12)"
    h.write_results(NAME, title, payload, tables, notes, args.out, merge=args.merge)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


def plot(payload: dict, path) -> None:
    """Figure 12 from the saved results: hit rate of each ablation variant, live and simulated (synchronous
    copies on the first preset: prediction and caching alone)."""
    backend = payload["machine"]["backend"]
    hardware = payload["args"].get("hardware", "")
    first = hardware.strip("[]").split(",")[0].strip(" '\"") if hardware else ""
    sources = {
        "live_hit_rate": h.mode_title("live", backend),
        "sim_hit_rate_sync": f"{h.mode_title(first)}, synchronous copies" if first else "simulated",
    }
    panels = {}
    for model, result in payload["models"].items():
        parts = (
            ("tracking", "(a) expert-pattern tracking"),
            ("caching", "(b) eviction"),
            ("parts", "(c) parts"),
        )
        for part, name in parts:
            rows = result.get(part, [])
            for key, where in sources.items():
                if rows and key in rows[0]:
                    panels.setdefault(f"{where}\n{name}: hit rate", {})[model] = {
                        r["variant"]: r[key] for r in rows
                    }
    h.grouped_bars(path, "Ablations of fMoE (figure 12): expert hit rate", panels, ncols=2)


if __name__ == "__main__":
    main()
