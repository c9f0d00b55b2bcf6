"""Rerun every experiment whose results follow from the policies' decisions, then regenerate the READMEs.

    .venv/bin/python -m benchmarks.rerun [--only exp2_overall foresight ...] [--dry-run]

A change to what a policy decides (fmoe's rules, the simulator, a baseline) moves every simulated table, so
they are rerun together and the READMEs stay true to the code. Each experiment is run with the command its
committed results record (`command` in `results/<name>.json`), so its arguments stay those of the tables
it replaces. The simulated-only experiments (`SIMULATED`: their numbers do not depend on this machine's
speed) go first, two at a time on the two cores; the ones with live runs or host timings (`TIMED`) then go
one at a time with nothing beside them, as their numbers need. Prints each run's wall time; a failed run
stops the rest (its results file is left as the run left it: `git checkout benchmarks/results` restores
the committed ones). Then `benchmarks.make_readme`. Durations on the 2-core development VM (alone):
external_routing ~30 min, foresight ~13, exp8 ~9; exp5 ~30, exp4 ~22, exp2 ~11, exp6 ~5, exp3 ~4, exp7 ~3:
about 1 h 45 min in all.

The experiments that do not replay policies (exp1's routing statistics, the accelerator runs, conversion
speed, quantization) are not rerun here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
SIMULATED = ("external_routing", "foresight", "exp8_hybrid")  # longest first: two side by side
TIMED = (
    "exp5_ablation",
    "exp4_cache_budget",
    "exp2_overall",
    "exp6_sensitivity",
    "exp3_online",
    "exp7_overhead",
)


def recorded_command(name: str, results: Path) -> list[str]:
    """The command `results/<name>.json` was made with, as argv run from the repository root."""
    path = results / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m benchmarks.{name}` once by hand first.")
    command = json.loads(path.read_text()).get("command")
    if not command:
        raise ValueError(f"{path} records no command; run `python -m benchmarks.{name}` by hand.")
    argv = shlex.split(command)
    if "-m" not in argv or argv[argv.index("-m") + 1] != f"benchmarks.{name}":
        raise ValueError(f"{path} records {command!r}, not a run of benchmarks.{name}.")
    return [sys.executable, *argv[argv.index("-m") :]]  # this interpreter, whatever the record's path


def run(name: str, argv: list[str]) -> int:
    """One experiment, to its end; prints its wall time and returns its exit code."""
    start = time.perf_counter()
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}  # one BLAS thread a process unless told otherwise
    code = subprocess.run(argv, cwd=ROOT, env=env).returncode
    print(f"[rerun] {name}: exit {code} after {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return code


def run_all(simulated: list[tuple[str, list[str]]], timed: list[tuple[str, list[str]]]) -> None:
    """The simulated experiments two at a time (each next one as a core frees), then the timed ones alone;
    stops at the first failure."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        codes = dict(zip([n for n, _ in simulated], pool.map(lambda job: run(*job), simulated), strict=True))
    failed = [name for name, code in codes.items() if code]
    for name, argv in timed:
        if failed:
            break
        if run(name, argv):
            failed.append(name)
    if failed:
        raise SystemExit(f"[rerun] {', '.join(failed)} failed; the experiments after it were not run.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    everything = [*SIMULATED, *TIMED]
    parser.add_argument("--only", nargs="+", choices=everything, default=everything, help="these alone")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the recorded commands are")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args(argv)
    simulated = [(n, recorded_command(n, args.results)) for n in SIMULATED if n in args.only]
    timed = [(n, recorded_command(n, args.results)) for n in TIMED if n in args.only]
    for name, command in simulated + timed:
        how = "two at a time" if name in SIMULATED else "alone"
        print(f"[rerun] {name} ({how}): {shlex.join(command[1:])}", flush=True)
    if args.dry_run:
        return
    run_all(simulated, timed)
    subprocess.run([sys.executable, "-m", "benchmarks.make_readme"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
