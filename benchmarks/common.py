"""Helpers every benchmark script shares: timing, machine description, result files and plots.

Benchmarks print a table, write `<name>.json` and `<name>.png` into `--out` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"

# One colour per policy in every figure (fmoe always red, the on-demand baselines blue).
POLICY_COLOURS = {
    "resident": "#7f7f7f",
    "on_demand_lru": "#1f77b4",
    "on_demand_lfu": "#17becf",
    "mixtral_offload": "#2ca02c",
    "moe_infinity": "#9467bd",
    "promoe": "#8c564b",
    "duoserve": "#e377c2",
    "fmoe": "#d62728",
    "oracle": "#000000",
    # hybrid execution (exp8): a policy's hybrid variant in a lighter shade of its colour
    "on_demand_lru+hybrid": "#9ecae1",
    "fmoe+hybrid": "#ff9896",
    "oracle+hybrid": "#a0a0a0",
    "fiddler": "#ff7f0e",
    "static_split": "#bcbd22",
}
OTHER_COLOURS = ("#ff7f0e", "#bcbd22", "#aec7e8", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d")
HARDWARE_NAMES = {
    "rtx_3090": "RTX 3090",
    "h100_sxm": "H100 SXM",
    "h100_pcie": "H100 PCIe",
    "a100_sxm": "A100 SXM",
}


def colours(labels: Sequence[str]) -> dict[str, str]:
    """Each label's colour: a policy's own; others (ablation variants, models) in order."""
    others = iter(OTHER_COLOURS * 4)
    return {label: POLICY_COLOURS.get(label) or next(others) for label in dict.fromkeys(labels)}


def mode_title(mode: str, backend: str = "cpu") -> str:
    """How a figure names where its numbers come from: "live (cpu)" or "simulated: RTX 3090 preset"."""
    if mode == "live":
        return f"live ({backend})"
    return f"simulated: {HARDWARE_NAMES.get(mode, mode)} preset"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` keeps the module docstring's layout and shows every option's default."""


_PATHS = [  # absolute paths of the machine a result was made on -> portable ones (each starts a path)
    (re.compile(r"(?<![\w.+/-])(?:/[\w.+-]+)*?/(benchmarks|fmoe_jax|models|offload|convert|tests)/"), r"\1/"),
    (re.compile(r"(?<![\w.+/-])(?:/[\w.+-]+)*?/shared/data\b"), "../shared/data"),
    (re.compile(r"(?<![\w.+/-])(?:/home/[\w.+-]+|/root)(?=/)"), "~"),
    (re.compile(r"(?<![\w.+/-])/tmp(?=/)"), "$TMPDIR"),
]


def scrub_paths(text: str) -> str:
    """`text` with this machine's absolute paths made relative (results are committed and shared)."""
    for pattern, replacement in _PATHS:
        text = pattern.sub(replacement, text)
    return text


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
    path.write_text(scrub_paths(json.dumps({"machine": machine(), **payload}, indent=1, default=float)))
    print(f"wrote {path}")
    return path


def saved(name: str, out: str | os.PathLike = RESULTS) -> dict[str, Any]:
    """The JSON results a benchmark wrote (figures are drawn from these, so `make_readme --replot` can
    redraw them without rerunning anything)."""
    return json.loads((Path(out) / f"{name}.json").read_text())


def bar_plot(
    path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str, backend: str | None = None
) -> None:
    """One panel per group; bars are the group's entries. The numbers are live: the title names the backend
    they were measured on (`backend`; default: this process's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if backend is None:
        import jax

        backend = jax.default_backend()
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (group, values) in zip(axes[0], groups.items(), strict=True):
        bars = ax.bar(list(values), list(values.values()), color=list(colours(list(values)).values()))
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(group)
        ax.set_ylabel(ylabel)
    fig.suptitle(f"{mode_title('live', backend)}: {title}")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def save_png(fig: Any, path: Path, dpi: int = 120, **options: Any) -> None:
    """`fig.savefig` as a PNG with a 256-colour palette: a third of the bytes of matplotlib's RGBA at the
    same size, with no difference a reader sees (every figure here is flat colours and lines). The figures
    are committed, and the working tree travels to a lent accelerator under a size limit."""
    import io

    from PIL import Image

    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=dpi, **options)
    raw.seek(0)
    with Image.open(raw) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def grouped_bars(
    path: Path,
    title: str,
    panels: dict[str, dict[str, dict[str, float]]],
    log: bool = False,
    ncols: int = 3,
    ylabels: dict[str, str] | None = None,
) -> None:
    """One panel per entry (`ncols` to a row); in each, groups of bars (group -> bar label -> value). A bar
    label keeps its colour in every panel (policies: `common.POLICY_COLOURS`); one legend under the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(k for groups in panels.values() for bars in groups.values() for k in bars))
    colour = colours(labels)
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols, 3.6 * nrows + 0.9), squeeze=False)
    for ax, (panel, groups) in zip(axes.flat, panels.items(), strict=False):
        present = [label for label in labels if any(label in bars for bars in groups.values())]
        width = 0.8 / max(1, len(present))
        for g, bars in enumerate(groups.values()):
            for i, label in enumerate(present):
                if label in bars:
                    x = g + (i - len(present) / 2 + 0.5) * width
                    ax.bar(x, bars[label], width, color=colour[label], label=label)
        ax.set_xticks(range(len(groups)), [name.replace(" ", "\n", 1) for name in groups], fontsize=8)
        ax.set_title(panel, fontsize=9)
        if ylabels and panel in ylabels:
            ax.set_ylabel(ylabels[panel], fontsize=8)
        if log:
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[label]) for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 9), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.9 / (3.6 * nrows + 0.9), 1, 1))
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")
