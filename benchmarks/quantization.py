"""Quantized experts (int8, int4): bytes per expert, quality of the shipped models, expert-kernel speed on
this machine, and simulated decoding at Mixtral-8x7B sizes.

    .venv/bin/python -m benchmarks.quantization [--parts bytes quality kernel sim] [--group-sizes 16 32 64]
    .venv/bin/python -m benchmarks.quantization --quick   # ~15 min on a 2-core CPU: fewer windows, prompts

- bytes: one routed expert as stored (values + scales) against bfloat16, per group size, for the shipped
  models, bench-s and the simulator's real-model presets.
- quality: each shipped model as shipped (bfloat16) against its int8 / int4 experts at each group size that
  divides its dimensions: mean next-token NLL on the held-out text of every domain (the windows of
  `benchmarks/TRAINED_MODELS.md`, `research.train.held_out_nll`; `--max-windows` takes the first windows of
  each domain), and greedy agreement over 64 generated tokens on held-out prompts of every domain (share of
  positions equal, tokens before the first difference). Nothing here chooses a setting: every group size is
  reported. Both scoring and generation use the "blocked" kernel, which computes the same mixture as the
  default one: the default decode kernel switches per assignment, and with quantized experts (a dequantize
  in every branch) compiled for ~60 s per setting here, against ~15 s.
- kernel: `expert_parts` at bench-s expert shapes (hidden 1024, intermediate 3584, 8 experts, top-2),
  1 and 8 tokens, bfloat16 against int8 / int4 at the default group size, jitted as the engine jits it;
  medians over interleaved repeats, ratios from this run.
- sim: on-demand LRU and fMoE on the recorded traces of `fmoe-tiny-mixtral` replayed at Mixtral-8x7B sizes
  on the RTX 3090 preset, copy only, with a cache of 25 % of the bfloat16 experts' bytes: int8 holds about
  2x and int4 about 4x as many experts, and each miss moves 0.52x / 0.27x the bytes. The traces are the
  bfloat16 model's routing for every precision (quantization changes bytes, here, not routing). Each policy
  also runs hybrid (`--sim-host`, the RTX 3090 desktop's DDR4 host by default): a miss may be computed on the
  host, which reads the expert's stored bytes, so quantization speeds that path as well.

Writes `quantization.{json,md,png}` to --out; parts not run keep their previous results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png

NAME = "quantization"
KINDS = ("int8", "int4")
PARTS = ("bytes", "quality", "kernel", "sim")
BENCH_S = dict(hidden=1024, intermediate=3584, experts=8, top_k=2)  # benchmarks/decode_speed.py's model


def settings(cfg: Any, group_sizes: list[int]) -> list[tuple[str, int | None]]:
    """(kind, group size) pairs valid for a model, bfloat16 (None, None) first."""
    from fmoe_jax.models.quant import ExpertQuantization

    out: list[tuple[str, int | None]] = [("bf16", None)]
    for kind in KINDS:
        for g in group_sizes:
            try:
                ExpertQuantization(kind, g).check_model(cfg.hidden_size, cfg.expert_intermediate_size)
            except ValueError:
                continue
            out.append((kind, g))
    return out


def label(kind: str, group: int | None) -> str:
    return kind if group is None else f"{kind} g{group}"


def shipped_config(name: str) -> Any:
    """A shipped model's `MoEConfig`, from its config.json alone."""
    from fmoe_jax.models import config_from_hf

    import fmoe_jax as fj

    return config_from_hf(json.loads((fj.loading.resolve(name) / "config.json").read_text()))


# ---------------------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------------------


def bytes_part(args) -> list[dict]:
    """Ratios per (kind, group size); a group size that does not divide a model's dimensions is left out."""
    from fmoe_jax.offload.cost_model import MODELS, ModelPreset

    import fmoe_jax as fj

    # Real models first: every group size divides their dimensions, so the first row names every column.
    presets = {p.name: p for p in MODELS.values()}
    presets["bench-s"] = dataclasses.replace(
        next(iter(MODELS.values())),
        name="bench-s",
        hidden_size=BENCH_S["hidden"],
        expert_intermediate_size=BENCH_S["intermediate"],
    )
    for name in fj.shipped_models():
        presets[name] = ModelPreset.from_config(shipped_config(name), name)
    rows = []
    for name, preset in presets.items():
        row = dict(model=name, bf16_bytes=preset.expert_bytes)
        for kind in KINDS:
            for g in args.group_sizes:
                try:
                    q = dataclasses.replace(preset, expert_quantization=kind, quantization_group_size=g)
                except ValueError:
                    continue
                row[label(kind, g)] = q.expert_bytes / preset.expert_bytes
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------
# quality
# ---------------------------------------------------------------------------------------------------------


def quality_part(args) -> dict[str, Any]:
    import jax
    from fmoe_jax.research import train, workloads

    import fmoe_jax as fj

    texts = workloads.load_corpora(args.data / "corpora", "held_out")
    prompts = workloads.domain_prompts(args.data / "corpora", args.greedy_prompts, seed=1)
    out = {}
    for name in fj.shipped_models():
        base_cfg = shipped_config(name)
        result: dict[str, Any] = {}
        reference_tokens = None
        for kind, group in settings(base_cfg, args.group_sizes):
            start = time.monotonic()
            q = {} if kind == "bf16" else dict(expert_quantization=kind, quantization_group_size=group)
            model = fj.load_model(name, **q)
            first_expert = model.module.experts[base_cfg.moe_layer_ids[0]][0]
            # The blocked kernel computes the same mixture; it compiles fastest (see the docstring).
            scorer = fj.from_module(model.module, tokenizer=model.tokenizer, kernel="blocked")
            held = train.held_out_nll(
                lambda t, s=scorer: fj.forward(s, t), model.tokenizer, texts, max_windows=args.max_windows
            )
            tokens = sum(r["tokens"] for r in held.values())
            generated = fj.generate(scorer, [p.text for p in prompts], args.greedy_tokens, stop_at_eos=False)
            if reference_tokens is None:
                reference_tokens = generated.tokens
            same = [
                np.asarray(a) == np.asarray(b)
                for a, b in zip(generated.tokens, reference_tokens, strict=True)
            ]
            result[label(kind, group)] = dict(
                kind=kind,
                group_size=group,
                nll={d: r["nll"] for d, r in held.items()},
                tokens={d: r["tokens"] for d, r in held.items()},
                mean_nll=sum(r["nll"] * r["tokens"] for r in held.values()) / tokens,
                agreement=float(np.mean([s.mean() for s in same])),
                prefix=float(np.mean([np.argmin(s) if not s.all() else len(s) for s in same])),
                identical=float(np.mean([s.all() for s in same])),
                expert_bytes=sum(a.nbytes for a in jax.tree.leaves(first_expert.weights())),
                seconds=time.monotonic() - start,
            )
            print(
                f"  {name} {label(kind, group)}: mean NLL {result[label(kind, group)]['mean_nll']:.4f}",
                flush=True,
            )
        base = result["bf16"]["mean_nll"]
        for r in result.values():
            r["nll_increase"] = r["mean_nll"] / base - 1
            r["worst_domain_increase"] = max(r["nll"][d] / result["bf16"]["nll"][d] - 1 for d in r["nll"])
        out[name] = result
    return out


# ---------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------


def kernel_part(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from fmoe_jax.models.moe import ExpertWeights, Routing, expert_parts
    from fmoe_jax.models.quant import DEFAULT_GROUP_SIZE, ExpertQuantization, quantize

    from fmoe_jax.engines.programs import EXACT_ROUNDING

    d, f, j, k = BENCH_S["hidden"], BENCH_S["intermediate"], BENCH_S["experts"], BENCH_S["top_k"]
    rng = np.random.default_rng(0)
    dense = [
        [(rng.normal(0, 0.02, s)).astype(ml_dtypes.bfloat16) for s in ((f, d), (f, d), (d, f))]
        for _ in range(j)
    ]
    experts = {"bf16": [ExpertWeights(*map(jnp.asarray, e)) for e in dense]}
    for kind in KINDS:
        spec = ExpertQuantization(kind, DEFAULT_GROUP_SIZE)
        experts[kind] = [
            ExpertWeights(*(jax.tree.map(jnp.asarray, quantize(w, spec)) for w in e)) for e in dense
        ]
    step = jax.jit(
        lambda x, r, e, s, v: expert_parts(x, r, e, s, v), compiler_options=EXACT_ROUNDING
    )  # kernel "auto": "unrolled" for these sizes, as in decoding
    rows = []
    for n in args.kernel_tokens:
        x = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
        ids = np.stack([rng.choice(j, k, replace=False) for _ in range(n)]).astype(np.int32)
        r = Routing(jnp.full((n, j), 1.0 / j), jnp.asarray(ids), jnp.full((n, k), 1.0 / k))
        slots, valid = jnp.arange(j, dtype=jnp.int32), jnp.ones(n, bool)
        arguments = {name: (x, r, e, slots, valid) for name, e in experts.items()}
        calls = {name: (lambda a=a: jax.block_until_ready(step(*a))) for name, a in arguments.items()}
        for call in calls.values():
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.kernel_repeats):  # interleaved: machine load hits every variant alike
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
        bf16 = float(np.median(times["bf16"]))
        used = len(set(ids.ravel().tolist()))
        for name, ts in times.items():
            per_expert = sum(a.nbytes for a in jax.tree.leaves(experts[name][0]))
            rows.append(
                dict(
                    tokens=n,
                    experts_used=used,
                    precision=name,
                    ms=1e3 * float(np.median(ts)),
                    ratio=float(np.median(ts)) / bf16,
                    mb_per_expert=per_expert / 1e6,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------------------
# simulated TPOT
# ---------------------------------------------------------------------------------------------------------


def sim_part(args) -> list[dict]:
    from fmoe_jax.offload.cost_model import HARDWARE, HOSTS
    from fmoe_jax.offload.simulator import simulate

    # Copy only, and hybrid (misses computed on the host, which reads the stored bytes too).
    variants = [(p, "copy") for p in args.sim_policies]
    if args.sim_host:
        variants += [(p, "hybrid") for p in args.sim_policies]
    rows = []
    for name in args.sim_models:
        w = h.load_workload(name, args)
        bf16_bytes = w.preset.expert_bytes
        budget_bytes = int(args.budget * w.total_experts * bf16_bytes)
        warmup = h.batches(w.store[: args.warmup], 1)
        measured = h.batches(w.eval, 1)
        for hw in args.hardware:
            for kind in ("bf16", *KINDS):
                preset = (
                    w.preset if kind == "bf16" else dataclasses.replace(w.preset, expert_quantization=kind)
                )
                for policy, execution in variants:
                    variant = h.Variant(policy, policy, execution=execution)
                    offload = h.offload_config(w, variant, calls=[*warmup, *measured], simulated=True)
                    offload = dataclasses.replace(offload, cache_experts=None, cache_bytes=budget_bytes)
                    label = policy if execution == "copy" else f"{policy}+hybrid"
                    print(f"[{w.name}] simulated {label}, {kind} experts, on {hw}", flush=True)
                    result = simulate(
                        [h.batch_trace(b) for b in measured],
                        offload,
                        model=preset,
                        hardware=HARDWARE[hw],
                        host=HOSTS[args.sim_host] if execution == "hybrid" else None,
                        router_weights=w.router_weights,
                        warmup=[h.batch_trace(b) for b in warmup],
                    )
                    rows.append(
                        dict(
                            model=w.name,
                            sizes=w.sizes(preset),
                            hardware=hw,
                            host=args.sim_host if execution == "hybrid" else None,
                            precision=kind,
                            policy=label,
                            slots=result.capacity,
                            expert_mb=result.expert_bytes / 2**20,
                            **h.sim_row(result),
                        )
                    )
        w.model.close()
    for r in rows:
        base = next(
            b
            for b in rows
            if (b["model"], b["hardware"], b["policy"], b["precision"])
            == (r["model"], r["hardware"], r["policy"], "bf16")
        )
        r["tpot_vs_bf16"] = r["median_tpot_s"] / base["median_tpot_s"]
    return rows


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------


def tables(payload: dict) -> dict[str, list[dict]]:
    out = {}
    if payload.get("bytes"):
        out["Bytes per routed expert (values + scales) over bfloat16"] = payload["bytes"]
    for name, result in (payload.get("quality") or {}).items():
        out[f"{name}: held-out NLL and greedy agreement with bfloat16"] = [
            dict(
                setting=s,
                bytes_per_expert=r["expert_bytes"],
                mean_nll=r["mean_nll"],
                nll_increase_pct=100 * r["nll_increase"],
                worst_domain_pct=100 * r["worst_domain_increase"],
                greedy_agreement=r["agreement"],
                tokens_before_difference=r["prefix"],
                identical_generations=r["identical"],
            )
            for s, r in result.items()
        ]
        domains = list(next(iter(result.values()))["nll"])
        out[f"{name}: held-out NLL per domain (nats/token)"] = [
            dict(setting=s, **{d: r["nll"][d] for d in domains}) for s, r in result.items()
        ]
    if payload.get("kernel"):
        out["Expert kernel (expert_parts) at bench-s shapes on this CPU"] = payload["kernel"]
    if payload.get("sim"):
        out["Simulated decoding, cache = 25 % of the bfloat16 experts' bytes, copy only and hybrid"] = (
            payload["sim"]
        )
    return out


def notes(payload: dict) -> list[str]:
    out = []
    for name, result in (payload.get("quality") or {}).items():
        for s, r in result.items():
            if s != "bf16":
                out.append(
                    f"{name} {s}: mean NLL {100 * r['nll_increase']:+.3f} % against bfloat16, greedy tokens "
                    f"{100 * r['agreement']:.0f} % equal"
                )
    sim = payload.get("sim") or []
    for r in sim:
        if r["precision"] == "int4" and r["policy"] in ("fmoe", "fmoe+hybrid"):
            out.append(
                f"{r['model']} at {r['sizes']} on {r['hardware']}: int4 {r['policy']} TPOT "
                f"{r['tpot_vs_bf16']:.2f}x bf16 {r['policy']}'s (target for fmoe: <= 0.35x)"
            )
    return out


def plot(payload: dict, path: Path) -> None:
    """Four panels from the saved JSON: bytes, NLL increase, kernel time ratio, simulated TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.4))
    ax = axes[0]
    rows = payload.get("bytes") or []
    if rows:  # the ratio depends only on the setting (scales in bfloat16): one bar each
        row = rows[0]  # a real model's: every group size divides it
        keys = [k for k in row if k.startswith("int")]
        bars = ax.bar(
            keys,
            [row[k] for k in keys],
            color=["#1f77b4" if k.startswith("int8") else "#d62728" for k in keys],
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    for target in (0.52, 0.28):
        ax.axhline(target, ls=":", color="grey")
    ax.set(title="bytes per expert over bfloat16 (targets dotted)", ylabel="ratio")
    ax = axes[1]
    for name, result in (payload.get("quality") or {}).items():
        keys = [s for s in result if s != "bf16"]
        ax.plot(keys, [100 * result[s]["nll_increase"] for s in keys], marker="o", label=name)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    ax.set(title="held-out NLL increase over bfloat16 (all domains)", ylabel="%")
    ax.legend(fontsize=7)
    ax = axes[2]
    kernel = payload.get("kernel") or []
    for n in sorted({r["tokens"] for r in kernel}):
        rows = [r for r in kernel if r["tokens"] == n]
        ax.plot([r["precision"] for r in rows], [r["ratio"] for r in rows], marker="o", label=f"{n} token(s)")
    ax.set(
        title=f"live ({payload['machine']['backend']}): expert kernel time over bfloat16, bench-s",
        ylabel="ratio",
    )
    ax.legend(fontsize=7)
    ax = axes[3]
    sim = payload.get("sim") or []
    policies = list(dict.fromkeys(r["policy"] for r in sim))
    precisions = list(dict.fromkeys(r["precision"] for r in sim))
    colour = h.colours(policies)
    for i, policy in enumerate(policies):
        values = [
            1e3 * next(r["median_tpot_s"] for r in sim if (r["policy"], r["precision"]) == (policy, p))
            for p in precisions
        ]
        width = 0.8 / len(policies)
        offset = (i - (len(policies) - 1) / 2) * width
        ax.bar(np.arange(len(precisions)) + offset, values, width, color=colour[policy], label=policy)
    if sim:
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set(
            title=f"{h.mode_title(sim[0]['hardware'])}\n{sim[0]['sizes']}, cache 25 % of bf16 bytes"
            + "".join(sorted({f"; hybrid: {r['host']} host" for r in sim if r.get("host")})),
            ylabel="median TPOT (ms)",
        )
        ax.legend(fontsize=7)
    fig.suptitle("Quantized experts", fontsize=11)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser, model=["fmoe-tiny-mixtral"], hardware=["rtx_3090"], live_requests=0)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure")
    parser.add_argument(
        "--group-sizes", type=int, nargs="+", default=[16, 32, 64, 128], help="inputs per scale"
    )
    parser.add_argument("--max-windows", type=int, default=None, help="held-out windows per domain (all)")
    parser.add_argument("--greedy-prompts", type=int, default=2, help="held-out prompts per domain")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--kernel-tokens", type=int, nargs="+", default=[1, 8], help="tokens per kernel call")
    parser.add_argument("--kernel-repeats", type=int, default=60, help="timed calls per variant")
    parser.add_argument("--sim-policies", nargs="+", default=["on_demand_lru", "fmoe"], help="simulated")
    parser.add_argument(
        "--sim-host",
        default="desktop_ddr4",
        help="host CPU preset of the hybrid variants (offload/cost_model.py HOSTS; '' for copy only)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="about 15 minutes on a 2-core CPU: the first 16 held-out windows of each domain (about a "
        "quarter of the held-out tokens), one greedy prompt per domain, group sizes 16 64 128, 20 kernel "
        "repeats, 48 prompts for the simulated traces",
    )
    args = parser.parse_args(argv)
    args.sim_models = args.model
    if args.quick:
        args.max_windows, args.greedy_prompts, args.kernel_repeats = 16, 1, 20
        args.group_sizes, args.n_prompts = [16, 64, 128], 48

    try:
        payload = {k: v for k, v in h.saved(NAME, args.out).items() if k in PARTS}
    except FileNotFoundError:
        payload = {}
    runners = dict(bytes=bytes_part, quality=quality_part, kernel=kernel_part, sim=sim_part)
    for part in args.parts:
        start = time.monotonic()
        payload[part] = runners[part](args)
        print(f"{part}: {time.monotonic() - start:.0f} s", flush=True)
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    h.write_results(NAME, "Quantized experts", payload, tables(payload), notes(payload), args.out)
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
