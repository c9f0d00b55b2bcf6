"""Experiment 3 (paper figure 10): online serving; the CDF of end-to-end request latency per policy.

    .venv/bin/python -m benchmarks.exp3_online [--arrivals FILE] [--requests 64] [--max-batch 4] [--load 1.0]

Requests arrive at the times of an Azure LLM inference trace (first `--requests` rows), each paired with an
evaluation prompt (`ArrivalTrace.assign`) and generating the trace's output length, clipped to
`--new-tokens`; prompts keep their `--prompt-tokens` cut (nearly every Azure context is longer). The server
is first-come-first-served: whenever it is free it takes up to `--max-batch` waiting requests as one
batch and serves it to the end (static batching). Latency = finish of the request's last token - arrival.

Time scale: inter-arrival times are scaled so that requests arrive at `--load` times the rate at which
`on_demand_lru` serves them one at a time (measured live on a few store prompts; simulated likewise), so
every policy sees the same arrivals. As in the paper, fmoe's store and MoE-Infinity's EAM collection start
empty and learn online; ProMoE's and DuoServe's predictors are trained offline on the store split. The
oracle is left out (it needs each batch's routing in advance, and the batches depend on its own timing).

Live: batches are served with `generate` on this machine; the clock is virtual (it jumps to the next arrival
when idle), service times are measured. A batch runs until its longest request ends (the live engine has no
per-row length), so shorter rows compute extra tokens there; the simulator drops finished rows. Simulated:
`fmoe_jax.offload.simulator.Replay` serves the batches at a real model's sizes on each `--hardware` preset.
Writes `exp3_online.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter

NAME = "exp3_online"
POLICIES = ("on_demand_lru", "on_demand_lfu", "mixtral_offload", "moe_infinity", "promoe", "duoserve", "fmoe")


def truncated(request: h.Request, new_tokens: int) -> h.Request:
    """The request generating `new_tokens` tokens: greedy decoding makes its routing a prefix of the full."""
    import fmoe_jax as fj

    whole = request.trace.requests[0]
    part = dataclasses.replace(whole, iterations=whole.iterations[:new_tokens])
    return h.Request(request.prompt, request.ids, fj.RoutingTrace(request.trace.meta, [part]))


def fcfs(
    arrivals: np.ndarray, max_batch: int, serve: Callable[[list[int]], tuple[list[float], float]]
) -> tuple[np.ndarray, list[int]]:
    """First-come-first-served static batching on a virtual clock. `serve(indices)` returns each request's
    finish offset from the batch start and the batch's duration. Returns latencies and batch sizes."""
    now, i, n = 0.0, 0, len(arrivals)
    latency, sizes = np.zeros(n), []
    while i < n:
        now = max(now, arrivals[i])
        batch = [j for j in range(i, n) if arrivals[j] <= now][:max_batch]
        offsets, duration = serve(batch)
        latency[batch] = now + np.asarray(offsets) - arrivals[batch]
        now += duration
        i += len(batch)
        sizes.append(len(batch))
    return latency, sizes


def live_server(w: h.Workload, variant: h.Variant, requests: list[h.Request], lengths: list[int]):
    import fmoe_jax as fj

    offload = h.offload_config(w, variant, calls=[], simulated=False)
    stack = contextlib.ExitStack()
    model = stack.enter_context(h.serving(w, offload))
    counts = {"hits": 0, "misses": 0}

    def serve(batch: list[int]) -> tuple[list[float], float]:
        most = max(lengths[j] for j in batch)
        stats = fj.generate(model, [requests[j].ids for j in batch], most, stop_at_eos=False).stats
        steps = np.concatenate([[stats.ttft_s], stats.decode_step_s])
        counts["hits"] += stats.hits
        counts["misses"] += stats.misses
        return [float(steps[: lengths[j]].sum()) for j in batch], float(steps.sum())

    def close() -> float:
        stack.close()
        return counts["hits"] / max(1, counts["hits"] + counts["misses"])

    return serve, close


def sim_server(w: h.Workload, variant: h.Variant, requests: list[h.Request], hardware: str):
    from fmoe_jax.offload.cost_model import HARDWARE
    from fmoe_jax.offload.simulator import Replay

    offload = h.offload_config(w, variant, calls=[], simulated=True)
    replay = Replay(
        offload,
        meta=requests[0].trace.meta,
        model=w.preset,
        hardware=HARDWARE[hardware],
        router_weights=w.router_weights,
    )

    def serve(batch: list[int]) -> tuple[list[float], float]:
        start = replay.clock
        ttft, tpot = replay.run(h.batch_trace([requests[j] for j in batch]))
        n = [len(requests[j].trace.requests[0].iterations) for j in batch]
        offsets = [f + (k - 1) * (t if k > 1 else 0.0) for f, t, k in zip(ttft, tpot, n, strict=True)]
        return offsets, replay.clock - start

    return serve, lambda: replay.close().hit_rate


def single_request_s(serve: Callable, count: int) -> float:
    """Mean seconds to serve one request alone (requests 0..count-1 of the server's list)."""
    return float(np.mean([serve([j])[1] for j in range(count)]))


def latency_row(label: str, latency: np.ndarray, sizes: list[int]) -> dict:
    return dict(
        policy=label,
        mean_s=float(latency.mean()),
        p50_s=float(np.percentile(latency, 50)),
        p90_s=float(np.percentile(latency, 90)),
        p99_s=float(np.percentile(latency, 99)),
        max_s=float(latency.max()),
        batches=len(sizes),
        mean_batch=float(np.mean(sizes)),
        requests=len(latency),
    )


def plot(payload: dict, path) -> None:
    """Figure 10 from the saved results: latency CDF per policy, one panel per model and source of numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend = payload["machine"]["backend"]
    cdfs = {}
    for model, result in payload["models"].items():
        for mode, run in [*result["live"].items(), *result["sim"].items()]:
            sizes = "" if mode == "live" else f" at {h.simulated_sizes(payload, model)} sizes"
            cdfs[f"{h.mode_title(mode, backend)}\n{model}{sizes}"] = run["latency"]
    colour = h.colours([p for by_policy in cdfs.values() for p in by_policy])
    fig, axes = plt.subplots(1, len(cdfs), figsize=(5 * len(cdfs), 4.2), squeeze=False)
    for ax, (title, by_policy) in zip(axes[0], cdfs.items(), strict=True):
        for policy, latency in by_policy.items():
            xs = np.sort(latency)
            ax.step(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                where="post",
                color=colour[policy],
                lw=2.2 if policy == "fmoe" else 1.2,
            )
        ax.set_title(title, fontsize=9)
        ax.set(xlabel="end-to-end request latency (s)", ylabel="CDF")
    handles = [plt.Line2D([], [], color=c, lw=2) for c in colour.values()]
    fig.legend(handles, list(colour), loc="lower center", ncol=len(colour), fontsize=8, frameon=False)
    fig.suptitle("Online serving at Azure trace arrival times (figure 10)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.add_argument(
        "--arrivals", default="azure_llm_2023_conv.csv", help="file under DATA/arrivals or a path"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests taken from the arrival trace")
    parser.add_argument("--max-batch", type=int, default=4, help="largest batch the FCFS server forms")
    parser.add_argument("--load", type=float, default=1.0, help="arrival rate / on_demand_lru's batch-1 rate")
    parser.add_argument("--calibration", type=int, default=4, help="store prompts timed for the time scale")
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=h.POLICIES, help="policies compared"
    )
    args = parser.parse_args(argv)

    from fmoe_jax.research import workloads

    path = args.data / "arrivals" / args.arrivals if "/" not in args.arrivals else args.arrivals
    trace = workloads.load_azure_arrivals(path, limit=args.requests)
    gaps = float(np.mean(np.diff(trace.arrival_s)))
    tables, payload, notes = {}, {"models": {}}, []
    for name in args.model:
        w = h.load_workload(name, args)
        by_uid = {r.prompt.uid: r for r in w.eval}
        assigned = trace.assign(
            [r.prompt for r in w.eval], seed=args.seed, max_generated_tokens=args.new_tokens
        )
        requests = [truncated(by_uid[p.uid], n) for _, p, n in assigned]
        lengths = [n for _, _, n in assigned]
        calibration = [truncated(r, args.new_tokens) for r in w.store[: args.calibration]]
        notes.append(h.settings_note(w) + "; store and EAMs start empty (online)")
        result = payload["models"][w.name] = {"live": {}, "sim": {}}
        lru = h.Variant("on_demand_lru", "on_demand_lru")
        modes = ([] if args.no_live else ["live"]) + ([] if args.no_sim else list(args.hardware))
        for mode in modes:
            if mode == "live":
                serve, close = live_server(w, lru, calibration, [args.new_tokens] * len(calibration))
                for b in range(1, args.max_batch + 1):  # compiles every batch size before anything is timed
                    serve(list(range(min(b, len(calibration)))))
            else:
                serve, close = sim_server(w, lru, calibration, mode)
            service = single_request_s(serve, len(calibration))
            close()
            scale = service / (args.load * gaps)
            arrivals = trace.arrival_s * scale
            rows, curves = [], {}
            for v in [h.Variant(p, p, knowledge=False) for p in args.policies]:
                print(f"[{w.name}] online {mode} {v.label}", flush=True)
                if mode == "live":
                    before = h.compilations()
                    serve, close = live_server(w, v, requests, lengths)
                    latency, sizes = fcfs(arrivals, args.max_batch, serve)
                    extra = {"hit_rate": close(), "compilations": h.compilations() - before}
                else:
                    serve, close = sim_server(w, v, requests, mode)
                    latency, sizes = fcfs(arrivals, args.max_batch, serve)
                    extra = {"hit_rate": close()}
                rows.append(latency_row(v.label, latency, sizes) | extra)
                curves[v.label] = latency.tolist()
            where = "live" if mode == "live" else f"simulated at {w.preset.name} sizes on {mode}"
            tables[f"{w.name}, {where}: end-to-end latency (s)"] = rows
            result["live" if mode == "live" else "sim"][mode] = dict(
                time_scale=scale, single_request_s=service, rows=rows, latency=curves
            )
            notes.append(
                f"{w.name} {mode}: on_demand_lru serves one request in {service:.3g} s; arrivals scaled by "
                f"{scale:.3g} (mean gap {gaps * scale:.3g} s, load {args.load})"
            )
        w.model.close()
    notes.append(
        f"arrivals: {path}, first {len(trace)} requests; output lengths clipped to {args.new_tokens} tokens"
    )
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    h.write_results(NAME, "Experiment 3: online serving (figure 10)", payload, tables, notes, args.out)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
