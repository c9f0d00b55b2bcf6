"""Experiment 3 (paper figure 10): online serving; the CDF of end-to-end request latency per policy.

    .venv/bin/python -m benchmarks.exp3_online [--arrivals FILE] [--requests 64] [--max-batch 4] [--load 1.0]

Requests arrive at the times of an Azure LLM inference trace (first `--requests` rows), each paired with an
evaluation prompt (`ArrivalTrace.assign`) and generating the trace's output length, clipped to
`--new-tokens`; prompts keep their `--prompt-tokens` cut (nearly every Azure context is longer).
Latency = finish of the request's last token - arrival.

Time scale: inter-arrival times are scaled so that requests arrive at `--load` times the rate at which
`on_demand_lru` serves them one at a time (measured live on a few store prompts; simulated likewise), so
every policy sees the same arrivals. As in the paper, fmoe's store and MoE-Infinity's EAM collection start
empty and learn online; ProMoE's and DuoServe's predictors are trained offline on the store split. The
oracle is left out (it needs each batch's routing in advance, and the batches depend on its own timing).

Live: fmoe-serve (`fmoe_jax.serve.create_app` under uvicorn on localhost, in this process, over the
workload's weights) with continuous batching over `--max-batch` slots, warmed up; one client thread per
request sends it at its (scaled) arrival time as a streamed greedy completion of token ids (EOS ignored)
with the official `openai` client, on the wall clock. Latency = the stream's end - the arrival; TTFT = its
first token - the arrival. The server's `fmoe_compilations` must not move while the requests run (the script
exits 1 if it does). The time scale comes from on_demand_lru serving the calibration prompts one at a time
through the same server. Simulated: the server is first-come-first-served static batching on a virtual
clock: whenever free it takes up to `--max-batch` waiting requests as one batch and serves it to the end;
`fmoe_jax.offload.simulator.Replay` serves the batches at a real model's sizes on each `--hardware` preset
(finished rows dropped).
Writes `exp3_online.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png

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


@contextlib.contextmanager
def http_server(model, max_batch: int, context: int):
    """fmoe-serve's app over `model` under uvicorn on a free localhost port (a thread of this process),
    warmed up; yields (url, app)."""
    import threading
    import time

    import uvicorn

    from fmoe_jax.serve.app import create_app

    app = create_app(model, model_name="model", max_batch=max_batch, max_queue=4096, context=context)
    app.state.scheduler.warmup()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fmoe-serve did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(60)


def send_at(url: str, prompts: list[list[int]], lengths: list[int], arrivals: np.ndarray) -> dict:
    """Request i (token ids `prompts[i]`, `lengths[i]` greedy tokens) streamed at `arrivals[i]` seconds from
    now, each from its own thread; every request's latency and TTFT from its arrival, in seconds."""
    import concurrent.futures
    import time

    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter() + 0.5  # every thread waiting before the first arrival

    def one(i: int) -> tuple[float, float, int]:
        due = start + arrivals[i]
        time.sleep(max(0.0, due - time.perf_counter()))
        stream = client.completions.create(
            model="model",
            prompt=prompts[i],
            max_tokens=lengths[i],
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first, tokens = None, 0
        for chunk in stream:
            if chunk.choices:
                first, tokens = first or time.perf_counter(), tokens + 1
        end = time.perf_counter()
        return end - due, (first or end) - due, tokens

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, range(len(prompts))))
    return dict(
        latency=np.array([d[0] for d in done]),
        ttft=np.array([d[1] for d in done]),
        tokens=[d[2] for d in done],
    )


def context_for(prompts: list[list[int]], lengths: list[int], chunk: int = 16) -> int:
    """A continuous batch's cache positions that hold every request: the longest prompt padded to whole
    chunks plus the most new tokens."""
    return -(-max(len(p) for p in prompts) // chunk) * chunk + max(lengths)


def live_http(w: h.Workload, variant: h.Variant, requests: list[h.Request], lengths, arrivals, max_batch):
    """Serves `requests` over HTTP at `arrivals` (module docstring); latency, TTFT and the server's counts."""
    prompts = [list(map(int, r.ids)) for r in requests]
    offload = h.offload_config(w, variant, calls=[], simulated=False)
    with (
        h.serving(w, offload) as model,
        http_server(model, max_batch, context_for(prompts, lengths)) as (
            url,
            app,
        ),
    ):
        compilations = model.engine.programs.compilations
        before = sum(compilations.values())
        out = send_at(url, prompts, lengths, arrivals)
        out["compilations"] = sum(compilations.values()) - before
        metrics = app.state.metrics
        out["hit_rate"] = metrics.hit_rate._value.get()
    if out["tokens"] != list(lengths):
        raise RuntimeError(f"{variant.label}: some requests got fewer tokens than they asked for")
    return out


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
        requests=len(latency),
    ) | (dict(batches=len(sizes), mean_batch=float(np.mean(sizes))) if sizes else {})


def plot(payload: dict, path) -> None:
    """Figure 10 from the saved results: latency CDF per policy, one panel per model and source of numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend = payload["machine"]["backend"]
    cdfs = {}  # (panel title, x label) -> policy -> seconds
    for model, result in payload["models"].items():
        for mode, run in [*result["live"].items(), *result["sim"].items()]:
            sizes = "" if mode == "live" else f" at {h.simulated_sizes(payload, model)}"
            title = f"{h.mode_title(mode, backend)}\n{model}{sizes}"
            cdfs[(title, "end-to-end request latency (s)")] = run["latency"]
            if "ttft" in run:
                cdfs[(title, "time to first token (s)")] = run["ttft"]
    colour = h.colours([p for by_policy in cdfs.values() for p in by_policy])
    fig, axes = plt.subplots(1, len(cdfs), figsize=(5 * len(cdfs), 4.2), squeeze=False)
    for ax, ((title, xlabel), by_policy) in zip(axes[0], cdfs.items(), strict=True):
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
        ax.set(xlabel=xlabel, ylabel="CDF")
    handles = [plt.Line2D([], [], color=c, lw=2) for c in colour.values()]
    fig.legend(handles, list(colour), loc="lower center", ncol=len(colour), fontsize=8, frameon=False)
    fig.suptitle("Online serving at Azure trace arrival times (figure 10)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    save_png(fig, path)
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
    compiled_while_serving = 0
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
                prompts = [list(map(int, r.ids)) for r in calibration]
                with (
                    h.serving(w, h.offload_config(w, lru, calls=[], simulated=False)) as model,
                    http_server(model, args.max_batch, context_for(prompts, [args.new_tokens])) as (url, _),
                ):
                    service = float(
                        np.mean(  # one at a time: each arrives when the last has ended
                            [send_at(url, [p], [args.new_tokens], np.zeros(1))["latency"][0] for p in prompts]
                        )
                    )
            else:
                serve, close = sim_server(w, lru, calibration, mode)
                service = single_request_s(serve, len(calibration))
                close()
            scale = service / (args.load * gaps)
            arrivals = trace.arrival_s * scale
            rows, curves, ttfts = [], {}, {}
            for v in [h.Variant(p, p, knowledge=False) for p in args.policies]:
                print(f"[{w.name}] online {mode} {v.label}", flush=True)
                if mode == "live":
                    out = live_http(w, v, requests, lengths, arrivals, args.max_batch)
                    latency, sizes = out["latency"], []
                    extra = {"hit_rate": out["hit_rate"], "compilations": out["compilations"]}
                    extra["ttft_p50_s"] = float(np.percentile(out["ttft"], 50))
                    extra["ttft_p99_s"] = float(np.percentile(out["ttft"], 99))
                    ttfts[v.label] = out["ttft"].tolist()
                    compiled_while_serving += out["compilations"]
                else:
                    serve, close = sim_server(w, v, requests, mode)
                    latency, sizes = fcfs(arrivals, args.max_batch, serve)
                    extra = {"hit_rate": close()}
                rows.append(latency_row(v.label, latency, sizes) | extra)
                curves[v.label] = latency.tolist()
            where = "live" if mode == "live" else f"simulated at {w.sizes()} on {mode}"
            tables[f"{w.name}, {where}: end-to-end latency (s)"] = rows
            result["live" if mode == "live" else "sim"][mode] = dict(
                time_scale=scale, single_request_s=service, rows=rows, latency=curves
            ) | ({"ttft": ttfts} if mode == "live" else {})
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
    if compiled_while_serving:
        sys.exit(
            f"live: {compiled_while_serving} programs compiled while requests were served (see the table)"
        )
    return payload


if __name__ == "__main__":
    main()
