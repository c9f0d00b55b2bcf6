"""Did the shipped tiny MoE models learn, and is their routing structured? Writes TRAINED_MODELS.md.

    python -m benchmarks.routing_analysis [--corpora ../shared/data/corpora] [--out benchmarks/results]

For each shipped model (and, as a control, the same architecture with random weights): held-out loss per
domain against a unigram baseline, sample generations, per-layer expert usage per domain, Jensen-Shannon
divergence between domains per layer, and fine (per-iteration) vs coarse (per-request) routing entropy per
layer, as in figure 3 of the fMoE paper. Prints tables, writes `trained_models.json` and PNGs into --out and
regenerates the markdown report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from fmoe_jax.models import build_model
from fmoe_jax.research import train, workloads

import fmoe_jax as fj

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import HelpFormatter, print_table, save, save_png  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("fmoe-tiny-mixtral", "fmoe-tiny-qwen-moe", "fmoe-tiny-qwen3-moe")
DOMAINS = tuple(workloads.CORPUS_DOMAINS)


# ---------------------------------------------------------------------------------------------------------
# Measures (entropies and divergences in bits)
# ---------------------------------------------------------------------------------------------------------


def entropy_bits(p: np.ndarray) -> np.ndarray:
    """Shannon entropy over the last axis of (possibly unnormalised) non-negative weights."""
    p = p / p.sum(axis=-1, keepdims=True)
    return -np.sum(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def js_divergence_bits(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence over the last axis, in [0, 1] bits."""
    p = p / p.sum(axis=-1, keepdims=True)
    q = q / q.sum(axis=-1, keepdims=True)
    return entropy_bits((p + q) / 2) - (entropy_bits(p) + entropy_bits(q)) / 2


def routing_stats(traces: dict[str, fj.RoutingTrace], num_experts: int) -> dict[str, Any]:
    """Expert usage per domain, JS divergence between domains, and fine vs coarse entropy per layer.

    Usage counts every top-k pick of every token (prompt and generated). Fine-grained entropy is that of
    one decode iteration's router distribution (one token), averaged over iterations and requests; coarse
    is that of the request's aggregate (mean router distribution over all its tokens), as MoE-Infinity's
    request-level activation matrix sees it; `coarse_counts` uses the aggregate of top-k picks instead.
    `through_iterations[t]` is the entropy of the aggregate over the first t+1 decode iterations.
    """
    usage = {}
    fine, coarse, coarse_counts, through = [], [], [], []
    for domain, trace in traces.items():
        counts = 0.0
        for request in trace.requests:
            ids = np.concatenate([it.ids for it in request.iterations])  # [n, L, k]
            probs = np.concatenate([it.probs for it in request.iterations])  # [n, L, J]
            picks = np.stack(
                [np.bincount(ids[:, i].ravel(), minlength=num_experts) for i in range(ids.shape[1])]
            )
            counts = counts + picks
            decode = np.stack([it.probs[0] for it in request.iterations[1:]])  # [t, L, J]
            fine.append(entropy_bits(decode).mean(axis=0))
            coarse.append(entropy_bits(probs.mean(axis=0)))
            coarse_counts.append(entropy_bits(picks.astype(np.float64)))
            running = np.cumsum(decode, axis=0) / np.arange(1, len(decode) + 1)[:, None, None]
            through.append(entropy_bits(running).mean(axis=1))  # [t]
        usage[domain] = counts / counts.sum(axis=1, keepdims=True)  # [L, J]
    pairs = list(itertools.combinations(traces, 2))
    js = np.stack([js_divergence_bits(usage[a], usage[b]) for a, b in pairs], axis=1)  # [L, pairs]
    matrix = np.zeros((len(traces), len(traces)))
    names = list(traces)
    for (a, b), value in zip(pairs, js.mean(axis=0), strict=True):
        matrix[names.index(a), names.index(b)] = matrix[names.index(b), names.index(a)] = value
    n_iter = min(len(t) for t in through)
    return dict(
        usage={d: u.tolist() for d, u in usage.items()},
        js_per_layer_mean=js.mean(axis=1).tolist(),
        js_per_layer_max=js.max(axis=1).tolist(),
        js_max_pair_per_layer=[" / ".join(pairs[i]) for i in js.argmax(axis=1)],
        js_domain_matrix=matrix.tolist(),
        fine_entropy=np.mean(fine, axis=0).tolist(),
        coarse_entropy=np.mean(coarse, axis=0).tolist(),
        coarse_count_entropy=np.mean(coarse_counts, axis=0).tolist(),
        through_iterations=np.mean([t[:n_iter] for t in through], axis=0).tolist(),
        max_entropy=float(np.log2(num_experts)),
        top2_share_last_layer={d: float(np.sort(u[-1])[-2:].sum()) for d, u in usage.items()},
    )


# ---------------------------------------------------------------------------------------------------------
# Running the models
# ---------------------------------------------------------------------------------------------------------


def traces_by_domain(model: fj.Model, prompts: list[workloads.Prompt], new_tokens: int) -> dict[str, Any]:
    """Routing traces of greedy generation, split by domain. One batch: one prefill and one decode compile."""
    trace = fj.generate(
        model, [p.text for p in prompts], new_tokens, stop_at_eos=False, record_trace=True
    ).trace
    return {
        domain: fj.RoutingTrace(
            trace.meta, [r for p, r in zip(prompts, trace.requests, strict=True) if p.category == domain]
        )
        for domain in DOMAINS
    }


def log(what: str, since: float) -> None:
    print(f"  {what} done at {time.monotonic() - since:.0f} s", file=sys.stderr, flush=True)


def analyse(name: str, args, prompts, sample_prompts, train_ids) -> dict[str, Any]:
    t0 = time.monotonic()
    model = fj.load_model(name, dtype="float32")
    tokenizer = model.tokenizer
    directory = fj.loading.resolve(name)
    record = json.loads((directory / "fmoe_training.json").read_text())
    # The blocked kernel computes the same mixture as the default one, faster for 2,048-token batches on CPU.
    scorer = fj.from_module(model.module, tokenizer=tokenizer, kernel="blocked")
    held = train.held_out_nll(
        lambda t: fj.forward(scorer, t), tokenizer, workloads.load_corpora(args.corpora, "held_out")
    )
    log(f"{name}: held-out loss", t0)
    held_out = {
        d: dict(
            tokens=r["tokens"],
            nll=r["nll"],
            unigram_nll=train.unigram_nll(train_ids, r["targets"], len(tokenizer)),
        )
        for d, r in held.items()
    }
    all_targets = np.concatenate([r["targets"] for r in held.values()])
    overall = dict(
        tokens=int(all_targets.size),
        nll=float(sum(r["nll"] * r["tokens"] for r in held_out.values()) / all_targets.size),
        unigram_nll=train.unigram_nll(train_ids, all_targets, len(tokenizer)),
    )
    texts = [p.text for p in sample_prompts]
    greedy = fj.generate(model, texts, args.sample_tokens, stop_at_eos=False).texts
    sampling = fj.Sample(0.8, top_p=0.95)
    sampled = fj.generate(model, texts, args.sample_tokens, sampling, seed=0, stop_at_eos=False).texts
    samples = {
        p.category: dict(prompt=p.text, greedy=g, sampled=x)
        for p, g, x in zip(sample_prompts, greedy, sampled, strict=True)
    }
    log(f"{name}: samples", t0)
    cfg = model.config
    trained = routing_stats(traces_by_domain(model, prompts, args.new_tokens), cfg.num_experts)
    log(f"{name}: routing traces", t0)
    random_model = fj.from_module(build_model(cfg, seed=0), tokenizer=tokenizer)
    untrained = routing_stats(traces_by_domain(random_model, prompts, args.new_tokens), cfg.num_experts)
    log(f"{name}: routing traces of the random-weight control", t0)
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    return dict(
        name=Path(name).name,
        config=dict(
            family=cfg.family,
            layers=cfg.num_layers,
            experts=cfg.num_experts,
            top_k=cfg.top_k,
            hidden=cfg.hidden_size,
            expert_size=cfg.expert_intermediate_size,
            shared_expert_size=cfg.shared_expert_intermediate_size,
            vocab=cfg.vocab_size,
        ),
        directory_bytes=size,
        training={k: v for k, v in record.items() if k not in ("held_out",)},
        held_out=held_out,
        held_out_overall=overall,
        samples=samples,
        routing=trained,
        routing_untrained=untrained,
        seconds=time.monotonic() - t0,
    )


# ---------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------


def plot_usage(result: dict, path: Path) -> None:
    usage = result["routing"]["usage"]
    fig, axes = plt.subplots(1, len(usage), figsize=(2.6 * len(usage) + 1, 3.2), sharey=True)
    vmax = max(np.max(u) for u in usage.values())
    for ax, (domain, u) in zip(axes, usage.items(), strict=True):
        image = ax.imshow(np.asarray(u), aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(domain, fontsize=9)
        ax.set_xlabel("expert")
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes, label="share of the layer's top-k picks", fraction=0.02)
    fig.suptitle(
        f"{result['name']}: expert usage per layer and domain (held-out prompts + 32 generated tokens)"
    )
    save_png(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_js(results: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 8.5), squeeze=False)
    for col, r in enumerate(results):
        ax = axes[0, col]
        layers = np.arange(len(r["routing"]["js_per_layer_mean"]))
        ax.plot(layers, r["routing"]["js_per_layer_mean"], "o-", label="trained: mean over domain pairs")
        ax.plot(layers, r["routing"]["js_per_layer_max"], "^--", label="trained: max over domain pairs")
        ax.plot(
            layers, r["routing_untrained"]["js_per_layer_mean"], "o-", color="grey", label="random init: mean"
        )
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("Jensen-Shannon divergence (bits)")
        ax.set_title(r["name"])
        ax.legend(fontsize=8)
        ax = axes[1, col]
        matrix = np.asarray(r["routing"]["js_domain_matrix"])
        image = ax.imshow(matrix, cmap="magma")
        ax.set_xticks(range(len(DOMAINS)), DOMAINS, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(DOMAINS)), DOMAINS, fontsize=8)
        for i, j in itertools.product(range(len(DOMAINS)), repeat=2):
            light = matrix[i, j] > 0.6 * matrix.max()
            ax.text(
                j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7, color="k" if light else "w"
            )
        ax.set_title("JS divergence between domains, mean over layers", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def plot_entropy(results: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(5 * (len(results) + 1), 3.8))
    for ax, r in zip(axes, results, strict=False):
        stats = r["routing"]
        layers = np.arange(len(stats["fine_entropy"]))
        ax.bar(layers - 0.2, stats["coarse_entropy"], 0.4, label="coarse (per request)", color="#c0504d")
        ax.bar(layers + 0.2, stats["fine_entropy"], 0.4, label="fine (per iteration)", color="#3b6ea5")
        ax.axhline(stats["max_entropy"], color="k", lw=0.8, ls=":", label="uniform over experts")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("entropy of expert distribution (bits)")
        ax.set_title(r["name"])
        ax.legend(fontsize=8, loc="lower right")
    ax = axes[-1]
    for r in results:
        curve = np.asarray(r["routing"]["through_iterations"])
        ax.plot(np.arange(1, len(curve) + 1), curve / r["routing"]["max_entropy"], label=r["name"])
    ax.set_xlabel("decode iterations aggregated")
    ax.set_ylabel("entropy / log2(experts)")
    ax.set_title("aggregating iterations raises entropy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def plot_loss(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for r in results:
        history = r["training"]["history"]
        tokens = (
            np.asarray([h["step"] for h in history]) * r["training"]["tokens_seen"] / r["training"]["steps"]
        )
        ax.plot(tokens / 1e6, [h["ce"] for h in history], label=f"{r['name']} (train)")
        ax.axhline(r["held_out_overall"]["nll"], ls="--", lw=0.8, color=ax.lines[-1].get_color())
    ax.axhline(
        results[0]["held_out_overall"]["unigram_nll"], color="grey", ls=":", label="unigram (held out)"
    )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training loss; dashed: held-out loss of the shipped bf16 model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def fmt_row(values) -> str:
    return "| " + " | ".join(values) + " |"


def nll_cell(nll: float) -> str:
    return f"{nll:.3f} ({np.exp(nll):.1f})"


def summary_rows(r: dict) -> list[str]:
    """The 'Models and training' column of one model."""
    c, t = r["config"], r["training"]
    p = {k: v / 1e6 for k, v in t["parameters"].items()}
    shared = f" + shared {c['shared_expert_size']}" if c["shared_expert_size"] else ""
    tc = t["train_config"]
    return [
        f"{c['family']}, {c['layers']} layers, hidden {c['hidden']}",
        f"{c['experts']}, top-{c['top_k']}, size {c['expert_size']}{shared}",
        f"{p['total']:.2f} M / {p['routed_experts']:.2f} M / {p['active']:.2f} M",
        f"{r['directory_bytes'] / 2**20:.1f} MiB",
        f"{t['steps']} x {tc['batch_size']} x {tc['seq_len']}",
        f"{t['tokens_seen'] / 1e6:.2f} M ({t['train_tokens'] / 1e6:.2f} M)",
        f"{t['train_seconds'] / 60:.1f} min, {t['tokens_per_second']:.0f} tokens/s",
        f"{t['final_train_ce']:.3f} / {t['final_train_aux']:.3f}",
        f"{r['held_out_overall']['nll']:.3f} ({r['held_out_overall']['unigram_nll']:.3f})",
    ]


SUMMARY_LABELS = (
    "architecture",
    "experts",
    "parameters (total / routed / active)",
    "checkpoint directory (bf16)",
    "steps x batch x sequence",
    "tokens seen (train split size)",
    "training time, throughput",
    "final train CE / aux loss",
    "held-out NLL (unigram)",
)


def per_layer(results: list[dict], cell) -> list[str]:
    """Table rows by MoE layer; `cell(result, layer)` gives one model's cell."""
    n_layers = max(len(r["routing"]["fine_entropy"]) for r in results)
    return [
        fmt_row([str(i), *(cell(r, i) if i < len(r["routing"]["fine_entropy"]) else "" for r in results)])
        for i in range(n_layers)
    ]


def js_cell(r: dict, i: int) -> str:
    s, control = r["routing"], r["routing_untrained"]
    pair = s["js_max_pair_per_layer"][i]
    return (
        f"{s['js_per_layer_mean'][i]:.3f} / {s['js_per_layer_max'][i]:.3f} ({pair}) / "
        f"{control['js_per_layer_mean'][i]:.3f}"
    )


def entropy_cell(r: dict, i: int) -> str:
    s = r["routing"]
    return f"{s['fine_entropy'][i]:.2f} / {s['coarse_entropy'][i]:.2f} / {s['coarse_count_entropy'][i]:.2f}"


def highlights(r: dict) -> str:
    """One bullet of numbers per model for the top of the report."""
    s, control, held = r["routing"], r["routing_untrained"], r["held_out_overall"]
    best = int(np.argmax(s["js_per_layer_max"]))
    js, js_random = np.mean(s["js_per_layer_mean"]), np.mean(control["js_per_layer_mean"])
    return (
        f"- **{r['name']}**: held-out NLL {held['nll']:.2f} nats/token (perplexity "
        f"{np.exp(held['nll']):.0f}) against {held['unigram_nll']:.2f} "
        f"({np.exp(held['unigram_nll']):.0f}) for the unigram baseline. JS divergence between domains, "
        f"mean over layers and pairs: {js:.3f} bits (random weights: {js_random:.3f}); "
        f"largest {s['js_per_layer_max'][best]:.2f} in layer {best} ({s['js_max_pair_per_layer'][best]}). "
        f"Routing entropy, mean over layers: fine {np.mean(s['fine_entropy']):.2f} bits vs coarse "
        f"{np.mean(s['coarse_entropy']):.2f} bits (uniform {s['max_entropy']:.2f})."
    )


def report(results: list[dict], args) -> str:
    names = [r["name"] for r in results]
    columns = [summary_rows(r) for r in results]
    first = results[0]
    lines = [
        "# Trained tiny MoE models: did they learn, and is their routing structured?",
        "",
        "Generated by `python -m benchmarks.routing_analysis` (do not edit by hand) from the shipped",
        "checkpoints in `fmoe_jax/shipped/`, loaded in float32. Training: `benchmarks/train_tiny_moe.py`",
        "(`research/train.py`); each model's `README.md` is its model card. Data: the six corpora of",
        "`fmoe_jax.research.workloads.CORPUS_DOMAINS`: train split for training, held-out split for all",
        "that follows.",
        "",
        "## Summary",
        "",
        *(highlights(r) for r in results),
        "",
        "## Models and training",
        "",
        fmt_row(["", *names]),
        fmt_row(["---"] + ["---:"] * len(results)),
        *(fmt_row([label, *(c[i] for c in columns)]) for i, label in enumerate(SUMMARY_LABELS)),
        "",
        "Throughput is wall time on the shared 2-core CPU (other jobs ran beside training), compilation",
        "included. The aux loss is `transformers`' load-balancing loss; it equals top-k when routing is",
        "perfectly balanced over a batch.",
        "",
        "![training loss](results/trained_loss.png)",
        "",
        "## Held-out loss per domain (nats per token, perplexity in brackets)",
        "",
        "The models read `<s>` + 255-token windows of each domain's held-out text; the unigram baseline is",
        "the cross-entropy of the same tokens under add-one smoothed unigram frequencies of the train split.",
        "",
        fmt_row(["domain", "tokens", *names, "unigram"]),
        fmt_row(["---"] + ["---:"] * (len(results) + 2)),
        *(
            fmt_row(
                [
                    d,
                    f"{first['held_out'][d]['tokens']:,}",
                    *(nll_cell(r["held_out"][d]["nll"]) for r in results),
                    nll_cell(first["held_out"][d]["unigram_nll"]),
                ]
            )
            for d in DOMAINS
        ),
        fmt_row(
            [
                "**all**",
                f"{first['held_out_overall']['tokens']:,}",
                *(nll_cell(r["held_out_overall"]["nll"]) for r in results),
                nll_cell(first["held_out_overall"]["unigram_nll"]),
            ]
        ),
        "",
        "## Sample generations",
        "",
        f"A held-out prompt per domain, {args.sample_tokens} new tokens, greedy and sampled (temperature",
        "0.8, top-p 0.95, seed 0). `⟨…⟩` marks the generated text.",
        "",
    ]
    for r in results:
        lines += [f"### {r['name']}", ""]
        for d, s in r["samples"].items():
            lines += [f"**{d}**, greedy:", "", "```text", f"{s['prompt']}⟨{s['greedy']}⟩", "```", ""]
            lines += ["sampled:", "", "```text", f"…⟨{s['sampled']}⟩", "```", ""]
    lines += [
        "## Routing: expert usage per domain",
        "",
        f"{args.prompts_per_domain} held-out prompts per domain (200-600 characters) plus {args.new_tokens}",
        "greedy tokens each; every top-k pick of every token counts. Control: the same architecture with",
        "random weights (seed 0) on the same prompts.",
        "",
        *(f"![{n} usage](results/trained_usage_{n}.png)\n" for n in names),
        "## Routing: Jensen-Shannon divergence between domains",
        "",
        "Per layer, between the expert-usage distributions of two domains; bits (0 = same usage, 1 =",
        "disjoint experts). Cells: mean over the 15 domain pairs / max (its pair) / mean for random weights.",
        "",
        fmt_row(["layer", *names]),
        fmt_row(["---"] + ["---:"] * len(results)),
        *per_layer(results, js_cell),
        "",
        "![JS divergence](results/trained_js.png)",
        "",
        "Share of the last layer's picks that go to its two most used experts, per domain:",
        "",
        fmt_row(["model", *DOMAINS]),
        fmt_row(["---"] + ["---:"] * len(DOMAINS)),
        *(
            fmt_row([r["name"], *(f"{r['routing']['top2_share_last_layer'][d]:.0%}" for d in DOMAINS)])
            for r in results
        ),
        "",
        "## Routing: fine-grained vs coarse-grained entropy (figure 3 of the fMoE paper)",
        "",
        "Fine: entropy of one decode iteration's router distribution, averaged over iterations and requests.",
        "Coarse: entropy of the request's aggregate (mean router distribution over all its tokens, prompt",
        "included); 'coarse, picks' aggregates top-k picks instead. Bits; uniform = log2(experts).",
        "",
        fmt_row(["layer", *(f"{n} fine / coarse / coarse, picks" for n in names)]),
        fmt_row(["---"] + ["---:"] * len(results)),
        *per_layer(results, entropy_cell),
        fmt_row(["uniform", *(f"{r['routing']['max_entropy']:.2f}" for r in results)]),
        "",
        "![entropy](results/trained_entropy.png)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--corpora",
        default=str(ROOT.parent / "shared" / "data" / "corpora"),
        help="directory of the domain corpora",
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="models to run")
    parser.add_argument("--prompts-per-domain", type=int, default=8, help="held-out prompts per domain")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument(
        "--sample-tokens", type=int, default=48, help="tokens sampled per prompt for the sample texts"
    )
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results"),
        help="directory for the JSON, PNG and markdown results",
    )
    parser.add_argument(
        "--report", default=str(ROOT / "benchmarks" / "TRAINED_MODELS.md"), help="markdown report to write"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prompts = workloads.domain_prompts(args.corpora, args.prompts_per_domain, seed=1)
    sample_prompts = workloads.domain_prompts(args.corpora, 1, min_chars=60, max_chars=160, seed=2)
    results = []
    train_ids = None
    for name in args.models:
        if train_ids is None:  # every shipped model uses the same tokenizer; checked below
            tokenizer = fj.load_model(name).tokenizer
            sampler = train.TokenSampler.from_texts(tokenizer, workloads.load_corpora(args.corpora, "train"))
            train_ids = np.concatenate(list(sampler.tokens.values()))
            vocab = tokenizer.get_vocab()
        if fj.load_model(name).tokenizer.get_vocab() != vocab:
            raise ValueError(f"{name} has another tokenizer than {args.models[0]}; analyse them separately")
        results.append(analyse(name, args, prompts, sample_prompts, train_ids))
        r = results[-1]
        print(f"\n{name} ({r['seconds']:.0f} s)")
        print_table(
            [dict(domain=d, nll=v["nll"], unigram=v["unigram_nll"]) for d, v in r["held_out"].items()]
        )
        print_table(
            [
                dict(
                    layer=layer,
                    js_mean=r["routing"]["js_per_layer_mean"][layer],
                    js_max=r["routing"]["js_per_layer_max"][layer],
                    js_random=r["routing_untrained"]["js_per_layer_mean"][layer],
                    fine=r["routing"]["fine_entropy"][layer],
                    coarse=r["routing"]["coarse_entropy"][layer],
                )
                for layer in range(len(r["routing"]["js_per_layer_mean"]))
            ]
        )
    for r in results:
        plot_usage(r, out / f"trained_usage_{r['name']}.png")
    plot_js(results, out / "trained_js.png")
    plot_entropy(results, out / "trained_entropy.png")
    plot_loss(results, out / "trained_loss.png")
    save("trained_models", dict(args=vars(args), models=results), out)
    Path(args.report).write_text(report(results, args))
    print(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
