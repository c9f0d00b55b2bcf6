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


def plot(path, tables: dict[str, list[dict]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tables), 3, figsize=(15, 3.4 * len(tables)), squeeze=False)
    for row_axes, (caption, rows) in zip(axes, tables.items(), strict=True):
        x_key = next(iter(rows[0]))
        series = {}
        for r in rows:
            series.setdefault(r.get("policy", "fmoe"), []).append(r)
        for ax, metric in zip(row_axes, ("hit_rate", "ttft", "tpot"), strict=True):
            for policy, rs in series.items():
                for key in [k for k in rs[0] if metric in k and "score" not in k]:
                    ax.plot([r[x_key] for r in rs], [r[key] for r in rs], marker="o", label=f"{policy} {key}")
            ax.set(title=f"{caption.split(': ')[-1]}: {metric}", xlabel=x_key)
            if metric != "hit_rate":
                ax.set_yscale("log")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.add_arguments(parser, live_requests=8)
    parser.add_argument("--distances", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--capacities", type=int, nargs="+", default=[125, 250, 500, 1000, 2000, 4000])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
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
    plot(args.out / f"{NAME}.png", tables, args)
    return payload


if __name__ == "__main__":
    main()
