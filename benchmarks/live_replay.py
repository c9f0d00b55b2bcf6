"""Real routing replayed live beside the simulator's prediction for the same requests.

    python -m benchmarks.live_replay [--requests 4] [--steps 48] [--layers 24] [--width-scale 0.25]
        [--experts bf16] [--policies on_demand_lru,fmoe] [--budgets 0.25] [--modes copy] [--resimulate]
        [--hardware cpu_2core_vm] [--name live_replay]

Requests of `benchmarks/real_routing.py`'s evaluation split (`--split validation`: its validation split, where
choices are made) of gpt-oss-20b's decode routing (evenly spaced over all but the split's last,
each its first `--steps` decode steps) are decoded one at a time, batch 1, by a model with random weights
(`fmoe_jax.random_model`) of gpt-oss-20b's dimensions (its first `--layers` layers, widths and vocabulary
times `--width-scale`, experts in `--experts`), every MoE layer forced to the recorded experts
(`generate(..., forced_routing=...)`): a one-token prompt whose routing is the request's first decode step,
then one step per later one. The simulator replays the same requests through the same policy and budget
(`simulate`, on `--hardware`: a preset with the engine's costs, `offload/hardware.py`), at the synthetic
model's sizes; the policy and cache see the same events in both (tested: `tests/test_forced_routing.py`).
A warm-up request (the split's last) runs first in both, so that programs are compiled and the
policy's state carries over alike. fmoe runs inline (`asynchronous=False`) on routing alone
(`semantic=False`: the routing set has no embeddings), learning online. The policy's host time per layer,
measured live on the same requests (`overhead_s["policy_events"]`), is what the simulator charges it
(`simulate(policy_s=...)`): the simulator predicts the rest. A policy that prices its own bookkeeping live
(fmoe's `pay_for_matching`, stats `bookkeeping_ms`: the median host time of its paid decode iterations) is
given that price in the simulator (`simulate(bookkeeping_s=...)`, per layer), and the time it measured per
miss (`copy_ms`, the exposed wait its credit counts), so that it rests where live it rested; its host time
per layer is then split into that price, charged for the iterations it pays for, and the rest, charged at
every layer. `sim_free_*`: the prediction with the bookkeeping free (as before that split). `live_stop_ms`:
what one stop of the step program cost live (the engine's `StopPrice`; the simulator charges the preset's
launch and sync); `*_stop_share_ms`: a miss's share of the stops, as fmoe prices it (decision "relaunch
price").

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

from benchmarks.common import RESULTS, HelpFormatter, print_table, save, save_png, saved
from benchmarks.real_routing import DEFAULT_PATH, evenly, request_names

PROMPT_TOKEN = 1  # the one-token prompt each request starts from; its routing is forced anyway
EXPERTS = {"bf16": None, "int8": "int8", "int4": "int4", "mxfp4": "mxfp4"}  # --experts: stored precision


def routing_requests(
    count: int,
    steps: int,
    layers: int,
    path: Path = DEFAULT_PATH,
    split: str = "evaluation",
    names: list[str] | None = None,
) -> list[Any]:
    """`count` requests of `split` (evenly spaced) and a warm-up one (the split's last), each a one-request
    `RoutingTrace` of its first `steps` decode steps and `layers` MoE layers, prompt `[PROMPT_TOKEN]`;
    `names`: these requests instead (the warm-up last), as a saved run names them."""
    from fmoe_jax.trace import RequestTrace, RoutingTrace

    chosen = chosen_requests(count, path, split) if names is None else list(names)
    trace = RoutingTrace.from_external(path, select=chosen)  # only these are read
    names = [r["request"] for r in trace.meta["requests"]]
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


def chosen_requests(count: int, path: Path = DEFAULT_PATH, split: str = "evaluation") -> list[str]:
    """The names `routing_requests` replays: `count` of `split` evenly spaced over all but its last, then
    the warm-up (its last): the warm-up is never among the measured, whose cache and policy it warms."""
    names = request_names(split, path)
    if len(names) < 2:
        raise ValueError(f"the {split} split has {len(names)} request(s): it needs a warm-up and one more")
    return evenly(names[:-1], count) + [names[-1]]


def write_subset(
    dest: Path, count: int, steps: int, path: Path = DEFAULT_PATH, splits: tuple[str, ...] = ("evaluation",)
) -> int:
    """Writes at `dest` the part of the routing set at `path` that `routing_requests(count, steps, split=s)`
    reads for each split `s` of `splits`: their request lists (which decide the evenly spaced choice) and the
    chosen requests' first `steps` decode steps. A machine without the shared data (a lent GPU) replays the
    same requests from it; this is not a routing set for anything else. Returns the bytes written."""
    import json

    from fmoe_jax.offload.trace_formats import REQUESTS, ROUTING_ARRAYS

    header = json.loads((path / REQUESTS).read_text())
    keep = {name for split in splits for name in request_names(split, path)}
    records = [
        {"request": r["request"], "dataset": r["dataset"]} for r in header["requests"] if r["request"] in keep
    ]
    arrays = np.load(path / ROUTING_ARRAYS)
    subset = {}
    for name in dict.fromkeys(name for split in splits for name in chosen_requests(count, path, split)):
        for key in (f"{name}__ids", f"{name}__w"):
            if key in arrays.files:
                subset[key] = arrays[key][:steps]
    dest.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dest / ROUTING_ARRAYS, **subset)
    fields = {k: v for k, v in header.items() if k != "requests"}
    (dest / REQUESTS).write_text(json.dumps({**fields, "requests": records}))
    return sum((dest / f).stat().st_size for f in (ROUTING_ARRAYS, REQUESTS))


def steps(trace: Any) -> int:
    """The decode steps of a one-request trace (`max_new_tokens` that replays it whole)."""
    return len(trace.requests[0].iterations)


# Rows that run a policy with options, by their label: fmoe pricing the engine's stops (decision "relaunch
# price"; off by default, so "fmoe-stops" runs as plain fmoe: the label names the setting in a table).
VARIANTS = {"fmoe+stops": ("fmoe", {"price_stops": True}), "fmoe-stops": ("fmoe", {"price_stops": False})}


def policy_options(policy: str, traces: list[Any]) -> dict:
    """What each policy (or `VARIANTS` label) runs with here: fmoe inline (the simulator cannot follow its
    thread), on routing alone; the oracle knows the requests it serves, in their order (the warm-up first)."""
    policy, options = VARIANTS.get(policy, (policy, {}))
    if policy == "fmoe":
        return {"asynchronous": False, "semantic": False} | options
    return {"traces": [traces[-1], *traces[:-1]]} if policy == "oracle" else {}


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
    tokens = sum(len(o.stats.decode_step_s) + 1 for o in outs)
    policy_s = sum(o.stats.overhead_s.get("policy_events", 0.0) for o in outs) / tokens
    launches = np.concatenate([o.stats.step_launches[1:] for o in outs])
    syncs = np.concatenate([o.stats.step_syncs[1:] for o in outs])
    return dict(
        **bookkeeping(warm.stats.extra, outs[-1].stats.extra, tokens, policy_s, base.config.num_moe_layers),
        tpot_s=[o.stats.tpot_s for o in outs],
        hits=sum(o.stats.hits for o in outs),
        misses=sum(o.stats.misses for o in outs),
        prefetches=sum(o.stats.prefetches for o in outs),
        launches_per_token=float(np.mean(launches)),
        syncs_per_token=float(np.mean(syncs)),
        policy_s_per_layer=policy_s / base.config.num_moe_layers,
        stop_ms=engine.stop_price.seconds * 1e3,
        stop_share_ms=outs[-1].stats.extra.get("stop_share_ms"),
    )


def bookkeeping(warm: dict, last: dict, tokens: int, policy_s: float, layers: int) -> dict:
    """What a policy that prices its own bookkeeping (stats `bookkeeping_ms`, fmoe's) measured live, for the
    simulator: the price per layer, the host time per layer left at every layer (`policy_s`, the mean per
    token, less the paid iterations' price), its time per miss (`copy_ms`) and the iterations it left the
    bookkeeping out of (warm-up included, as the simulator counts). Every value None for another policy.
    Each decode iteration here is one token (one-token prompts), so `tokens` are the measured iterations."""
    price_ms, copy_ms = last.get("bookkeeping_ms"), last.get("copy_ms")
    if price_ms is None:
        return dict.fromkeys(["bookkeeping_s", "floor_s", "copy_ms", "paid_share", "unpaid"])
    unpaid = last.get("unpaid_bookkeeping", 0)
    paid = max(0, tokens - (unpaid - warm.get("unpaid_bookkeeping", 0)))
    floor = max(0.0, policy_s * tokens - paid * price_ms / 1e3) / tokens
    return dict(
        bookkeeping_s=price_ms / 1e3 / layers,
        floor_s=floor / layers,
        copy_ms=copy_ms,
        paid_share=paid / tokens,
        unpaid=unpaid,
    )


def run_simulated(
    offload: Any,
    traces: list[Any],
    preset: Any,
    hardware: Any,
    host: Any,
    policy_s: float,
    bookkeeping_s: float | None = None,
) -> Any:
    from fmoe_jax.offload.simulator import simulate

    *measured, warmup = traces
    return simulate(
        measured,
        offload,
        model=preset,
        hardware=hardware,
        host=host,
        warmup=[warmup],
        policy_s=policy_s,
        bookkeeping_s=bookkeeping_s,
    )


def synthetic(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The synthetic model's config, its experts' quantization, and its sizes as the simulator's preset."""
    from fmoe_jax.models import config_from_hf
    from fmoe_jax.models.quant import expert_quantization
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, ModelPreset

    from fmoe_jax.random_model import preset_hf_config, shrunk_hf_config

    hf = shrunk_hf_config(preset_hf_config(GPT_OSS_20B), layers=args.layers, width_scale=args.width_scale)
    cfg = config_from_hf(hf)
    quantization = expert_quantization(EXPERTS[args.experts], None)
    return (
        cfg,
        quantization,
        ModelPreset.from_config(cfg, name="synthetic gpt-oss-20b", quantization=quantization),
    )


def replay(args: argparse.Namespace) -> dict:
    """Every policy x budget x mode, live and simulated; the rows and the settings."""
    from fmoe_jax.offload.cost_model import GPT_OSS_20B, ModelPreset

    import fmoe_jax as fj

    traces = routing_requests(args.requests, args.steps, args.layers, Path(args.routing_data), args.split)
    cfg, quantization, preset = synthetic(args)
    start = time.perf_counter()
    base = fj.random_model(
        GPT_OSS_20B,
        fj.OffloadConfig(cache_experts=1),
        layers=args.layers,
        width_scale=args.width_scale,
        expert_quantization=EXPERTS[args.experts] or "none",
    )
    base.close()
    built_s = time.perf_counter() - start
    total = cfg.num_moe_layers * cfg.num_experts
    # A budget is a share of the stored experts, or (--budget-of bf16) of the bytes they take in bf16.
    bf16_bytes = (
        ModelPreset.from_config(cfg).expert_bytes if args.budget_of == "bf16" else preset.expert_bytes
    )
    rows = []
    for budget in args.budgets:
        slots = max(1, min(total, int(budget * total * bf16_bytes // preset.expert_bytes)))
        for mode in args.modes:
            for policy in args.policies:
                live = run_live(base, offload_config(policy, slots, mode, traces), traces)
                row = dict(policy=policy, budget=budget, slots=slots, mode=mode)
                row.update(
                    live_tpot_ms=float(np.mean(live["tpot_s"])) * 1e3,
                    live_hit_rate=live["hits"] / max(1, live["hits"] + live["misses"]),
                    launches=live["launches_per_token"],
                    syncs=live["syncs_per_token"],
                    policy_us_per_layer=live["policy_s_per_layer"] * 1e6,
                    bookkeeping_us_per_layer=_us(live["bookkeeping_s"]),
                    floor_us_per_layer=_us(live["floor_s"]),
                    live_copy_ms=live["copy_ms"],
                    live_paid_share=live["paid_share"],
                    live_unpaid_bookkeeping=live["unpaid"],
                    live_stop_ms=live["stop_ms"],
                    live_stop_share_ms=live["stop_share_ms"],
                )
                rows.append(simulated(row, traces, preset, args))
                print_table(rows[-1:])
    model = dict(
        layers=cfg.num_moe_layers, hidden=cfg.hidden_size, expert_intermediate=cfg.expert_intermediate_size
    )
    model.update(
        vocab=cfg.vocab_size, experts=args.experts, expert_bytes=preset.expert_bytes, built_s=built_s
    )
    return dict(
        rows=rows,
        model=model,
        requests=[t.meta["requests"][0] for t in traces[:-1]],
        warmup_request=traces[-1].meta["requests"][0],
        steps=args.steps,
        budget_of=args.budget_of,
        total_experts=total,
        **presets(args),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def offload_config(policy: str, slots: int, mode: str, traces: list[Any], **options: Any) -> Any:
    from fmoe_jax.offload.config import OffloadConfig

    options = policy_options(policy, traces) | options
    return OffloadConfig(
        policy=VARIANTS.get(policy, (policy,))[0],
        cache_experts=slots,
        execution=mode,
        prefetch_distance=1,
        policy_options=options,
    )


def presets(args: argparse.Namespace) -> dict:
    from fmoe_jax.offload.cost_model import HARDWARE, HOSTS

    host = HOSTS.get(args.host)
    return dict(hardware=HARDWARE[args.hardware].name, host=None if host is None else host.name)


def simulated(row: dict, traces: list[Any], preset: Any, args: argparse.Namespace) -> dict:
    """`row` (a live run's) with the simulator's prediction for the same requests, policy and budget."""
    from fmoe_jax.offload.cost_model import HARDWARE, HOSTS

    hardware, host = HARDWARE[args.hardware], HOSTS.get(args.host)
    offload = offload_config(row["policy"], row["slots"], row["mode"], traces)
    policy_s = row["policy_us_per_layer"] / 1e6
    free = run_simulated(offload, traces, preset, hardware, host, policy_s)
    sim, price = free, row.get("bookkeeping_us_per_layer")
    if price is not None:  # the policy's live prices: its bookkeeping, and its time per miss
        options = {} if row.get("live_copy_ms") is None else {"copy_s": row["live_copy_ms"] / 1e3}
        offload = offload_config(row["policy"], row["slots"], row["mode"], traces, **options)
        floor_s = row["floor_us_per_layer"] / 1e6
        sim = run_simulated(offload, traces, preset, hardware, host, floor_s, bookkeeping_s=price / 1e6)
    return dict(
        row,
        sim_tpot_ms=sim.mean_tpot_s * 1e3,
        sim_vs_live=sim.mean_tpot_s * 1e3 / row["live_tpot_ms"],
        sim_hit_rate=sim.hit_rate,
        sim_launches=sim.launches / max(1, sum(len(t.requests[0].iterations) for t in traces[:-1])),
        sim_unpaid_bookkeeping=sim.extra.get("unpaid_bookkeeping", 0) if price is not None else None,
        sim_stop_share_ms=sim.extra.get("stop_share_ms"),
        sim_free_vs_live=free.mean_tpot_s * 1e3 / row["live_tpot_ms"],
        sim_free_hit_rate=free.hit_rate,
    )


def resimulate(args: argparse.Namespace) -> dict:
    """A saved run's live rows (`--resimulate`) beside the simulator on the current presets, with its own
    settings (requests, sizes); the machine's live numbers are kept as measured."""
    payload = saved(args.name, args.out)
    settings = argparse.Namespace(**{**payload["args"], "hardware": args.hardware, "host": args.host})
    split = getattr(settings, "split", "evaluation")  # (runs saved before `--split` replayed evaluation)
    path = Path(settings.routing_data)
    names = [*payload["requests"], payload["warmup_request"]]  # what was measured, whatever chooses now
    traces = routing_requests(settings.requests, settings.steps, settings.layers, path, split, names)
    preset = synthetic(settings)[2]
    payload["rows"] = [simulated(row, traces, preset, settings) for row in payload["rows"]]
    payload.update(presets(settings), resimulated=True)
    return payload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--requests", type=int, default=4, help="requests of --split replayed (evenly spaced)")
    p.add_argument(
        "--split",
        default="evaluation",
        choices=["evaluation", "validation"],
        help="the routing's part the requests (and the warm-up) come from: choices are made on validation",
    )
    p.add_argument("--steps", type=int, default=48, help="decode steps replayed per request (its first)")
    p.add_argument("--layers", type=int, default=24, help="MoE layers of the synthetic model (gpt-oss: 24)")
    p.add_argument("--width-scale", type=float, default=0.25, help="widths and vocabulary times this")
    p.add_argument("--experts", default="bf16", choices=list(EXPERTS), help="expert precision")
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=["on_demand_lru", "fmoe"],
        help=f"policies, or labels of a policy with options ({', '.join(VARIANTS)}: fmoe+stops turns "
        "fmoe's price_stops on; fmoe-stops is plain fmoe, where it is off by default)",
    )
    p.add_argument("--budgets", type=lambda s: [float(b) for b in s.split(",")], default=[0.25])
    p.add_argument(
        "--budget-of",
        choices=["experts", "bf16"],
        default="experts",
        help="a budget's share of the stored experts, or of their bytes in bf16 (more slots when quantized)",
    )
    p.add_argument("--modes", type=lambda s: s.split(","), default=["copy"], help="copy and/or hybrid")
    p.add_argument("--hardware", default="cpu_2core_vm", help="the simulator's hardware preset")
    p.add_argument("--host", default="cpu_2core_vm", help="the simulator's host preset (hybrid)")
    p.add_argument("--routing-data", default=str(DEFAULT_PATH), help="the routing set's directory")
    p.add_argument("--name", default="live_replay", help="results name under --out")
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="a saved run's live rows against the simulator again (no live run)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.resimulate:
        payload = resimulate(args)
    else:
        load_before = os.getloadavg()
        payload = replay(args)
        payload["load_average"] = dict(before=load_before, after=os.getloadavg())
    print(f"\n{describe(payload)}")
    print_table(payload["rows"])
    save(args.name, payload, args.out)
    write_md(saved(args.name, args.out), args.out / f"{args.name}.md")
    plot(saved(args.name, args.out), args.out / f"{args.name}.png")
    return payload


def warm_measured(payload: dict) -> str | None:
    """A saved run's warm-up request if it was measured too (the choice before 2026-11-30), else None."""
    warm = payload.get("warmup_request")
    return warm if warm in payload["requests"] else None


def describe(payload: dict) -> str:
    m, split = payload["model"], payload["args"].get("split", "evaluation")
    overlap = ""
    if warm := warm_measured(payload):
        overlap = f" (the warm-up request, {warm}, is among them: measured warm)"
    return (
        f"gpt-oss-20b's real routing, {len(payload['requests'])} {split} requests{overlap} x "
        f"{payload['steps']} decode steps, batch 1, live on a random-weight gpt-oss-20b of {m['layers']} "
        f"MoE layers, hidden {m['hidden']}, expert intermediate {m['expert_intermediate']}, vocabulary "
        f"{m['vocab']}, {m['experts']} experts ({m['expert_bytes'] / 1e6:.2f} MB each), beside the simulator "
        f"on {payload['hardware']} at the same sizes; load average "
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
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
