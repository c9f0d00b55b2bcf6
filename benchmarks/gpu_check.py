"""One check of the engine on an accelerator, meant to take about 5 minutes: run it first when a GPU is lent.

    python -m benchmarks.gpu_check [--cpu-smoke] [--out DIR] [--routing-data DIR | --pack-routing DIR]

Writes `results/gpu_check_<device>.{json,md}` with, on JAX's default device:
1. fMoE's host work per decode iteration on this machine's CPU (experiment 7's real-size rows, gpt-oss-20b and
   Qwen1.5-MoE), as a share of an H100's compute (target <= 0.30), on a host that serves beside an
   accelerator (development VMs differ in speed by up to 2x);
2. the link (`benchmarks/link_compute.py`'s essentials): pinned-host -> device copies at 0.25-256 MB (a line
   gives the fixed cost per copy and the rate), a bench-s expert's copy, how much of a copy hides behind a
   compute issued after it and before it, and what one `lax.cond`, `lax.switch` and loop cost inside a
   program (the offload step and the decode kernel hold several per layer);
3. `offload_overhead` on bench-s (random weights, bf16): the resident engine, the offload engine holding every
   expert (warm), on_demand_lru and fmoe at 25 %, with launches and syncs per token, against the targets:
   warm <= 1.15x resident; on_demand_lru <= 1.3x its link-bound estimate (bytes moved per token / the
   measured rate + copies per token x the fixed cost + resident TPOT); fmoe <= 1.0x on_demand_lru;
4. `live_replay` of gpt-oss-20b's real routing on a random-weight gpt-oss-20b at full width (8 of its 24
   layers, so that the check fits a lent machine's time: the step program's compile grows with the layers,
   each compiling a switch over its experts; int4 experts, a cache of 25 % of the experts' bf16 bytes) for
   on_demand_lru, fmoe and oracle, copy-only and hybrid, each beside the simulator's prediction on the
   device's hardware preset (target: within 20 %).

A lent machine has no `../shared`: `--pack-routing DIR` writes the few requests section 4 replays (tens of
kB), to carry there and pass as `--routing-data`. Nor is fmoe_jax installed there, and its subpackages live
in other folders (pyproject's `package-dir`): install it with `pip install --no-deps --no-build-isolation
-e .`, or link `models`, `offload`, `convert` and `research` into a copy of `fmoe_jax/` and run from there.
`--cpu-smoke` runs every section at tiny sizes in seconds (tested), so the script is known to work before a
GPU is lent. A failing section is recorded and the others still run; each finished section is saved at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, save
from benchmarks.make_readme import MATCHER_TARGET
from benchmarks.real_routing import DEFAULT_PATH

BENCH_S = "bench-s"
LAYERS = 8  # live_replay's MoE layers (gpt-oss-20b has 24; see the docstring)
REPLAYED = {False: (3, 32), True: (1, 4)}  # live_replay's requests and decode steps, by --cpu-smoke
TARGETS = dict(warm_vs_resident=1.15, lru_vs_link_bound=1.3, fmoe_vs_lru=1.0, sim_vs_live=(0.8, 1.2))
HOST_MODELS = ("gpt-oss-20b", "Qwen1.5-MoE")  # the host section's (`matcher_overhead.MODELS` names)


def link_section(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.link_compute import (
        measure_control_flow,
        measure_copies,
        measure_expert_select,
        measure_latency,
        measure_overlap,
    )

    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    repeats = 3 if smoke else 10
    sizes = (0.25, 1, 4) if smoke else (0.25, 1, 4, 16, 64, 256)
    latency = measure_latency(pinned, device, repeats, None, sizes_mb=sizes)
    d, f = (64, 128) if smoke else (1024, 3584)
    copy, host = measure_copies(BENCH_S, d, f, jnp.bfloat16, (pinned, device), repeats, None)
    overlap = measure_overlap(host, device, copy["whole_ms"], repeats, width=256 if smoke else 8192)
    control = measure_control_flow(repeats, count=8 if smoke else 48, width=64 if smoke else 1024)
    select = measure_expert_select(repeats, d, f, layers=2 if smoke else 8)
    return dict(
        latency=latency, expert_copy=copy, overlap=overlap, control_flow=control, expert_select=select
    )


def overhead_section(smoke: bool, link: dict | None) -> dict:
    """offload_overhead's rows on bench-s (random weights), and the Must-show ratios."""
    import fmoe_jax as fj
    from benchmarks.offload_overhead import measure_in_turn
    from fmoe_jax.engines.offload import OffloadEngine
    from fmoe_jax.testing import PRESETS

    hf = dict(PRESETS["tiny-mixtral"] if smoke else PRESETS[BENCH_S])
    new_tokens, repeats = (4, 1) if smoke else (32, 2)
    resident = fj.random_model(hf, None)
    prompt = np.random.default_rng(0).integers(3, hf["vocab_size"], 16 if smoke else 128).tolist()
    cfg = resident.config
    total = cfg.num_moe_layers * cfg.num_experts
    slots = max(1, round(0.25 * total))
    base = fj.random_model(hf, fj.OffloadConfig(cache_experts=1))
    base.close()
    configs = {
        "warm (cache = all)": fj.OffloadConfig(policy="on_demand_lru", cache_experts=total),
        "on_demand_lru 25%": fj.OffloadConfig(policy="on_demand_lru", cache_experts=slots),
        "fmoe 25%": fj.OffloadConfig(policy="fmoe", cache_experts=slots, prefetch_distance=1),
    }
    models = {"resident": resident}
    for label, offload in configs.items():
        engine = OffloadEngine(base.module, offload, programs=base.engine.programs)
        models[label] = dataclasses.replace(base, engine=engine, offload=offload)
    try:  # the rows take turns, one generation each per round (`measure_in_turn`)
        rows = measure_in_turn(models, prompt, new_tokens, repeats)
    finally:
        for model in models.values():
            model.close()
    res, warm = rows["resident"]["tpot_ms"], rows["warm (cache = all)"]["tpot_ms"]
    lru, fmoe = rows["on_demand_lru 25%"], rows["fmoe 25%"]
    ratios = dict(warm_vs_resident=warm / res, fmoe_vs_lru=fmoe["tpot_ms"] / lru["tpot_ms"])
    if link is not None:
        fit = link["latency"]["fit"]
        expert_mb = base.engine.expert_bytes / 1e6
        copies = lru["mb_to_device_per_token"] / expert_mb
        bound_ms = lru["mb_to_device_per_token"] / fit["rate_gbs"] + copies * fit["latency_ms"] + res
        ratios.update(link_bound_ms=bound_ms, lru_vs_link_bound=lru["tpot_ms"] / bound_ms)
    return dict(rows=rows, ratios=ratios, moe_layers=cfg.num_moe_layers, slots=slots, total=total)


def host_section(smoke: bool) -> dict:
    """fMoE's host work per decode iteration on this machine's CPU, the host beside the accelerator:
    experiment 7's real-size rows for gpt-oss-20b (MXFP4 and bf16 experts) and Qwen1.5-MoE against an H100's
    compute (target: <= `MATCHER_TARGET` of it). Development VMs differ in speed by up to 2x; a lent
    machine's host is one fmoe would serve on."""
    from benchmarks import exp7_overhead

    repeats, capacity = (4, 64) if smoke else (30, 512)
    rows = exp7_overhead.real_size_rows(["h100_sxm"], repeats, 3, capacity, names=set(HOST_MODELS))
    keys = ("model", "compute_ms", "fmoe_host_ms", "host_range_ms", "matcher_share", "matcher_thread_share")
    return {"rows": [{k: r[k] for k in keys} for r in rows], "store_capacity": capacity, "repeats": repeats}


def replay_section(smoke: bool, hardware: str, host: str, routing: Path) -> dict:
    from benchmarks import live_replay

    requests, steps = REPLAYED[smoke]
    argv = ["--policies", "on_demand_lru,fmoe,oracle", "--modes", "copy,hybrid", "--budget-of", "bf16"]
    argv += ["--hardware", hardware, "--host", host, "--experts", "int4", "--routing-data", str(routing)]
    argv += ["--requests", str(requests), "--steps", str(steps)]
    if smoke:
        argv += ["--layers", "2", "--width-scale", "0.05"]
    else:
        argv += ["--layers", str(LAYERS), "--width-scale", "1"]
    return live_replay.replay(live_replay.parser().parse_args(argv))


def presets_for(device_kind: str) -> tuple[str, str]:
    """The simulator's hardware and host presets for this device."""
    kind = device_kind.lower()
    if "h200" in kind:
        return "h200_sxm", "server_8ch"
    if "h100" in kind:
        return "h100_sxm", "server_8ch"
    return "cpu_2core_vm", "cpu_2core_vm"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, seconds: the script's own check")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and markdown")
    p.add_argument("--routing-data", type=Path, default=DEFAULT_PATH, help="gpt-oss-20b's routing set")
    p.add_argument(
        "--pack-routing",
        type=Path,
        metavar="DIR",
        help="write to DIR the few requests of --routing-data the replay reads (tens of KB) and exit: "
        "a lent machine has no ../shared, so carry DIR there and pass it as --routing-data",
    )
    args = p.parse_args(argv)
    if args.pack_routing is not None:
        from benchmarks.live_replay import write_subset

        # --cpu-smoke's requests too; the store split's for `engine_costs --like gpt-oss-20b`'s relaunch
        splits = ("evaluation", "store")
        written = write_subset(args.pack_routing, *REPLAYED[False], args.routing_data, splits)
        print(f"{args.pack_routing}: {written / 1e3:.0f} kB, the requests gpu_check and engine_costs replay")
        return {}
    if not (args.routing_data / "requests.json").is_file():
        p.error(f"--routing-data {args.routing_data}: no routing set (for a lent machine: --pack-routing)")
    import jax

    kind = jax.devices()[0].device_kind
    device = re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") + ("_smoke" if args.cpu_smoke else "")
    hardware, host = presets_for(kind)
    payload: dict[str, Any] = dict(device_kind=kind, hardware_preset=hardware, host_preset=host, errors={})
    name = f"gpu_check_{device}"
    started = time.perf_counter()
    sections = (
        ("host", lambda: host_section(args.cpu_smoke)),
        ("link", lambda: link_section(args.cpu_smoke)),
        ("offload_overhead", lambda: overhead_section(args.cpu_smoke, payload.get("link"))),
        ("live_replay", lambda: replay_section(args.cpu_smoke, hardware, host, args.routing_data)),
    )
    for section, run in sections:
        print(f"-- {section}", flush=True)
        begin = time.perf_counter()
        try:
            payload[section] = run()
        except Exception as err:  # noqa: BLE001 - recorded; the other sections still run
            payload["errors"][section] = f"{type(err).__name__}: {err}"[:500]
            print(f"   failed: {payload['errors'][section]}", flush=True)
        payload.setdefault("seconds", {})[section] = time.perf_counter() - begin
        save(name, payload, args.out)
    payload["seconds"]["total"] = time.perf_counter() - started
    save(name, payload, args.out)
    (Path(args.out) / f"{name}.md").write_text(markdown(payload))
    print(markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    lines = [f"# gpu_check on {payload['device_kind']}", ""]
    link = payload.get("link")
    if link:
        fit = link["latency"]["fit"]
        lines += [
            f"- link: {fit['rate_gbs']:.1f} GB/s + {fit['latency_ms']:.3f} ms per copy"
            + ("" if fit.get("resolved", True) else " (rate not resolved by these sizes: bounds)")
            + f"; a bench-s expert "
            f"({link['expert_copy']['mb']:.1f} MB) {link['expert_copy']['whole_ms']:.2f} ms",
            "- copy hidden behind a compute: "
            + ", ".join(f"{r['issue']} {r['overlap']:.0%}" for r in link["overlap"] if "overlap" in r),
        ]
        control = link.get("control_flow")
        if control:
            lines.append(
                "- inside a program, each: "
                + ", ".join(f"{k} {v:.1f} us" for k, v in control["us_each"].items())
                + f" (over {control['count']} plain {control['width']}-wide matrix-vector products); "
                f"a launch {control['dispatch']['us_per_argument']:.2f} us per array argument"
            )
        select = link.get("expert_select")
        if select:
            per = select["ms_per_layer"]
            lines.append(
                f"- a decode layer's top-{select['top_k']} of {select['experts']} bench-s experts: "
                f"{per['switch']:.3f} ms by the engine's switch, {per['pool']:.3f} ms from a stacked pool "
                f"(outputs differ by at most {select['max_abs_difference']:.3g}; compiled in "
                f"{select['compile_s']['switch']:.1f} and {select['compile_s']['pool']:.1f} s)"
            )
    over = payload.get("offload_overhead")
    if over:
        lines += [
            "",
            "| bench-s, batch 1 | TPOT ms | hit rate | launches | syncs | MB/token |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in over["rows"].items():
            lines.append(
                f"| {label} | {r['tpot_ms']:.2f} | {r['hit_rate']:.2f} | {r['launches_per_token']:.2f} | "
                f"{r['syncs_per_token']:.2f} | {r['mb_to_device_per_token']:.1f} |"
            )
        lines.append("")
        lines.append(
            "ratios (targets: "
            + ", ".join(f"{k} <= {v}" for k, v in TARGETS.items() if k != "sim_vs_live")
            + "): "
            + ", ".join(f"{k} {v:.3g}" for k, v in over["ratios"].items())
        )
    replay = payload.get("live_replay")
    if replay:
        lines += [
            "",
            "| live_replay | mode | live TPOT ms | simulated ms | sim / live | hit rate live / sim |",
        ]
        lines.append("|---|---|---|---|---|---|")
        for r in replay["rows"]:
            lines.append(
                f"| {r['policy']} | {r['mode']} | {r['live_tpot_ms']:.2f} | {r['sim_tpot_ms']:.2f} | "
                f"{r['sim_vs_live']:.2f} | {r['live_hit_rate']:.2f} / {r['sim_hit_rate']:.2f} |"
            )
    host = payload.get("host")
    if host:
        lines += [
            "",
            f"| fMoE's host work per decode iteration (this CPU, store of {host['store_capacity']} maps) | "
            f"H100 compute ms | host ms | rounds' medians | share (target <= {MATCHER_TARGET:.2f}) | "
            "matcher thread's share |",
            "|---|---|---|---|---|---|",
        ]
        for r in host["rows"]:
            lines.append(
                f"| {r['model']} | {r['compute_ms']:.2f} | {r['fmoe_host_ms']:.2f} | {r['host_range_ms']} | "
                f"{r['matcher_share']:.3f} | {r['matcher_thread_share']:.3f} |"
            )
    for section, error in payload["errors"].items():
        lines.append(f"- {section} failed: {error}")
    lines.append("")
    lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in payload.get("seconds", {}).items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
