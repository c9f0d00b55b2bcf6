"""Prefill of a hybrid model (Qwen3-Next: Gated DeltaNet in 3 of 4 layers) against a same-size Qwen3-MoE.

    .venv/bin/python -m benchmarks.linear_prefill [--prompt-lens 128 512 1024] [--repeats 7]

Two tiny random models of the same sizes (hidden, layers, heads, experts, top-k, expert width; no shared
expert in either), float32, resident: `qwen3_next`, whose linear layers prefill by the chunked delta rule (a
`lax.scan` over chunks of 64 tokens, no per-token Python loop), and `qwen3_moe`, all softmax attention. Each
prefill is one `engine.step` of a `[1, T]` prompt (T from `--prompt-lens`), timed after its compilation (wall
time, and this process's CPU time, which a machine shared with other jobs disturbs less); the two models take
turns repeat by repeat and the ratios are of medians from the same run. A decode step after each prompt is
timed alike. Writes `linear_prefill.{json,png}` to --out.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, bar_plot, print_table, save, saved
from benchmarks.harness import command_line

NAME = "linear_prefill"
# Sizes shared by both models; the hybrid's linear layers have 4 key heads, 8 value heads of 64 dimensions.
SIZES = dict(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    max_position_embeddings=4096,
)
HYBRID = dict(
    SIZES,
    model_type="qwen3_next",
    shared_expert_intermediate_size=0,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)
SOFTMAX = dict(SIZES, model_type="qwen3_moe", norm_topk_prob=True)


def make_model(hf: dict):
    """A resident `Model` of random weights for an HF config dict."""
    from fmoe_jax.models import build_model, config_from_hf

    import fmoe_jax as fj
    from fmoe_jax.loading import from_module

    return from_module(build_model(config_from_hf(hf))), fj


def runner(model, fj, prompt_len: int, context: int):
    """`prefill()` and `decode()` closures timing one engine step each (results blocked on)."""
    import jax
    import jax.numpy as jnp
    from fmoe_jax.models import Layout

    engine = model.engine
    tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, (1, prompt_len)).astype(np.int32)
    key = jax.random.key(0)
    starts = np.zeros((1,), np.int32)

    def prefill():
        cache = engine.init_cache(1, context)
        layout = Layout(np.int32(0), starts, np.ones((1,), bool), prompt_len)
        start, cpu = time.perf_counter(), time.process_time()
        out, cache = engine.step(tokens, cache, layout, key, fj.Greedy())
        jax.block_until_ready(out.logits)
        return (time.perf_counter() - start, time.process_time() - cpu), cache

    def decode(cache):
        layout = Layout(np.int32(prompt_len), starts, np.ones((1,), bool), 1)
        start = time.perf_counter()
        out, _ = engine.step(jnp.asarray(tokens[:, :1]), cache, layout, key, fj.Greedy())
        jax.block_until_ready(out.logits)
        return time.perf_counter() - start

    return prefill, decode


def measure(prompt_lens: list[int], repeats: int) -> list[dict]:
    models = {"qwen3_next (hybrid)": make_model(HYBRID), "qwen3_moe (softmax)": make_model(SOFTMAX)}
    rows = []
    for t in prompt_lens:
        context = t + 64
        runners = {name: runner(m, fj, t, context) for name, (m, fj) in models.items()}
        for prefill, decode in runners.values():  # compile both programs, and run each once more
            for _ in range(2):
                decode(prefill()[1])
        compiled = {name: dict(m.engine.programs.compilations) for name, (m, _) in models.items()}
        kinds = ("prefill", "prefill_cpu", "decode")
        times: dict[str, dict[str, list[float]]] = {name: {k: [] for k in kinds} for name in models}
        for r in range(repeats):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                prefill, decode = runners[name]
                (seconds, cpu_seconds), cache = prefill()
                times[name]["prefill"].append(seconds)
                times[name]["prefill_cpu"].append(cpu_seconds)
                times[name]["decode"].append(decode(cache))
        for name, (m, _) in models.items():
            assert dict(m.engine.programs.compilations) == compiled[name], "compiled while timing"
        medians = {name: {k: float(np.median(v)) for k, v in ts.items()} for name, ts in times.items()}
        hybrid, softmax = (medians[name] for name in models)
        rows.append(
            dict(
                prompt_tokens=t,
                hybrid_prefill_ms=1e3 * hybrid["prefill"],
                softmax_prefill_ms=1e3 * softmax["prefill"],
                prefill_ratio=hybrid["prefill"] / softmax["prefill"],
                prefill_cpu_ratio=hybrid["prefill_cpu"] / softmax["prefill_cpu"],
                hybrid_decode_ms=1e3 * hybrid["decode"],
                softmax_decode_ms=1e3 * softmax["decode"],
                decode_ratio=hybrid["decode"] / softmax["decode"],
                repeats=repeats,
                times_s=times,
            )
        )
        print_table([{k: v for k, v in rows[-1].items() if k != "times_s"}])
    return rows


def plot(payload: dict, path) -> None:
    groups = {
        f"prefill, {r['prompt_tokens']} tokens": {
            "qwen3_next (hybrid)": r["hybrid_prefill_ms"],
            "qwen3_moe (softmax)": r["softmax_prefill_ms"],
        }
        for r in payload["rows"]
    }
    title = "prefill of one prompt, same-size tiny models"
    bar_plot(path, title, groups, "median ms", payload["machine"]["backend"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=7, help="timed prefills per model and length")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = measure(args.prompt_lens, args.repeats)
    print_table([{k: v for k, v in r.items() if k != "times_s"} for r in rows])
    payload = {
        "command": command_line(),
        "models": {"hybrid": HYBRID, "softmax": SOFTMAX},
        "rows": rows,
        "notes": [
            "float32, resident, batch 1; both models random, of the same sizes; the hybrid's 6 of 8 layers "
            "are Gated DeltaNet (chunked prefill, 64-token chunks), 2 gated softmax attention",
        ],
    }
    save(NAME, payload, args.out)
    plot(saved(NAME, args.out), f"{args.out}/{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
