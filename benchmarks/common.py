"""Helpers every benchmark script shares: timing, machine description, result files and plots.

Benchmarks print a table, write `<name>.json` and `<name>.png` into `--out` (default benchmarks/results/).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import jax

    return dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
    )


def median_ms(fn: Callable[[], Any], repeats: int = 10, warmup: int = 1) -> float:
    """Median wall time of `fn()` in milliseconds (`fn` must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def read_bandwidth_gbs(megabytes: int = 512) -> dict[str, float]:
    """Measured memory read bandwidth (GB/s) of this device: jitted matrix-vector products over a large
    float32 matrix in both layouts (`v @ W` contracts W's rows, `W @ v` its contiguous columns; XLA:CPU
    reads the second faster) and a jitted sum; the best is the bandwidth floor's divisor."""
    import jax
    import jax.numpy as jnp

    cols = 4096
    rows = megabytes * 1024 * 1024 // (4 * cols)
    w = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    programs = {
        "matvec": (jax.jit(lambda v, w: v @ w), jnp.ones((1, rows), jnp.float32)),
        "matvec_rows": (jax.jit(lambda v, w: w @ v), jnp.ones((cols,), jnp.float32)),
        "sum": (jax.jit(lambda v, w: jnp.sum(w)), None),
    }
    out = {}
    for name, (fn, v) in programs.items():
        jax.block_until_ready(fn(v, w))
        out[name] = w.nbytes / (median_ms(lambda fn=fn, v=v: jax.block_until_ready(fn(v, w))) * 1e6)
    out["best"] = max(out.values())
    return out


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    if not rows:
        return
    columns = list(columns or rows[0].keys())

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def save(name: str, payload: dict[str, Any], out_dir: str | os.PathLike = RESULTS) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1, default=float))
    print(f"wrote {path}")
    return path


def bar_plot(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    """One panel per group; bars are the group's entries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (group, values) in zip(axes[0], groups.items(), strict=True):
        bars = ax.bar(list(values), list(values.values()), color=["#3b6ea5", "#c0504d", "#9bbb59", "#8064a2"])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(group)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
