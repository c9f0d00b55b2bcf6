"""Resident decode speed on "bench-s": fmoe_jax vs transformers eager vs the memory-bandwidth floor.

    python -m benchmarks.decode_speed [--checkpoint DIR] [--prompt-len 128] [--new-tokens 64]

bench-s is a random Mixtral-shaped model (vocab 32000, hidden 1024, intermediate 3584, 8 layers, 8 experts
top-2, 16 heads, 4 KV heads, float32), written to /tmp/fmoe-bench on first use. The floor is the bytes of
weights one decode token reads divided by the best read bandwidth measured during the run. The systems
take turns round by round (with a bandwidth sample per round), because this shared machine's bandwidth
drifts with its neighbours' load. TPOT/TTFT ratios are of medians over all rounds; the floor ratio is the
median over rounds of (round's TPOT / round's floor); every per-round ratio is in the JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, read_bandwidth_gbs, save, saved


def bytes_per_token(cfg, dtype_bytes: int, context: int) -> int:
    """Weight (and KV cache) bytes one decode step reads: attention, norms, router, top-k experts, head."""
    d, e = cfg.hidden_size, cfg.head_dim
    attn = d * cfg.num_heads * e * 2 + d * cfg.num_kv_heads * e * 2
    expert = 3 * d * cfg.expert_intermediate_size
    per_layer = attn + 2 * d + d * cfg.num_experts + cfg.top_k * expert
    kv = 2 * context * cfg.num_kv_heads * e
    return (cfg.num_layers * (per_layer + kv) + d * cfg.vocab_size + d + d) * dtype_bytes


def fmoe_runner(path: Path, prompt: list[int], new_tokens: int):
    """Loads and warms fmoe_jax; returns `once() -> (ttft_s, decode step times)` and the config."""
    import fmoe_jax as fj

    model = fj.load_model(path)
    fj.generate(model, [prompt], max_new_tokens=new_tokens, stop_at_eos=False)  # compile

    def once():
        stats = fj.generate(model, [prompt], max_new_tokens=new_tokens, stop_at_eos=False).stats
        return stats.ttft_s, list(stats.decode_step_s)

    once.compilations = model.engine.programs.compilations  # the model's own compilation counts
    return once, model.config


def transformers_runner(path: Path, prompt: list[int], new_tokens: int):
    """Loads and warms transformers eager on the same weights; returns `once()` like `fmoe_runner`."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([prompt])

    def once():
        with torch.no_grad():
            start = time.perf_counter()
            out = model(ids, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            ttft = time.perf_counter() - start
            cache, steps = out.past_key_values, []
            for _ in range(new_tokens - 1):
                start = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - start)
                cache = out.past_key_values
        return ttft, steps

    once()
    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="HF directory (default: bench-s in /tmp/fmoe-bench)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every system once")
    parser.add_argument(
        "--skip-transformers", action="store_true", help="do not time transformers (torch) for comparison"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory for the JSON, PNG and markdown results"
    )
    args = parser.parse_args()

    from fmoe_jax.testing import ensure_checkpoint

    path = args.checkpoint or ensure_checkpoint("bench-s")
    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    runners = {"fmoe_jax resident": fmoe_runner(path, prompt, args.new_tokens)}
    cfg = runners["fmoe_jax resident"][1]
    runners["fmoe_jax resident"] = runners["fmoe_jax resident"][0]
    if not args.skip_transformers:
        runners["transformers eager"] = transformers_runner(path, prompt, args.new_tokens)
    compiled = runners["fmoe_jax resident"].compilations
    traces_before = sum(compiled.values())
    # This machine's memory bandwidth varies with its neighbours' load, so the systems take turns, round
    # by round, with a bandwidth sample per round: every ratio compares measurements of the same minutes.
    ttft = {name: [] for name in runners}
    steps = {name: [] for name in runners}
    per_round = {name: [] for name in runners}
    bandwidths = []
    for _ in tqdm(range(args.repeats), desc="rounds", unit="round"):
        bandwidths.append(read_bandwidth_gbs())
        for name, once in runners.items():
            t, s = once()
            ttft[name].append(t * 1e3)
            steps[name].extend(x * 1e3 for x in s)
            per_round[name].append(float(np.median(s) * 1e3))
    measured = {
        name: dict(
            ttft_ms=float(np.median(ttft[name])),
            tpot_ms=float(np.median(steps[name])),
            tpot_mean_ms=float(np.mean(steps[name])),
        )
        for name in runners
    }
    ours = measured["fmoe_jax resident"]
    ours["recompilations"] = sum(compiled.values()) - traces_before
    hf = measured.get("transformers eager")
    bandwidth = {key: max(b[key] for b in bandwidths) for key in bandwidths[0]}
    context = args.prompt_len + args.new_tokens // 2
    touched = bytes_per_token(cfg, 4, context)
    floor_ms = touched / (bandwidth["best"] * 1e6)  # with the best bandwidth seen (the table's row)
    rows = [dict(system=name, **m) for name, m in measured.items()]
    rows.append(dict(system="bandwidth floor", ttft_ms="", tpot_ms=floor_ms))
    print(
        f"\nbench-s, prompt {args.prompt_len}, {args.new_tokens} new tokens, batch 1; "
        f"{touched / 1e6:.0f} MB read per token; read bandwidth {bandwidth['best']:.1f} GB/s"
    )
    print_table(rows, ["system", "ttft_ms", "tpot_ms", "tpot_mean_ms", "recompilations"])
    ratios = dict(tpot_vs_floor=ours["tpot_ms"] / floor_ms)
    spread = {}
    if hf:
        ratios.update(
            tpot_vs_transformers=ours["tpot_ms"] / hf["tpot_ms"],
            ttft_vs_transformers=ours["ttft_ms"] / hf["ttft_ms"],
        )
        name, other = "fmoe_jax resident", "transformers eager"
        spread = dict(
            tpot_vs_transformers=[a / b for a, b in zip(per_round[name], per_round[other], strict=True)],
            ttft_vs_transformers=[a / b for a, b in zip(ttft[name], ttft[other], strict=True)],
        )
    spread["tpot_vs_floor"] = [
        t / (touched / (b["best"] * 1e6))
        for t, b in zip(per_round["fmoe_jax resident"], bandwidths, strict=True)
    ]
    # The floor moves with the bandwidth: its ratio is taken round by round (same minutes), then the median.
    ratios["tpot_vs_floor"] = float(np.median(spread["tpot_vs_floor"]))
    print("ratios:", {k: round(v, 3) for k, v in ratios.items()})
    print("per round:", {k: [round(v, 3) for v in vs] for k, vs in spread.items()})
    print("targets: tpot_vs_transformers <= 0.8, tpot_vs_floor <= 1.3, ttft_vs_transformers <= 1.0")
    save(
        "decode_speed",
        dict(
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            bytes_per_token=touched,
            bandwidth_gbs=bandwidth,
            bandwidth_per_round_gbs=[b["best"] for b in bandwidths],
            repeats=args.repeats,
            ratios_per_round=spread,
            fmoe=ours,
            transformers=hf,
            floor_ms=floor_ms,
            ratios=ratios,
        ),
        args.out,
    )
    plot(saved("decode_speed", args.out), args.out / "decode_speed.png")


def plot(payload: dict, path: Path) -> None:
    """The figure from the saved results."""
    ours, hf = payload["fmoe"], payload["transformers"]
    groups = {
        "TPOT (ms)": {"fmoe_jax": ours["tpot_ms"], "floor": payload["floor_ms"]},
        "TTFT (ms)": {"fmoe_jax": ours["ttft_ms"]},
    }
    if hf:
        groups["TPOT (ms)"]["transformers"] = hf["tpot_ms"]
        groups["TTFT (ms)"]["transformers"] = hf["ttft_ms"]
    title = "bench-s resident decode, batch 1"
    bar_plot(path, title, groups, "ms", backend=payload["machine"]["backend"])


if __name__ == "__main__":
    main()
