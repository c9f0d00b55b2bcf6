"""Real routing replayed live beside the simulator's prediction for the same requests.

    python -m benchmarks.live_replay [--requests 4] [--steps 48] [--layers 24] [--width-scale 0.25]
        [--experts int4] [--policies on_demand_lru,fmoe] [--budgets 0.25] [--modes copy]
        [--hardware cpu_2core_vm] [--name live_replay]

Requests of `benchmarks/real_routing.py`'s evaluation split of gpt-oss-20b's decode routing (evenly spaced,
each its first `--steps` decode steps) are decoded one at a time, batch 1, by a model with random weights
(`fmoe_jax.random_model`) of gpt-oss-20b's dimensions (its first `--layers` layers, widths and vocabulary
times `--width-scale`, experts in `--experts`), every MoE layer forced to the recorded experts
(`generate(..., forced_routing=...)`): a one-token prompt whose routing is the request's first decode step,
then one step per later one. The simulator replays the same requests through the same policy and budget
(`simulate`, on `--hardware`: a preset with the engine's costs, `offload/hardware.py`), at the synthetic
model's sizes; the policy and cache see the same events in both (tested: `tests/test_forced_routing.py`).
A warm-up request (the evaluation split's last) runs first in both, so that programs are compiled and the
policy's state carries over alike. fmoe runs inline (`asynchronous=False`) on routing alone
(`semantic=False`: the routing set has no embeddings), learning online; its host time per layer, measured
live on the warm-up request, is what the simulator charges it (`simulate(policy_s=...)`).

Live TPOT is the mean of each request's mean decode step (compilation excluded), as the simulator's
`mean_tpot_s`; ratio = simulated / live. Writes `results/<name>.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, print_table, save, saved
from benchmarks.real_routing import DEFAULT_PATH, load, request_names

PROMPT_TOKEN = 1  # the one-token prompt each request starts from; its routing is forced anyway


def routing_requests(count: int, steps: int, layers: int, path: Path = DEFAULT_PATH) -> list[Any]:
    """`count` evaluation requests (evenly spaced) and a warm-up one (the split's last), each a one-request
    `RoutingTrace` of its first `steps` decode steps and `layers` MoE layers, prompt `[PROMPT_TOKEN]`."""
    from fmoe_jax.trace import RequestTrace, RoutingTrace

    names = request_names("evaluation", path)
    chosen = request_names("evaluation", path, limit=count) + [names[-1]]
    trace = load("evaluation", path)
    by_name = dict(zip(names, trace.requests, strict=True))
    out = []
    for name in chosen:
        its = [
            dataclasses.replace(
                it,
                ids=it.ids[:, :layers],
                probs=None if it.probs is None else it.probs[:, :layers],
                weights=None if it.weights is None else it.weights[:, :layers],
            )
            for it in by_name[name].iterations[:steps]
        ]
        meta = {**trace.meta, "num_layers": layers, "requests": [name]}
        out.append(RoutingTrace(meta, [RequestTrace([PROMPT_TOKEN], its)]))
    return out


def steps(trace: Any) -> int:
    """The decode steps of a one-request trace (`max_new_tokens` that replays it whole)."""
    return len(trace.requests[0].iterations)


def policy_options(policy: str) -> dict:
    """What each policy runs with here: fmoe inline (the simulator cannot follow its thread), on routing."""
    return {"asynchronous": False, "semantic": False} if policy == "fmoe" else {}


def run_live(base: Any, offload: Any, traces: list[Any]) -> dict:
    """Decodes the warm-up request (last) then the others on a fresh engine over `base`'s weights and
    programs; per-request TPOT, counts and the engine's host path per decode token."""
    import fmoe_jax as fj
    from fmoe_jax.engines.offload import OffloadEngine

    engine = OffloadEngine(base.module, offload, programs=base.engine.programs)
    model = dataclasses.replace(base, engine=engine, offload=offload)
    *measured, warmup = traces
    try:
        outs = [
            fj.generate(model, [[PROMPT_TOKEN]], steps(t), stop_at_eos=False, forced_routing=t)
            for t in [warmup, *measured]
        ]
    finally:
        engine.close()
    warm, outs = outs[0], outs[1:]
    layers = base.config.num_moe_layers
    warm_tokens = len(warm.stats.decode_step_s) + 1
    policy_s = sum(warm.stats.overhead_s.get(k, 0.0) for k in ("policy_events",)) / (warm_tokens * layers)
    launches = np.concatenate([o.stats.step_launches[1:] for o in outs])
    syncs = np.concatenate([o.stats.step_syncs[1:] for o in outs])
    return dict(
        tpot_s=[o.stats.tpot_s for o in outs],
        hits=sum(o.stats.hits for o in outs),
        misses=sum(o.stats.misses for o in outs),
        prefetches=sum(o.stats.prefetches for o in outs),
        launches_per_token=float(np.mean(launches)),
        syncs_per_token=float(np.mean(syncs)),
        policy_s_per_layer=policy_s,
    )


def run_simulated(offload: Any, traces: list[Any], preset: Any, hardware: Any, host: Any, policy_s: float):
    from fmoe_jax.offload.simulator import simulate

    *measured, warmup = traces
    return simulate(
        measured, offload, model=preset, hardware=hardware, host=host, warmup=[warmup], policy_s=policy_s
    )


def replay(args: argparse.Namespace) -> dict:
    """Every policy x budget x mode, live and simulated; the rows and the settings."""
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, HARDWARE, HOSTS, ModelPreset

    import fmoe_jax as fj

    traces = routing_requests(args.requests, args.steps, args.layers, Path(args.routing_data))
    start = time.perf_counter()
    base = fj.random_model(
        GPT_OSS_20B,
        fj.OffloadConfig(cache_experts=1, expert_quantization=args.experts),
        layers=args.layers,
        width_scale=args.width_scale,
    )
    base.close()
    built_s = time.perf_counter() - start
    cfg = base.config
    quantization = base.module.expert_quantization
    preset = ModelPreset.from_config(cfg, name="synthetic gpt-oss-20b", quantization=quantization)
    hardware, host = HARDWARE[args.hardware], HOSTS.get(args.host)
    total = cfg.num_moe_layers * cfg.num_experts
    rows = []
    for budget in args.budgets:
        slots = max(1, round(budget * total))
        for mode in args.modes:
            for policy in args.policies:
                offload = fj.OffloadConfig(
                    policy=policy,
                    cache_experts=slots,
                    execution=mode,
                    prefetch_distance=1,
                    policy_options=policy_options(policy),
                )
                live = run_live(base, offload, traces)
                sim = run_simulated(offload, traces, preset, hardware, host, live["policy_s_per_layer"])
                live_tpot, sim_tpot = float(np.mean(live["tpot_s"])), sim.mean_tpot_s
                rows.append(
                    dict(
                        policy=policy,
                        budget=budget,
                        mode=mode,
                        live_tpot_ms=live_tpot * 1e3,
                        sim_tpot_ms=sim_tpot * 1e3,
                        sim_vs_live=sim_tpot / live_tpot,
                        live_hit_rate=live["hits"] / max(1, live["hits"] + live["misses"]),
                        sim_hit_rate=sim.hit_rate,
                        launches=live["launches_per_token"],
                        syncs=live["syncs_per_token"],
                        policy_us_per_layer=live["policy_s_per_layer"] * 1e6,
                    )
                )
                print_table(rows[-1:])
    return dict(
        rows=rows,
        model=dict(
            layers=cfg.num_moe_layers,
            hidden=cfg.hidden_size,
            expert_intermediate=cfg.expert_intermediate_size,
            vocab=cfg.vocab_size,
            experts=args.experts,
            expert_bytes=preset.expert_bytes,
            built_s=built_s,
        ),
        requests=[t.meta["requests"][0] for t in traces[:-1]],
        warmup_request=traces[-1].meta["requests"][0],
        steps=args.steps,
        hardware=hardware.name,
        host=None if host is None else host.name,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--requests", type=int, default=4, help="evaluation requests replayed (evenly spaced)")
    p.add_argument("--steps", type=int, default=48, help="decode steps replayed per request (its first)")
    p.add_argument("--layers", type=int, default=24, help="MoE layers of the synthetic model (gpt-oss: 24)")
    p.add_argument("--width-scale", type=float, default=0.25, help="widths and vocabulary times this")
    p.add_argument("--experts", default="int4", choices=["int4", "int8", "mxfp4"], help="expert precision")
    p.add_argument("--policies", type=lambda s: s.split(","), default=["on_demand_lru", "fmoe"])
    p.add_argument("--budgets", type=lambda s: [float(b) for b in s.split(",")], default=[0.25])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["copy"], help="copy and/or hybrid")
    p.add_argument("--hardware", default="cpu_2core_vm", help="the simulator's hardware preset")
    p.add_argument("--host", default="cpu_2core_vm", help="the simulator's host preset (hybrid)")
    p.add_argument("--routing-data", default=str(DEFAULT_PATH), help="the routing set's directory")
    p.add_argument("--name", default="live_replay", help="results name under --out")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    load_before = os.getloadavg()
    payload = replay(args)
    payload["load_average"] = dict(before=load_before, after=os.getloadavg())
    print(f"\n{describe(payload)}")
    print_table(payload["rows"])
    save(args.name, payload, args.out)
    write_md(saved(args.name, args.out), args.out / f"{args.name}.md")
    plot(saved(args.name, args.out), args.out / f"{args.name}.png")
    return payload


def describe(payload: dict) -> str:
    m = payload["model"]
    return (
        f"gpt-oss-20b's real routing, {len(payload['requests'])} evaluation requests x {payload['steps']} "
        f"decode steps, batch 1, live on a random-weight gpt-oss-20b of {m['layers']} MoE layers, hidden "
        f"{m['hidden']}, expert intermediate {m['expert_intermediate']}, vocabulary {m['vocab']}, "
        f"{m['experts']} experts ({m['expert_bytes'] / 1e6:.2f} MB each), beside the simulator on "
        f"{payload['hardware']} at the same sizes; load average "
        f"{payload['load_average']['before'][0]:.1f} before, {payload['load_average']['after'][0]:.1f} after"
    )


def write_md(payload: dict, path: Path) -> None:
    lines = [f"# live_replay ({payload['machine']['backend']})", "", describe(payload) + ".", ""]
    columns = list(payload["rows"][0]) if payload["rows"] else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in payload["rows"]:
        cells = (f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values())
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def plot(payload: dict, path: Path) -> None:
    """Live and simulated TPOT per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    labels = [f"{r['policy']}\n{r['mode']} {r['budget']:.0%}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(rows)), 3.6))
    ax.bar(x - 0.2, [r["live_tpot_ms"] for r in rows], 0.4, label="live")
    ax.bar(x + 0.2, [r["sim_tpot_ms"] for r in rows], 0.4, label=f"simulated ({payload['hardware']})")
    ax.set_xticks(x, labels)
    ax.set_ylabel("TPOT (ms)")
    ax.legend()
    ax.set_title(f"live ({payload['machine']['backend']}) vs simulated, gpt-oss-20b routing", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
