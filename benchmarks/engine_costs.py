"""The engine's own costs on this machine, for a simulator hardware preset (`offload/hardware.py`).

    python -m benchmarks.engine_costs [--like mixtral|gpt-oss-20b] [--layers 8] [--width-scale 0.25]
        [--only-relaunch] [--rounds 3] [--name engine_costs_cpu]

Measured live, by median over repeats (every program compiled and run before it is timed):
- the link: the engine's copy (`offload/transfer.py`'s `copier`) of a pinned-host array to the device at
  64 KB-8 MB; a straight line gives the fixed cost per copy and the rate;
- a launch: a jitted program of 1 to 4,096 small array arguments, called (the host's dispatch; a CPU backend
  also runs it), a straight line in the argument count; a sync: reading a finished program's 64 int32;
- the kernels: decode steps of the offload engine holding every expert (one launch and one sync a step) on
  random-weight models (bf16 experts, their own random routing) at top-1 and top-4 and at two expert widths
  give, against the preset's byte counts, the rate an expert streams at (`hbm_bytes_per_s` with efficiency
  1) and the fixed time per expert and per layer (attention block, router and the host's serving of the
  layer, which on a CPU backend runs on the same cores: `layer_host_s` stays 0);
- a relaunch (`launch_s`): decode steps at a quarter of the experts, by launch count, in `--rounds` rounds
  interleaved with the resident step, the median of the rounds' lines (`relaunch_fit`: robust to load).

`--like` picks the models' shape: small Mixtral-shaped ones, or gpt-oss-20b's dimensions times
`--width-scale` (`fmoe_jax.random_model`'s shrinking, as `benchmarks/live_replay.py` builds). A CPU's rate
for a bf16 matrix-vector product depends on the matrices' shapes (caches, vector widths), so a preset fit on
one shape family predicts that family. The fit never sees recorded routing: live_replay's check replays
real requests against it. Prints the preset's fields; writes `results/<name>.json`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, median_ms, print_table, save, saved
from benchmarks.link_compute import fit_link

BASE = dict(
    model_type="mixtral",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=16,
    num_experts_per_tok=4,
)
STEPS = 24
# bf16 experts by default, as models ship: one memory rate then covers experts, attention and the LM head
# alike (int4 experts on a CPU backend are bound by their dequantization, not their bytes, which one rate
# cannot say). `--experts int4` fits the kernels on int4 experts: for a preset checked against int4 replays.
EXPERTS = "none"


def link() -> dict:
    import jax
    from fmoe_jax.offload.transfer import copier

    device = jax.local_devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    sizes = [2**16, 2**18, 2**20, 2**22, 2**23]
    copy = copier(target)
    times = []
    for size in sizes:
        src = jax.device_put(np.ones(size, np.uint8), host)
        times.append(median_ms(lambda src=src: jax.block_until_ready(copy(src)), 20) / 1e3)
    fit = fit_link(sizes, times)
    return dict(
        copy_latency_s=fit["latency_ms"] / 1e3,
        link_bytes_per_s=fit["rate_gbs"] * 1e9,
        resolved=fit["resolved"],
        sizes=sizes,
        times_s=times,
    )


def launch_and_sync() -> dict:
    import jax
    import jax.numpy as jnp

    counts = [1, 256, 1024, 4096]
    times = []
    for n in counts:
        args = [jnp.ones((4,), jnp.float32) for _ in range(n)]
        fn = jax.jit(lambda *a: a[0] + 1)
        jax.block_until_ready(fn(*args))
        times.append(median_ms(lambda fn=fn, args=args: fn(*args), 50) / 1e3)
    slope, intercept = np.polyfit(counts, times, 1)
    step = jax.jit(lambda x: x + 1)
    x = step(jnp.arange(64, dtype=jnp.int32))
    reads = []
    for _ in range(200):  # a fresh result each time: a read one array has had is cached
        x = step(x)
        begin = time.perf_counter()
        np.asarray(jax.block_until_ready(x))
        reads.append(time.perf_counter() - begin)
    sync_s = float(np.median(reads))
    return dict(
        launch_s=max(float(intercept), 0.0), launch_argument_s=float(slope), sync_s=sync_s, counts=counts
    )


def decode_tpot(hf: dict, experts: str = EXPERTS) -> float:
    """Median decode step (s) of a random-weight model of `hf`'s sizes (bf16), batch 1, served by the
    offload engine holding every expert (one launch and one sync a step)."""
    import fmoe_jax as fj

    total = hf["num_hidden_layers"] * hf["num_local_experts"]
    offload = fj.OffloadConfig(policy="on_demand_lru", cache_experts=total, preload=True)
    model = fj.random_model(hf, offload, expert_quantization=experts)
    with model:
        fj.generate(model, [[1, 2, 3]], max_new_tokens=4, stop_at_eos=False)
        steps = []
        for _ in range(2):
            out = fj.generate(model, [[1, 2, 3]], max_new_tokens=STEPS, stop_at_eos=False)
            steps += out.stats.decode_step_s
    return float(np.median(steps))


def _quantization(experts: str) -> Any:
    """The `ExpertQuantization` of `--experts` (None: bf16), as the byte counts take it."""
    from fmoe_jax.models.quant import expert_quantization

    return None if experts == "none" else expert_quantization(experts)


def shape(like: str, layers: int, width_scale: float) -> dict:
    """The HF config the kernels are fit on (`--like`)."""
    if like == "mixtral":
        return dict(BASE, num_hidden_layers=layers)
    from fmoe_jax.offload.cost_model import GPT_OSS_20B

    from fmoe_jax.random_model import preset_hf_config, shrunk_hf_config

    return shrunk_hf_config(preset_hf_config(GPT_OSS_20B), layers=layers, width_scale=width_scale)


# The relaunch is measured in rounds (every request once a round, each decoded by the quarter cache and then
# by an engine holding every expert, interleaved), a line fit per round; the median of the rounds' slopes and
# intercepts resists a round a burst of load slowed (one pass over the requests on a loaded machine gave a
# launch 50 % dearer than alone, with a line below the resident step). A line whose step at one launch (a
# step that stopped for no miss) is off the resident step by more than `RESIDENT_TOLERANCE` is unresolved.
ROUNDS, RESIDENT_TOLERANCE = 3, 0.15


def relaunch(
    base: dict,
    launch: dict,
    link: dict,
    like: str,
    rounds: int = ROUNDS,
    experts: str = EXPERTS,
    routing: Path | None = None,
) -> dict:
    """What one more launch of the engine's step program costs beyond its arguments, its sync and the
    copies of the misses it stopped for (`launch_s`): decode steps at a quarter of the experts
    (on_demand_lru), a line through the median step at each launch count (`relaunch_fit`), against the
    resident step (every expert held) measured in the same rounds. gpt-oss-shaped models are forced to
    recorded routing of the store split (`benchmarks/real_routing.py`: never the requests live_replay
    checks); others route by their own random routers. A trivial program (`launch_and_sync`) launches in
    microseconds; the step program, whose conditionals pass every layer's state through, costs more on a
    CPU backend."""
    from fmoe_jax.models import config_from_hf
    from fmoe_jax.offload.cost_model import ModelPreset

    total = base["num_hidden_layers"] * base["num_local_experts"]
    steps = _relaunch_steps(base, like, total, rounds, experts, routing)
    fit = relaunch_fit(steps["quarter"], steps["launches"], steps["resident"])
    preset = ModelPreset.from_config(config_from_hf(base), quantization=_quantization(experts))
    copies_per_launch = steps["misses"] / max(1.0, float(np.sum(np.concatenate(steps["launches"]) - 1)))
    copy_s = preset.expert_bytes / link["link_bytes_per_s"] + link["copy_latency_s"]
    arguments = preset.launch_arguments(base["num_hidden_layers"], base["num_local_experts"])
    engine_s = arguments * launch["launch_argument_s"] + launch["sync_s"]

    def beyond(per_launch: float) -> float:  # the launch's own cost: less its copies, arguments and sync
        return max(float(per_launch - copies_per_launch * copy_s - engine_s), 0.0)

    if not fit["resolved"]:
        print(
            f"relaunch: the line's step at one launch ({1e3 * fit['one_launch_s']:.1f} ms) is off the "
            f"resident step ({1e3 * fit['resident_step_s']:.1f} ms) by more than {RESIDENT_TOLERANCE:.0%}: "
            "unresolved (a loaded machine?); rerun alone"
        )
    single = fit["single_pass"]
    return dict(
        launch_s=beyond(fit["per_launch_s"]),
        single_pass_launch_s=None if single is None else beyond(single["per_launch_s"]),
        copies_per_launch=copies_per_launch,
        **fit,
    )


def _relaunch_steps(
    base: dict, like: str, total: int, rounds: int, experts: str, routing: Path | None
) -> dict:
    """Decode steps of each round (the first request warms up, uncounted): the quarter cache's steps and
    their launch counts, the resident engine's steps, and the quarter cache's misses over all rounds."""
    import dataclasses

    import fmoe_jax as fj
    from benchmarks.live_replay import routing_requests
    from fmoe_jax.engines.offload import OffloadEngine

    offload = fj.OffloadConfig(policy="on_demand_lru", cache_experts=total // 4)
    model = fj.random_model(base, offload, expert_quantization=experts)
    everything = fj.OffloadConfig(policy="on_demand_lru", cache_experts=total, preload=True)
    engine = OffloadEngine(model.module, everything, programs=model.engine.programs)
    resident = dataclasses.replace(model, engine=engine, offload=everything)
    if like == "gpt-oss-20b":
        where = {} if routing is None else dict(path=routing)
        *traces, warmup = routing_requests(3, 32, base["num_hidden_layers"], split="store", **where)
        runs = [
            dict(prompts=[t.requests[0].prompt], max_new_tokens=32, forced_routing=t)
            for t in [warmup, *traces]
        ]
    else:
        runs = [dict(prompts=[[4 + i, 5, 6]], max_new_tokens=STEPS) for i in range(4)]  # the first warms up
    out = dict(quarter=[], launches=[], resident=[], misses=0)
    try:
        with model:
            for both in (model, resident):
                fj.generate(both, **runs[0], stop_at_eos=False)
            for _ in range(rounds):
                quarter, launches, held = [], [], []
                for run in runs[1:]:
                    stats = fj.generate(model, **run, stop_at_eos=False).stats
                    quarter += stats.decode_step_s
                    launches += stats.step_launches[1:]
                    out["misses"] += stats.misses
                    held += fj.generate(resident, **run, stop_at_eos=False).stats.decode_step_s
                out["quarter"].append(quarter)
                out["launches"].append(launches)
                out["resident"].append(held)
    finally:
        engine.close()
    return out


def relaunch_fit(steps: list, launches: list, resident: list, min_steps: int = 2) -> dict:
    """Per round, a line `step = fixed + per_launch * launches` through the median step at each launch count
    that has `min_steps` steps in the round; the median over rounds of the slope and of the intercept; the
    resident step (median of every round's). `resolved`: the line's step at one launch is within
    `RESIDENT_TOLERANCE` of the resident step. `single_pass`: the first round alone, as one pass was fit
    before rounds (counts with 3 steps or more), for comparison (None when it has too few counts)."""
    lines = [_line(t, n, min_steps) for t, n in zip(steps, launches, strict=True)]
    lines = [line for line in lines if line is not None]
    if not lines:
        raise ValueError("relaunch: no round has two launch counts with enough steps to fit a line")
    per_launch = float(np.median([line[0] for line in lines]))
    fixed = float(np.median([line[1] for line in lines]))
    round_resident = [float(np.median(r)) for r in resident]
    resident_s = float(np.median(round_resident))
    one = fixed + per_launch
    single = _line(steps[0], launches[0], 3)
    return dict(
        per_launch_s=per_launch,
        step_fixed_s=fixed,
        round_per_launch_s=[line[0] for line in lines],
        round_fixed_s=[line[1] for line in lines],
        round_resident_s=round_resident,
        one_launch_s=one,
        resident_step_s=resident_s,
        resolved=bool(abs(one / resident_s - 1) <= RESIDENT_TOLERANCE),
        single_pass=None if single is None else dict(per_launch_s=single[0], step_fixed_s=single[1]),
    )


def _line(steps: list, launches: list, min_steps: int) -> tuple[float, float] | None:
    """(slope, intercept) through the median step at each launch count with `min_steps` steps; None with
    fewer than two such counts."""
    t, n = np.asarray(steps, float), np.asarray(launches)
    counts = [c for c in np.unique(n) if np.sum(n == c) >= min_steps]
    if len(counts) < 2:
        return None
    slope, intercept = np.polyfit(counts, [np.median(t[n == c]) for c in counts], 1)
    return float(slope), float(intercept)


def kernels(launch: dict, base: dict, experts: str = EXPERTS) -> dict:
    """Fixed and per-byte expert and attention times from warm offload decode steps at two top-k and widths,
    less the step's launch and sync; the attention's fixed time holds the host's serving of the layer."""
    from fmoe_jax.models import config_from_hf
    from fmoe_jax.offload.cost_model import CostModel, HardwarePreset, ModelPreset

    wider = {**base, "intermediate_size": 2 * base["intermediate_size"]}
    runs = {
        "k1": decode_tpot({**base, "num_experts_per_tok": 1}, experts),
        "k4": decode_tpot(base, experts),
        "k4_wide": decode_tpot(wider, experts),
    }
    q = _quantization(experts)
    narrow = ModelPreset.from_config(config_from_hf(base), quantization=q)
    wide = ModelPreset.from_config(config_from_hf(wider), quantization=q)
    layers = base["num_hidden_layers"]
    per_expert = (runs["k4"] - runs["k1"]) / (3 * layers)  # seconds per expert, narrow
    per_expert_wide = (runs["k4_wide"] - runs["k4"]) / (4 * layers) + per_expert
    rate = (wide.expert_bytes - narrow.expert_bytes) / max(per_expert_wide - per_expert, 1e-9)
    expert_fixed = max(per_expert - narrow.expert_bytes / rate, 0.0)
    probe = HardwarePreset(
        "probe",
        hbm_bytes_per_s=rate,
        flops_per_s=1e12,
        link_bytes_per_s=1e9,
        memory_bytes=1,
        hbm_efficiency=1.0,
        flops_efficiency=1.0,
    )
    costs = CostModel(narrow, probe, base["num_local_experts"])
    attention_bytes_s = costs.attention_s(np.ones(1), np.full(1, 3 + STEPS // 2))
    head_s = costs.head_s(1)
    arguments = narrow.launch_arguments(layers, base["num_local_experts"])
    engine_s = launch["launch_s"] + arguments * launch["launch_argument_s"] + launch["sync_s"]
    attention_fixed = (runs["k1"] - engine_s - layers * per_expert - head_s) / layers - attention_bytes_s
    return dict(
        hbm_bytes_per_s=rate,
        expert_kernel_s=expert_fixed,
        attention_kernel_s=max(attention_fixed, 0.0),
        resident_tpot_s=runs,
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--like", default="mixtral", choices=["mixtral", "gpt-oss-20b"], help="models fit on")
    p.add_argument("--layers", type=int, default=8, help="their layers")
    p.add_argument("--width-scale", type=float, default=0.25, help="gpt-oss-20b's widths times this")
    p.add_argument(
        "--only-relaunch",
        action="store_true",
        help="measure the step program's relaunch alone; the rest from the saved --name",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of the relaunch measurement")
    p.add_argument(
        "--experts", default=EXPERTS, choices=["none", "int8", "int4"], help="the experts' quantization"
    )
    p.add_argument(
        "--routing-data",
        type=Path,
        default=None,
        help="gpt-oss-20b's routing set, for --like gpt-oss-20b's relaunch (default: real_routing's path; "
        "a lent machine: gpu_check --pack-routing's folder)",
    )
    p.add_argument("--name", default="engine_costs_cpu", help="results name")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    start = time.perf_counter()
    base = shape(args.like, args.layers, args.width_scale)
    if args.only_relaunch:
        measured = saved(args.name, args.out)["measured"]
    else:
        measured = dict(link=link(), launch=launch_and_sync())
        measured["kernels"] = kernels(measured["launch"], base, args.experts)
    measured["relaunch"] = relaunch(
        base, measured["launch"], measured["link"], args.like, args.rounds, args.experts, args.routing_data
    )
    r = measured["relaunch"]
    single = "-" if r["single_pass_launch_s"] is None else f"{1e3 * r['single_pass_launch_s']:.2f} ms"
    verdict = "resolved" if r["resolved"] else "UNRESOLVED"
    print(
        f"relaunch: launch_s {1e3 * r['launch_s']:.2f} ms (median of {len(r['round_per_launch_s'])} rounds; "
        f"one pass, as fit before: {single}); step at one launch {1e3 * r['one_launch_s']:.1f} ms against "
        f"the resident step {1e3 * r['resident_step_s']:.1f} ms: {verdict}"
    )
    fields = dict(
        hbm_bytes_per_s=measured["kernels"]["hbm_bytes_per_s"],
        link_bytes_per_s=measured["link"]["link_bytes_per_s"],
        copy_latency_s=measured["link"]["copy_latency_s"],
        expert_kernel_s=measured["kernels"]["expert_kernel_s"],
        attention_kernel_s=measured["kernels"]["attention_kernel_s"],
        launch_s=measured["relaunch"]["launch_s"],
        launch_argument_s=measured["launch"]["launch_argument_s"],
        sync_s=measured["launch"]["sync_s"],
        layer_host_s=0.0,  # inside attention_kernel_s: the fit is of the offload engine's own steps
    )
    print_table([{k: v for k, v in fields.items()}])
    save(
        args.name,
        dict(
            preset_fields=fields,
            fit_on=dict(like=args.like, hf_config=base, experts=args.experts),
            measured=measured,
            seconds=time.perf_counter() - start,
            load_average=dict(before=load_before, after=os.getloadavg()),
        ),
        args.out,
    )
    return fields


if __name__ == "__main__":
    main()
