"""Conversion speed and memory on "bench-s" (about 3.2 GB float32), and how long loading the result takes.

    python -m benchmarks.convert_speed [--checkpoint DIR] [--repeats 3] [--out benchmarks/results]

Each measurement runs in a fresh child process: `fmoe-convert`'s own steps (validation, streaming, hashing,
manifest, rename; not interpreter start-up) give the throughput in MB of source per second, and the child's
peak RSS (`wait4`) is the memory the conversion needs. Then the converted checkpoint is restored with
experts to `pinned_host` (as `load_model(..., offload=...)` does), to the device, and through the full
`load_model` paths; the HF-directory load is the baseline. The multi-GB output is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, save, saved

TARGET_MB_S = 150.0
TARGET_RSS_MB = 1500.0
LOADS = (
    "restore_pinned_host",
    "restore_device",
    "load_model_offload",
    "load_model_resident",
    "load_model_hf",
)


def child(task: str, src: Path, out: Path) -> dict:
    """Runs in the child process; returns what it measured."""
    if task == "convert":
        from fmoe_jax.convert.cli import convert

        _, seconds = convert(src, out)
        return {"seconds": seconds}
    import jax
    from fmoe_jax.offload.config import OffloadConfig

    import fmoe_jax as fj
    from fmoe_jax.checkpoint import orbax_io
    from fmoe_jax.loading import param_sharding

    start = time.perf_counter()
    if task == "restore_pinned_host":
        _, _, flat = orbax_io.restore_params(out, sharding=lambda p: param_sharding(p, OffloadConfig()))
        kinds = sorted({a.sharding.memory_kind for p, a in flat.items() if p[0] == "experts"})
        jax.block_until_ready(list(flat.values()))
        return {"seconds": time.perf_counter() - start, "expert_memory_kinds": kinds}
    if task == "restore_device":
        _, _, flat = orbax_io.restore_params(out, sharding=lambda p: param_sharding(p, None))
        jax.block_until_ready(list(flat.values()))
    elif task == "load_model_offload":
        fj.load_model(out, offload=OffloadConfig()).close()
    elif task == "load_model_resident":
        fj.load_model(out)
    elif task == "load_model_hf":
        fj.load_model(src)
    else:
        raise ValueError(f"unknown task {task!r}")
    return {"seconds": time.perf_counter() - start}


def run_child(task: str, src: Path, out: Path) -> dict:
    """One measurement in a fresh process: its result, wall time and peak RSS (MB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.convert_speed", "--child", task]
        + ["--checkpoint", str(src), "--converted", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "peak_rss_mb": result["peak_rss_kb"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="HF directory (default: bench-s in /tmp/fmoe-bench)")
    parser.add_argument("--converted", type=Path, help="where to write the converted checkpoint")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.checkpoint, args.converted)
        import resource

        result["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result))
        return

    from fmoe_jax.testing import ensure_checkpoint

    src = args.checkpoint or ensure_checkpoint("bench-s")
    out = args.converted or src.parent / f"{src.name}-converted"
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    convert_runs = []
    for _ in range(args.repeats):
        shutil.rmtree(out, ignore_errors=True)
        run = run_child("convert", src, out)
        if "error" in run:
            raise SystemExit(f"conversion failed: {run['error']}")
        run["mb_per_s"] = source_bytes / 1e6 / run["seconds"]
        convert_runs.append(run)
    loads = {name: [run_child(name, src, out) for _ in range(args.repeats)] for name in LOADS}
    output_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)

    convert_s = float(np.median([r["seconds"] for r in convert_runs]))
    summary = {
        "checkpoint": str(src),
        "source_bytes": source_bytes,
        "output_bytes": output_bytes,
        "repeats": args.repeats,
        "convert": {
            "median_s": convert_s,
            "median_wall_s": float(np.median([r["wall_s"] for r in convert_runs])),
            "mb_per_s": source_bytes / 1e6 / convert_s,
            "peak_rss_mb": float(max(r["peak_rss_mb"] for r in convert_runs)),
            "runs": convert_runs,
        },
        "load": {
            name: {
                "median_s": float(np.median([r["seconds"] for r in runs])) if "seconds" in runs[0] else None,
                "runs": runs,
            }
            for name, runs in loads.items()
        },
        "targets": {"mb_per_s": TARGET_MB_S, "peak_rss_mb": TARGET_RSS_MB},
    }

    c = summary["convert"]
    rows = [
        dict(
            step="convert (median)",
            seconds=c["median_s"],
            mb_per_s=c["mb_per_s"],
            peak_rss_mb=c["peak_rss_mb"],
        ),
    ]
    for name, entry in summary["load"].items():
        if entry["median_s"] is None:
            rows.append(dict(step=name, seconds="failed: " + entry["runs"][0]["error"]))
            continue
        rows.append(
            dict(
                step=name,
                seconds=entry["median_s"],
                mb_per_s=output_bytes / 1e6 / entry["median_s"],
                peak_rss_mb=float(np.median([r["peak_rss_mb"] for r in entry["runs"]])),
            )
        )
    print(
        f"\nbench-s: {source_bytes / 1e9:.2f} GB float32 source, {output_bytes / 1e9:.2f} GB orbax output, "
        f"median of {args.repeats} runs, each in a fresh process\n"
    )
    print_table(rows, ["step", "seconds", "mb_per_s", "peak_rss_mb"])
    verdict = "meets" if c["mb_per_s"] >= TARGET_MB_S and c["peak_rss_mb"] < TARGET_RSS_MB else "MISSES"
    print(
        f"\nconversion {verdict} the targets (>= {TARGET_MB_S:.0f} MB/s, peak RSS < {TARGET_RSS_MB:.0f} MB)"
    )

    save("convert_speed", summary, args.out)
    plot(saved("convert_speed", args.out), args.out / "convert_speed.png")


def plot(summary: dict, path: Path) -> None:
    """The figure from the saved results."""
    c = summary["convert"]
    labels = {
        "restore_pinned_host": "restore\npinned",
        "restore_device": "restore\ndevice",
        "load_model_offload": "load\noffload",
        "load_model_resident": "load\nresident",
        "load_model_hf": "load\nHF dir",
    }
    load_times = {labels[n]: e["median_s"] for n, e in summary["load"].items() if e["median_s"] is not None}
    bar_plot(
        path,
        "bench-s: fmoe-convert and loading the result",
        {
            "conversion throughput (MB/s)": {"measured": c["mb_per_s"], "target": TARGET_MB_S},
            "conversion peak RSS (MB)": {"measured": c["peak_rss_mb"], "target": TARGET_RSS_MB},
            "load time (s)": load_times,
        },
        "see panel title",
        backend=summary["machine"]["backend"],
    )


if __name__ == "__main__":
    main()
