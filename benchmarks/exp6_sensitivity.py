"""Experiment 6 (paper figures 13 and 14): sensitivity to prefetch distance, store capacity and batch size.

    .venv/bin/python -m benchmarks.exp6_sensitivity [--distances 1 2 3] [--capacities 500] [--batch-sizes 1 4]

(a) fmoe at prefetch distances d (its offline store built for each d): hit rate, TTFT and TPOT, live and
simulated. (b) fmoe with stores of several capacities, built from the same store requests: the mean
semantic and trajectory similarity of the matches (figure 14a) and the hit rate. (c) batch sizes 1..4 for
fmoe, Mixtral-Offloading, ProMoE, MoE-Infinity (figure 14b) and on-demand LRU: the evaluation requests in
consecutive batches; simulated batches are the requests' own routings served together, live ones are
generated together (after one warm-up batch of that size). Writes `exp6_sensitivity.{json,md,png}`.
"""

from __future__ import annotations

import argparse

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png

NAME = "exp6_sensitivity"
BATCH_POLICIES = ("on_demand_lru", "mixtral_offload", "promoe", "moe_infinity", "fmoe")
SCORES = ("mean_semantic_score", "mean_trajectory_score")


def measure(
    w: h.Workload,
    v: h.Variant,
    args,
    *,
    live: bool = True,
    live_batches: list | None = None,
    sim_batches: list | None = None,
    warmup: list | None = None,
    **config,
) -> dict:
    """Live and simulated numbers of one setting; `config` as `offload_config`'s keywords, the batches
    default to every request alone."""
    row = {}
    if live and not args.no_live:
        r = h.run_live(w, v, measured=live_batches, warmup=warmup, **config)
        row |= dict(live_hit_rate=r["hit_rate"], live_ttft_ms=1e3 * r["median_ttft_s"])
        row |= dict(live_tpot_ms=1e3 * r["median_tpot_s"], live_requests=r["requests"])
        row["live_compilations"] = r["compilations"]
        row |= {f"live_{k}": r["extra"][k] for k in SCORES if k in r["extra"]}
    if not args.no_sim:
        for hw in args.hardware:
            r = h.run_sim(w, v, hw, measured=sim_batches, warmup=warmup, **config)
            row |= {
                f"{hw}_hit_rate": r.hit_rate,
                f"{hw}_ttft_s": r.median_ttft_s,
                f"{hw}_tpot_s": r.median_tpot_s,
            }
            row |= {f"sim_{k}": r.extra[k] for k in SCORES if k in r.extra}
    return row


def plot(payload: dict, path) -> None:
    """Figures 13 and 14 from the saved results: per swept setting (rows), the hit rate and the TPOT, live and
    simulated in separate panels; colour = policy, line style = where the numbers come from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    backend = payload["machine"]["backend"]
    parts = {"distance": ("d", "prefetch distance d"), "capacity": ("capacity", "store capacity (maps)")}
    parts["batch"] = ("batch", "batch size")
    rows = [(model, part, result[part]) for model, result in payload["models"].items() for part in parts]
    hardware = sorted(
        {k.removesuffix("_hit_rate") for _, _, rs in rows for k in rs[0] if k.endswith("_hit_rate")}
    )
    hardware = [hw for hw in hardware if hw not in ("live", "sim")]
    styles = {"live": "-", **{hw: style for hw, style in zip(hardware, ("--", ":", "-."), strict=False)}}
    colour = h.colours([r.get("policy", "fmoe") for _, _, rs in rows for r in rs])
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 3.3 * len(rows) + 0.8), squeeze=False)
    for row_axes, (model, part, rs) in zip(axes, rows, strict=True):
        x_key, x_label = parts[part]
        series: dict[str, list[dict]] = {}
        for r in rs:
            series.setdefault(r.get("policy", "fmoe"), []).append(r)
        panels = [
            (row_axes[0], "hit_rate", list(styles), "expert hit rate", "live and simulated"),
            (row_axes[1], "tpot", ["live"], "median TPOT (ms)", h.mode_title("live", backend)),
            (
                row_axes[2],
                "tpot",
                hardware,
                "median TPOT (s)",
                "simulated: " + ", ".join(f"{h.HARDWARE_NAMES.get(hw, hw)}" for hw in hardware) + " presets",
            ),
        ]
        for ax, metric, sources, ylabel, where in panels:
            drawn = False
            for policy, points in series.items():
                for source in sources:
                    key = next((k for k in points[0] if k.startswith(f"{source}_{metric}")), None)
                    if key is None:
                        continue
                    xs = [p[x_key] for p in points]
                    ax.plot(xs, [p[key] for p in points], styles[source], marker="o", color=colour[policy])
                    drawn = True
            ax.set_title(f"{where}\n{model}: {metric.replace('_', ' ')} vs {x_label}", fontsize=9)
            ax.set(xlabel=x_label, ylabel=ylabel)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            if metric == "tpot" and drawn:
                ax.set_yscale("log")
            if not drawn:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    handles = [plt.Line2D([], [], color=c, lw=2) for c in colour.values()]
    handles += [plt.Line2D([], [], color="grey", ls=style) for style in styles.values()]
    names = [*colour, *(h.mode_title(source, backend) for source in styles)]
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.suptitle(
        "Sensitivity to prefetch distance, store capacity and batch size (figures 13, 14)", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.8 / (3.3 * len(rows) + 0.8), 1, 1))
    save_png(fig, path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser, live_requests=8)
    parser.add_argument(
        "--distances",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 5, 6],
        help="prefetch distances d swept in (a)",
    )
    parser.add_argument(
        "--capacities",
        type=int,
        nargs="+",
        default=[125, 250, 500, 1000, 2000, 4000],
        help="store capacities (expert maps) swept",
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4], help="batch sizes swept in (c)"
    )
    parser.add_argument("--live-capacities", action="store_true", help="also serve (b) live (slow)")
    args = parser.parse_args(argv)
    tables, payload, notes = {}, {"models": {}}, []
    fmoe = h.Variant("fmoe", "fmoe")
    for name in args.model:
        w = h.load_workload(name, args)
        notes.append(h.settings_note(w) + " (the swept setting varies)")
        maps = sum(len(it.ids) for r in w.store for it in r.trace.requests[0].iterations)
        notes.append(f"{w.name}: the store requests hold {maps} expert maps (one per token)")
        distances = [d for d in args.distances if d < w.config.num_moe_layers]
        by_d = [dict(d=d) | measure(w, fmoe, args, prefetch_distance=d) for d in distances]
        by_c = [
            dict(capacity=c) | measure(w, fmoe, args, live=args.live_capacities, store_capacity=c)
            for c in args.capacities
        ]
        by_b = []
        for b in args.batch_sizes:
            for p in BATCH_POLICIES:
                print(f"[{w.name}] batch size {b}, {p}", flush=True)
                config = dict(
                    live_batches=h.batches(w.eval[: args.live_requests], b),
                    sim_batches=h.batches(w.eval, b),
                    warmup=[w.store[:b]],
                )
                by_b.append(dict(batch=b, policy=p) | measure(w, h.Variant(p, p), args, **config))
        payload["models"][w.name] = {"distance": by_d, "capacity": by_c, "batch": by_b}
        tables[f"{w.name}: (a) fmoe vs prefetch distance"] = by_d
        tables[f"{w.name}: (b) fmoe vs store capacity"] = by_c
        tables[f"{w.name}: (c) batch size"] = by_b
        w.model.close()
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    h.write_results(NAME, "Experiment 6: sensitivity (figures 13 and 14)", payload, tables, notes, args.out)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
