"""The simulator's speed against an earlier commit's, paired: how much faster the code has become, whatever
the host's own speed that day.

    python -m benchmarks.sim_speed_paired [--against 273eabb] [--pairs 3] [--requests 20]

`sim_speed`'s workload (its `--requests` evaluation requests of gpt-oss-20b's routing at its sizes, RTX 3090
preset, 25 %; fmoe from a 48-request store, inline, on routing alone) is replayed by this tree's library and
by `--against`'s (its `fmoe_jax`, `models`, `offload`, `convert` and `research` taken with `git archive`),
each in a fresh subprocess, the two taking turns (which goes first alternates) `--pairs` times per policy.
Each replay reports this process's CPU time; a pair's ratio is the earlier commit's CPU time over this
tree's (above 1: faster now), and the median of the pairs is the answer. The host's speed drifts by tens of
per cent between sessions (other tenants, host builds), which a single `sim_speed` figure cannot tell apart
from the code; a pair shares the host's state of the moment. Both sides' simulated TPOT and hit rate are
recorded: equal floats mean the two trees replayed the same outcome.

The default `--against`, 273eabb, is the last commit before the speed work of the issue on the simulator
(2026-11-29 05:57 UTC), when fmoe-sim and `RoutingTrace.from_external` had just landed.
Writes `sim_speed_paired.{json,md}` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "sim_speed_paired"
BEFORE_SPEED_WORK = "273eabb"
LIBRARY = ("fmoe_jax", "models", "offload", "convert", "research")  # pyproject's package-dir folders
SUBPACKAGES = LIBRARY[1:]  # folders that are subpackages of fmoe_jax once installed
ROOT = Path(__file__).resolve().parent.parent


# -- the child: one timed replay against whichever fmoe_jax comes first on the path -------------------------
def replay_in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed replay of the workload `spec` names (requests by name), through the public API both trees
    share; run in a subprocess whose `PYTHONPATH` puts one tree's library first."""
    from fmoe_jax.offload.config import OffloadConfig
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, RTX_3090
    from fmoe_jax.offload.policies import POLICIES
    from fmoe_jax.offload.policies.oracle import Oracle
    from fmoe_jax.offload.simulator import simulate

    import fmoe_jax
    from fmoe_jax.trace import RoutingTrace

    names = spec["replayed"] + spec["store"]
    try:
        whole = RoutingTrace.from_external(spec["data"], select=names)  # (a tree that can read a part)
    except TypeError:
        whole = RoutingTrace.from_external(spec["data"])
    by_name = {r["request"]: req for r, req in zip(whole.meta["requests"], whole.requests, strict=True)}
    records = {r["request"]: r for r in whole.meta["requests"]}

    def traces(chosen: list[str]) -> list[Any]:
        meta = {**whole.meta, "requests": [records[n] for n in chosen]}
        return [RoutingTrace(meta, [by_name[n]]) for n in chosen]

    replayed, store = traces(spec["replayed"]), traces(spec["store"])
    name = spec["policy"]
    if name == "oracle":
        policy = Oracle(replayed)
    elif name == "fmoe":
        policy = POLICIES["fmoe"].from_traces(
            store, prefetch_distance=3, store_capacity=512, semantic=False, asynchronous=False
        )
    else:
        policy = POLICIES[name]()
    meta = replayed[0].meta
    slots = round(spec["budget"] * meta["num_layers"] * meta["num_experts"])
    offload = OffloadConfig(policy=policy, cache_experts=slots)
    cpu = time.process_time()
    result = simulate(replayed, offload, model=GPT_OSS_20B, hardware=RTX_3090)
    cpu = time.process_time() - cpu
    events = sum(len(t.requests[0].iterations) for t in replayed) * meta["num_layers"]
    return dict(
        library=str(Path(fmoe_jax.__file__).parent.resolve()),
        cpu_s=cpu,
        events_per_cpu_s=events / cpu,
        tpot_ms=1e3 * result.median_tpot_s,
        hit_rate=result.hit_rate,
    )


# -- the parent ----------------------------------------------------------------------------------------------
def library(rev: str | None, workdir: Path) -> Path:
    """A folder to put first on `PYTHONPATH` so that `import fmoe_jax` loads `rev`'s library (None: this
    working tree's), laid out as the package installs it (subpackages from their own folders)."""
    source = ROOT
    if rev is not None:
        source = workdir / "src"
        source.mkdir(parents=True)
        paths = [*LIBRARY, ":(exclude)fmoe_jax/shipped"]  # (the shipped models: not needed, 50+ MB)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, *paths], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    lib = workdir / "lib" / "fmoe_jax"
    lib.mkdir(parents=True)
    for entry in (source / "fmoe_jax").iterdir():
        (lib / entry.name).symlink_to(entry)
    for folder in SUBPACKAGES:
        (lib / folder).symlink_to(source / folder)
    return lib.parent


def run_child(lib: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(lib)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=lib,  # not the repository root: nothing there shadows the library
    )
    if done.returncode:
        raise RuntimeError(f"the replay against {lib} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["library"]).is_relative_to(lib.resolve()):  # (not the installed one, say)
        raise RuntimeError(f"the replay loaded {out['library']}, not the library under {lib}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks import harness as h
    from benchmarks import real_routing
    from benchmarks.common import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--against", default=BEFORE_SPEED_WORK, help="the earlier commit")
    parser.add_argument("--pairs", type=int, default=3, help="paired replays per policy")
    parser.add_argument("--requests", type=int, default=20, help="evaluation requests replayed")
    parser.add_argument("--store", type=int, default=48, help="store requests fmoe's store is built from")
    parser.add_argument("--budget", type=float, default=0.25, help="cache, a share of all experts")
    parser.add_argument("--policies", nargs="+", default=["on_demand_lru", "fmoe"])
    parser.add_argument("--data", type=Path, default=real_routing.DEFAULT_PATH, help="the routing set")
    parser.add_argument("--out", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True, text=True
    )
    if commit.returncode:
        parser.error(f"--against {args.against}: not a commit of this repository")
    spec = dict(
        data=str(args.data.resolve()),
        replayed=real_routing.request_names("evaluation", args.data, args.requests),
        store=real_routing.request_names("store", args.data, args.store),
        budget=args.budget,
    )
    rows, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"now": library(None, Path(tmp, "now")), "before": library(args.against, Path(tmp, "before"))}
        for policy in args.policies:
            ratios = []
            for pair in range(args.pairs):
                sides = ("before", "now") if pair % 2 == 0 else ("now", "before")
                got = {side: run_child(libs[side], {**spec, "policy": policy}) for side in sides}
                ratio = got["before"]["cpu_s"] / got["now"]["cpu_s"]
                ratios.append(ratio)
                for side in sides:
                    rows.append(
                        dict(policy=policy, pair=pair, side=side, first=side == sides[0], **got[side])
                    )
                    del rows[-1]["library"]
                print(
                    f"{policy} pair {pair}: before {got['before']['events_per_cpu_s']:,.0f}, now "
                    f"{got['now']['events_per_cpu_s']:,.0f} layer events per CPU second: {ratio:.2f}x",
                    flush=True,
                )
            outcome = [(r["tpot_ms"], r["hit_rate"]) for r in rows if r["policy"] == policy]
            summary.append(
                dict(
                    policy=policy,
                    median_speedup=float(sorted(ratios)[len(ratios) // 2]),
                    speedups=[round(r, 3) for r in ratios],
                    before_events_per_cpu_s=_median(rows, policy, "before"),
                    now_events_per_cpu_s=_median(rows, policy, "now"),
                    same_outcome=len(set(outcome)) == 1,
                )
            )
    notes = [
        f"{len(spec['replayed'])} evaluation requests of gpt-oss-20b's routing (each its own batch), "
        f"replayed at gpt-oss-20b sizes (MXFP4 experts) on the RTX 3090 preset, {args.budget:.0%} cached, by "
        f"this tree's library ('now') and {commit.stdout.strip()}'s ('before'), each in a fresh subprocess, "
        f"taking turns {args.pairs} times per policy; speedup: before's CPU seconds over now's, per pair; "
        "median of the pairs",
        "same_outcome: both trees' simulated median TPOT and hit rate equal to the last bit at every replay",
    ]
    changed = [row["policy"] for row in summary if not row["same_outcome"]]
    if changed:
        notes.append(
            f"{', '.join(changed)}: the two trees replay different outcomes (the policy decides differently "
            "between them: a default changed, benchmarks/DECISIONS.md), so its speedup compares different "
            "work as well as faster code"
        )
    payload = {"summary": summary, "rows": rows, "against": commit.stdout.strip(), "args": vars(args)}
    payload["args"] = {k: str(v) for k, v in payload["args"].items()}
    title = f"Simulator speed, paired against {commit.stdout.strip()}"
    h.write_results(NAME, title, payload, {"speedup": summary, "replays": rows}, notes, args.out)
    plot(payload, args.out / f"{NAME}.png")
    return payload


def plot(payload: dict[str, Any], path: Path) -> None:
    """Layer events per CPU second, before and now, per policy (the medians of the pairs)."""
    from benchmarks.common import grouped_bars

    summary, against = payload["summary"], payload["against"]
    groups = {
        r["policy"]: {against: r["before_events_per_cpu_s"], "now": r["now_events_per_cpu_s"]}
        for r in summary
    }
    title = f"Simulator speed, paired against {against}\n(gpt-oss-20b's routing, RTX 3090 preset, 25 %)"
    grouped_bars(path, title, {"layer events / CPU s, median of the pairs": groups}, ncols=1)


def _median(rows: list[dict[str, Any]], policy: str, side: str) -> float:
    values = sorted(r["events_per_cpu_s"] for r in rows if r["policy"] == policy and r["side"] == side)
    return float(values[len(values) // 2])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(replay_in_child(json.loads(sys.argv[2]))))
    else:
        main()
