"""`make demo` / `fmoe-demo`: serve a shipped trained MoE with experts offloaded at a 25 % cache budget.

Converts the shipped checkpoint with `fmoe-convert`, warms the fMoE expert-map store on a few prompts,
then answers held-out prompts from several domains with `fmoe` and with `on_demand_lru`, printing the
texts, a table of TTFT / TPOT / expert hit rate, and writing a plot. Without a shipped model it falls back
to a small random Mixtral-shaped checkpoint (the texts are then noise, the statistics still real).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

FALLBACK_PROMPTS = {
    "books": "It was late in the evening when the old man finally",
    "web": "The best way to keep your garden healthy during the summer is",
    "code": "def fibonacci(n):\n    ",
    "arxiv": "In this paper we propose a new method for",
    "wikipedia_de": "Die Stadt liegt am Ufer des",
    "shakespeare": "KING HENRY:\nWhat say you, lords, to",
}


def domain_prompts(data_dir: Path | None, per_domain: int, seed: int) -> list[tuple[str, str]]:
    """(domain, prompt) pairs from the held-out corpora when `data_dir` has them, else built-in prompts."""
    if data_dir is not None and (data_dir / "corpora").is_dir():
        from fmoe_jax.research.workloads import domain_prompts as held_out

        prompts = held_out(data_dir / "corpora", per_domain, min_chars=120, max_chars=240, seed=seed)
        return [(p.category, p.text) for p in prompts]
    return [(domain, text) for domain, text in FALLBACK_PROMPTS.items()]


def prepare_checkpoint(model: str, workdir: Path) -> Path:
    """Converts the shipped model (or writes a random one) and returns a directory `load_model` reads."""
    from fmoe_jax.loading import shipped_models

    if model in shipped_models():
        from fmoe_jax.convert.cli import main as convert
        from fmoe_jax.loading import SHIPPED_DIR

        out = workdir / f"{model}-converted"
        if not out.exists():
            print(f"converting {model} with fmoe-convert -> {out}")
            if convert([str(SHIPPED_DIR / model), str(out), "--quiet"]) != 0:
                raise SystemExit("conversion failed")
        return out
    from fmoe_jax.testing import PRESETS, write_random_checkpoint

    print(f"no shipped model named {model!r}: using a random tiny Mixtral (texts will be noise)")
    return write_random_checkpoint(workdir / "random-tiny-mixtral", PRESETS["tiny-mixtral"])


def run_policy(
    path: Path,
    policy: str,
    budget: float,
    warmup: list[str] | list[list[int]],
    prompts: list,
    new_tokens: int,
):
    import fmoe_jax as fj
    from fmoe_jax.offload.config import OffloadConfig

    probe = fj.load_model(path)
    cfg = probe.config
    slots = max(1, round(budget * cfg.num_moe_layers * cfg.num_experts))
    offload = OffloadConfig(policy=policy, cache_experts=slots, prefetch_distance=1)
    with fj.load_model(path, offload=offload) as model:
        for prompt in warmup:  # fills the fMoE store (online learning) and compiles; not measured
            fj.generate(model, [prompt], max_new_tokens=new_tokens)
        outputs = [fj.generate(model, [p], max_new_tokens=new_tokens) for p in prompts]
    return slots, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="fmoe-tiny-mixtral", help="shipped model name (default: %(default)s)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("../shared/data"),
        help="data directory with corpora/ for held-out prompts (default: %(default)s)",
    )
    parser.add_argument("--budget", type=float, default=0.25, help="expert cache budget, fraction of experts")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--per-domain", type=int, default=2, help="prompts per domain (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="where the plot goes")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fmoe-demo")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    args.workdir.mkdir(parents=True, exist_ok=True)
    path = prepare_checkpoint(args.model, args.workdir)
    pairs = domain_prompts(args.data, args.per_domain + 1, seed=0)
    by_domain: dict[str, list[str]] = {}
    for domain, text in pairs:
        by_domain.setdefault(domain, []).append(text)
    warmup = [texts[0] for texts in by_domain.values() if len(texts) > 1]  # store-building prompts
    evaluation = [(d, t) for d, texts in by_domain.items() for t in (texts[1:] if len(texts) > 1 else texts)]

    import fmoe_jax as fj

    if fj.load_model(path).tokenizer is None:  # the random fallback has no tokenizer
        rng = np.random.default_rng(0)
        warmup = [rng.integers(3, 500, 24).tolist() for _ in warmup]
        prompts = [rng.integers(3, 500, 24).tolist() for _ in evaluation]
    else:
        prompts = [text for _, text in evaluation]

    results = {}
    for policy in ("fmoe", "on_demand_lru"):
        print(f"serving {len(prompts)} prompts with {policy} ...")
        slots, outputs = run_policy(path, policy, args.budget, warmup, prompts, args.new_tokens)
        results[policy] = (slots, outputs)

    slots, fmoe_outputs = results["fmoe"]
    print(f"\n=== answers (fmoe, {slots} expert slots = {args.budget:.0%} of the experts) ===")
    for (domain, text), out in zip(evaluation, fmoe_outputs, strict=True):
        shown_prompt = text if isinstance(text, str) else f"<{len(text)} random tokens>"
        answer = out.texts[0] if out.texts else str(out.tokens[0])
        print(f"\n[{domain}] {shown_prompt.strip()[-160:]!r}\n  -> {answer!r}")

    rows = []
    for policy, (_, outputs) in results.items():
        hits = sum(o.stats.hits for o in outputs)
        misses = sum(o.stats.misses for o in outputs)
        rows.append(
            dict(
                policy=policy,
                ttft_ms=1e3 * np.median([o.stats.ttft_s for o in outputs]),
                tpot_ms=1e3 * np.median([s for o in outputs for s in o.stats.decode_step_s]),
                hit_rate=hits / max(1, hits + misses),
                mb_to_device=sum(o.stats.bytes_to_device for o in outputs) / 1e6,
            )
        )
    print("\n=== statistics (medians over prompts; hit rate over all expert uses) ===")
    print(f"{'policy':<15}{'TTFT ms':>10}{'TPOT ms':>10}{'hit rate':>10}{'MB to device':>14}")
    for r in rows:
        print(
            f"{r['policy']:<15}{r['ttft_ms']:>10.1f}{r['tpot_ms']:>10.2f}{r['hit_rate']:>10.3f}"
            f"{r['mb_to_device']:>14.1f}"
        )
    plot(args.out / "demo.png", results, args.budget)
    return 0


def plot(path: Path, results: dict, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy, (_, outputs) in results.items():
        per_layer = np.mean([o.stats.layer_hit_rate for o in outputs], axis=0)
        left.plot(range(len(per_layer)), per_layer, marker="o", label=policy)
    left.set_xlabel("MoE layer")
    left.set_ylabel("expert hit rate")
    left.set_ylim(0, 1.05)
    left.legend()
    left.set_title(f"hit rate per layer, cache = {budget:.0%} of experts")
    names = list(results)
    tpot = [1e3 * np.median([s for o in results[n][1] for s in o.stats.decode_step_s]) for n in names]
    bars = right.bar(names, tpot, color=["#3b6ea5", "#c0504d"])
    right.bar_label(bars, fmt="%.1f")
    right.set_ylabel("TPOT (ms, median)")
    right.set_title("time per output token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
