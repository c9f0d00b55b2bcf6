"""Experiment 7 (paper figures 15 and 16): where one iteration's time goes, and the store's memory.

    .venv/bin/python -m benchmarks.exp7_overhead [--model ...] [--capacities 1024 ... 32768]

(a) Live, on this machine (the variants taking turns request by request): the mean time per iteration of
`fmoe` (and `on_demand_lru` for comparison) split into the engine's stages (`out.stats.overhead_s`): context
collection (copying the embedding to the host), policy events (publishing contexts; on the critical path),
waiting for on-demand loads, issuing prefetches, and the rest of the step (inference); map matching and map
updates run on the matcher thread, off the critical path, and are shown beside.
(b) At real sizes: one decode iteration (batch 1) of Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Phi-3.5-MoE,
Qwen3-30B-A3B, OLMoE, DeepSeek-V2-Lite and gpt-oss-20b (MXFP4 experts as shipped, and bf16 as the routing
experiments replay it) on each `--hardware` preset from the cost model (compute, one expert copy), next to
fMoE's host work at those shapes, measured here with `benchmarks/matcher_overhead.py`'s `measure` (a full
store of `--store-capacity` maps, the experiments' and fmoe's default): its parts (one semantic search, the
L - d trajectory searches, one map update and one reuse hint (`future_of`) per iteration) and the whole
policy's iteration (`fmoe_host_ms`: the same plus selection, admission, the calibration and forecast updates,
less the searches `skip_confirmed` and resting after repeated matches leave out; `matcher_share` is it over
the compute; `no_search_ms` the same without searches; `matcher_thread_ms` the part of it the matcher thread
does live, searches, selection, the map update and the hint, the rest being the engine thread's), and the
simulated iteration of the workload's own routing at its preset's sizes (compute, stall), with fmoe's matcher
free (as the other experiments simulate it) and taking the host time measured here
(`simulate(matcher_s=...)`), beside on_demand_lru.
(c) The expert-map store's host memory by capacity for each real model.
Writes `exp7_overhead.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png

NAME = "exp7_overhead"
STAGES = ("context_collection", "policy_events", "on_demand_wait", "prefetch_issue")
BACKGROUND = ("matching", "store_update")  # the fmoe matcher thread's own work


# Live rows: fmoe as it serves, fmoe doing every search and update (`pay_for_matching=False`: the matcher's
# whole host cost on this machine), and on_demand_lru.
LIVE_VARIANTS = (
    h.Variant("fmoe", "fmoe"),
    h.Variant("fmoe (every search)", "fmoe", (("pay_for_matching", False),)),
    h.Variant("on_demand_lru", "on_demand_lru"),
)


def live_breakdown(variant: h.Variant, r: dict) -> dict:
    """One row of (a) from `variant`'s live numbers `r` (`harness.run_live_interleaved`)."""
    per_it = {k: 1e3 * v / r["iterations"] for k, v in r["overhead_s"].items()}
    step_ms = 1e3 * (sum(r["ttft_s"]) + sum(r["decode_step_s"])) / r["iterations"]
    row = {"policy": variant.label, "iteration_ms": step_ms}
    row |= {f"{k}_ms": per_it.get(k, 0.0) for k in STAGES}
    # fmoe's matcher thread issues its prefetches itself; inline policies issue them on the engine thread.
    critical = STAGES[:3] if variant.policy == "fmoe" else STAGES
    row["inference_ms"] = step_ms - sum(per_it.get(k, 0.0) for k in critical)
    row |= {f"{k}_ms (thread)": per_it.get(k, 0.0) for k in BACKGROUND}
    row["iterations"] = r["iterations"]
    extra = r["extra"]
    row["searches"] = extra.get("trajectory_matches", 0) + extra.get("semantic_matches", 0)
    row["unpaid"] = sum(v for k, v in extra.items() if k.startswith("unpaid_"))  # left out: cost > saving
    return row


def real_size_rows(
    hardware: list[str],
    repeats: int,
    prefetch_distance: int,
    store_capacity: int,
    names: set[str] | None = None,
) -> list[dict]:
    """Part (b): each real model's decode iteration on each `hardware` preset beside fMoE's host work at its
    shapes (`names`: only the models whose matcher shapes go by these `matcher_overhead.MODELS` names)."""
    import dataclasses

    from fmoe_jax.offload.cost_model import HARDWARE, MODELS, CostModel

    from benchmarks import matcher_overhead as mo

    flush = np.ones((mo.FLUSH_BYTES // 4,), np.float32)
    gpt_oss = MODELS["gpt_oss"]  # MXFP4 experts, as shipped; the routing experiments replay it in bf16
    bf16 = dataclasses.replace(gpt_oss, name=f"{gpt_oss.name} (bf16 experts)", expert_quantization=None)
    presets = (  # each real model, and the name its matcher shapes go by (matcher_overhead.MODELS)
        (MODELS["mixtral"], "Mixtral-8x7B"),
        (MODELS["qwen2_moe"], "Qwen1.5-MoE"),
        (MODELS["phimoe"], "Phi-3.5-MoE"),
        (MODELS["qwen3_moe"], "Qwen3-30B-A3B"),
        (MODELS["olmoe"], "OLMoE-1B-7B"),
        (MODELS["deepseek_v2"], "DeepSeek-V2-Lite"),
        (gpt_oss, "gpt-oss-20b"),
        (bf16, "gpt-oss-20b"),
    )
    measured: dict[str, dict] = {}  # the matcher's shapes do not depend on the experts' dtype: timed once
    rows = []
    for preset, name in presets:
        if names is not None and name not in names:
            continue
        if name not in measured:
            measured[name] = mo.measure(
                name, mo.MODELS[name], store_capacity, repeats, flush, prefetch_distance, top_k=preset.top_k
            )
        m = measured[name]
        host, rounds = m["policy_iteration"]["p50_ms"], m["policy_iteration_rounds_ms"]
        for hw in hardware:
            costs = CostModel(preset, HARDWARE[hw], preset.num_experts)
            copy_ms = 1e3 * HARDWARE[hw].copy_s(preset.expert_bytes)
            layer = costs.attention_s(np.array([1]), np.array([64])) + costs.experts_s([1] * preset.top_k)
            layer += costs.shared_s(1)
            compute_ms = 1e3 * (preset.num_layers * layer + costs.head_s(1))
            rows.append(
                dict(
                    model=preset.name,
                    hardware=hw,
                    compute_ms=compute_ms,
                    expert_copy_ms=copy_ms,
                    # The most `pay_for_matching` credits per decode iteration (L x k copies, every needed
                    # expert a miss; it scales this by the share that would miss): the matcher's budget.
                    link_at_stake_ms=preset.num_layers * preset.top_k * copy_ms,
                    semantic_search_ms=m["sem_sketch"]["p50_ms"],
                    trajectory_searches_ms=m["traj_iteration"]["p50_ms"],
                    map_update_ms=m["add_full_b1"]["p50_ms"],
                    reuse_hint_ms=m["future_of_b1"]["p50_ms"],
                    searches=m["searches_per_iteration"],
                    fmoe_host_ms=host,
                    host_range_ms=f"{min(rounds):.2f}-{max(rounds):.2f}",  # its rounds' medians: the drift
                    no_search_ms=m["policy_iteration_no_search"]["p50_ms"],
                    matcher_share=host / compute_ms,
                    # The part of it the matcher thread does live (searches, selection, map update, hint).
                    matcher_thread_ms=m["matcher_thread"]["p50_ms"],
                    matcher_thread_share=m["matcher_thread"]["p50_ms"] / compute_ms,
                )
            )
    return rows


def sim_rows(w: h.Workload, hardware: str, real: list[dict]) -> list[dict]:
    """fmoe simulated at the workload's preset sizes with its matcher free and at the host time per context
    measured here at those sizes (`real`), and on_demand_lru beside them."""
    (size,) = [r for r in real if r["model"] == w.preset.name and r["hardware"] == hardware]
    per_context_s = 1e-3 * size["fmoe_host_ms"] / (size["searches"] + 2)  # + the semantic search, the update
    iterations = sum(len(b.trace.requests[0].iterations) for b in w.eval)
    rows = []
    for label, policy, matcher_s in (
        ("fmoe, matcher free", "fmoe", 0.0),
        ("fmoe, matcher at this CPU's speed", "fmoe", per_context_s),
        ("on_demand_lru", "on_demand_lru", 0.0),
    ):
        r = h.run_sim(w, h.Variant(policy, policy), hardware, matcher_s=matcher_s)
        rows.append(
            dict(
                policy=label,
                hardware=hardware,
                matcher_ms_per_context=1e3 * matcher_s,
                iteration_ms=1e3 * r.total_s / iterations,
                compute_ms=1e3 * r.compute_s / iterations,
                stall_ms=1e3 * r.stall_s / iterations,
                median_tpot_ms=1e3 * r.median_tpot_s,
                hit_rate=r.hit_rate,
                searches=r.extra.get("trajectory_matches", 0) + r.extra.get("semantic_matches", 0),
                unpaid=sum(v for k, v in r.extra.items() if k.startswith("unpaid_")),
            )
        )
    return rows


def memory_rows(capacities: list[int], prefetch_distance: int) -> list[dict]:
    from fmoe_jax.offload.cost_model import MODELS
    from fmoe_jax.offload.policies.fmoe.store import ExpertMapStore

    rows = []
    for preset in MODELS.values():
        row = {"model": preset.name}
        for c in capacities:
            store = ExpertMapStore(
                capacity=c,
                num_layers=preset.num_layers,
                num_experts=preset.num_experts,
                embed_dim=preset.hidden_size,
                prefetch_distance=prefetch_distance,
            )
            row[f"{c}_MiB"] = store.nbytes / 2**20
        rows.append(row)
    return rows


def plot(payload: dict, path) -> None:
    """Figures 15 and 16 from the saved results: one iteration's time by stage (live), and the expert-map
    store's memory by capacity (computed at the real models' sizes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = {model: result["live"] for model, result in payload["models"].items() if result.get("live")}
    memory = payload["memory"]
    capacities = [int(k.removesuffix("_MiB")) for k in memory[0] if k.endswith("_MiB")]
    backend = payload["machine"]["backend"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    stages = [*(f"{k}_ms" for k in STAGES), "inference_ms", *(f"{k}_ms (thread)" for k in BACKGROUND)]
    rows = [(f"{name} {r['policy']}", r) for name, rs in live.items() for r in rs]
    for s, stage in enumerate(stages):
        base = [sum(r.get(x, 0.0) for x in stages[:s]) for _, r in rows]
        left.barh(range(len(rows)), [r.get(stage, 0.0) for _, r in rows], left=base, label=stage)
    labels = [label for label, _ in rows]
    left.set_yticks(range(len(rows)), labels, fontsize=8)
    left.set(xlabel="ms per decode iteration")
    left.set_title(
        f"{h.mode_title('live', backend)}: one iteration by stage (thread stages run beside it)", fontsize=9
    )
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for r in memory:
        right.plot(capacities, [r[f"{c}_MiB"] for c in capacities], marker="o", label=r["model"])
    right.set_title("computed at real sizes: expert-map store memory", fontsize=9)
    right.set(
        xlabel="store capacity (maps)",
        ylabel="MiB",
        xscale="log",
        yscale="log",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    parser.add_argument(
        "--capacities",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192, 16384, 32768],
        help="store capacities (expert maps) swept",
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed matcher calls per measurement")
    args = parser.parse_args(argv)
    tables, payload, notes = {}, {"models": {}}, []
    # First: the simulated rows charge the host time measured here, at the experiments' store capacity.
    real = real_size_rows(args.hardware, args.repeats, args.prefetch_distance, args.store_capacity)
    for name in args.model:
        w = h.load_workload(name, args)
        notes.append(h.settings_note(w))
        result = payload["models"][w.name] = {}
        if not args.no_live:
            runs = h.run_live_interleaved(w, LIVE_VARIANTS)  # request by request: drift falls on each alike
            rows = [live_breakdown(v, runs[v.label]) for v in LIVE_VARIANTS]
            result["live"] = rows
            tables[f"{w.name}, live: mean time per iteration (ms)"] = rows
        if not args.no_sim:
            rows = [r for hw in args.hardware for r in sim_rows(w, hw, real)]
            result["sim"] = rows
            tables[
                f"{w.name}, simulated at {w.sizes()}: mean time per iteration, the matcher free or "
                "at this CPU's speed"
            ] = rows
        w.model.close()
    memory = memory_rows(args.capacities, args.prefetch_distance)
    payload |= {"real_size": real, "memory": memory, "args": {k: str(v) for k, v in vars(args).items()}}
    tables["real sizes: one decode iteration (cost model) and fMoE's host work (measured here)"] = real
    tables["expert-map store memory (MiB) by capacity"] = memory
    notes += [
        "real-size compute: batch 1, 64 tokens in the KV cache, all experts resident (the floor); a miss "
        "adds expert_copy_ms unless hidden; fMoE's host work runs on its matcher thread, beside it; "
        "fmoe_host_ms: the median over five rounds of the policy iteration, taking turns with "
        "no_search_ms's, each round from the same store with new tokens (never ones it has learned); "
        "host_range_ms: the least and most of the rounds' medians (this machine's drift); "
        "no_search_ms: the same policy iteration with its searches off (engine-thread bookkeeping per layer, "
        "the reuse forecast, the map update and the reuse hint), a floor under fmoe_host_ms that faster "
        "searching cannot lower",
        "simulated: fmoe with its matcher free (every search's prefetches requested at once, the other "
        "experiments' assumption) and at this CPU's speed (`simulate(matcher_s=...)`: each search or update "
        "takes fmoe_host_ms / (searches + 2) of the real-size table, the whole policy's host time per "
        "iteration spread over its contexts, engine-thread work included: an upper bound; its prefetches "
        "come that much later, and `pay_for_matching` leaves out the searches the link time at stake cannot "
        "pay for); on_demand_lru for comparison; median_tpot_ms over the requests",
        "live: fmoe's prefetch_issue is spent on its matcher thread (it requests its own prefetches), so its "
        "inference_ms excludes only context collection, policy events and on-demand waits; stage times "
        "are per iteration (prefill and decode), the thread's beside the engine's",
    ]
    h.write_results(NAME, "Experiment 7: overheads (figures 15 and 16)", payload, tables, notes, args.out)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
