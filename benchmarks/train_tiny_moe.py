"""Trains one of the small MoE models that ship with fmoe_jax and exports it as a Hugging Face checkpoint.

    python benchmarks/train_tiny_moe.py --corpora ../shared/data/corpora --preset fmoe-tiny-mixtral \
        --workdir /tmp/fmoe-train/mixtral --steps 1000 --minutes 55 \
        --export fmoe_jax/shipped/fmoe-tiny-mixtral

Running it again with the same --workdir resumes from the last checkpoint. `--bench-dispatch` instead
measures forward+backward tokens/s of the expert-dispatch kernels at the preset's shapes (the measurement
behind `TrainConfig.kernel`), printing a table and writing `train_dispatch.json`/`.png` into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from fmoe_jax.models import build_model, config_from_hf, expert_mixture, reference_mixture
from fmoe_jax.research import train, workloads

import fmoe_jax as fj
from fmoe_jax.export import export_hf

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULTS = train.TrainConfig()
DOMAIN_NAMES = {
    "arxiv": "arXiv papers (LaTeX)",
    "books": "books",
    "web": "web text (C4)",
    "code": "source code (GitHub)",
    "wikipedia_de": "German Wikipedia",
    "shakespeare": "Tiny Shakespeare",
}


def parameter_counts(module) -> dict[str, int]:
    """Total parameters, those of routed experts, and those one token uses (top-k of the routed experts)."""
    cfg = module.config
    flat = nnx.to_flat_state(nnx.split(module)[1])
    total = sum(int(np.prod(v.get_value().shape)) for _, v in flat)
    experts = sum(int(np.prod(v.get_value().shape)) for p, v in flat if p[0] == "experts")
    return dict(
        total=total, routed_experts=experts, active=total - experts + experts * cfg.top_k // cfg.num_experts
    )


def model_card(name: str, hf_config: dict, record: dict) -> str:
    """README.md of a shipped model: what it is, how it was trained, how well it does."""
    p = record["parameters"]
    tc = record["train_config"]
    rows = "\n".join(
        f"| {DOMAIN_NAMES[d]} | {r['tokens']:,} | {r['nll']:.3f} | {np.exp(r['nll']):.1f} | "
        f"{r['unigram_nll']:.3f} | {np.exp(r['unigram_nll']):.0f} |"
        for d, r in record["held_out"].items()
    )
    h = hf_config
    experts = h.get("num_local_experts") or h["num_experts"]
    expert_size = h.get("moe_intermediate_size") or h["intermediate_size"]
    shared = (
        f", a shared expert of size {h['shared_expert_intermediate_size']} with its sigmoid gate"
        if h.get("shared_expert_intermediate_size")
        else ""
    )
    family = h["architectures"][0].removesuffix("ForCausalLM")
    minutes = record["train_seconds"] / 60
    return f"""# {name}

A small {family} mixture-of-experts language model trained from scratch by `fmoe_jax` on a 2-core CPU,
so that expert prediction and offloading can be studied on routing learned from real text (random
models route at random). It is a research fixture, not a useful language model.

## Architecture

`model_type: {h["model_type"]}`: {h["num_hidden_layers"]} layers, hidden size {h["hidden_size"]},
{h["num_attention_heads"]} attention heads ({h["num_key_value_heads"]} KV heads), {experts} routed experts
per layer, top-{h["num_experts_per_tok"]} routing, expert size {expert_size}{shared}, vocabulary
{h["vocab_size"]} (byte-level BPE), tied input/output embeddings. Parameters: {p["total"] / 1e6:.2f} M in
total, {p["routed_experts"] / 1e6:.2f} M in routed experts, {p["active"] / 1e6:.2f} M active per token.
Weights are stored in bfloat16.

## Training

- Data: the train split (`fmoe_jax.research.workloads.split_corpus`: duplicates removed, last 5 % held out) of
  six corpora: arXiv, books, C4 web text, GitHub code and German Wikipedia (texts from the OLMoE
  repository, Apache-2.0) and Tiny Shakespeare (public domain); {record["train_tokens"]:,} tokens.
  Rows are `<s>` plus {tc["seq_len"] - 1} tokens starting at a line start, domains in proportion to size.
- Tokenizer: byte-level BPE, {h["vocab_size"]} entries, trained on the same split; it prepends `<s>`.
  Its chat template (`chat_template.jinja`) renders turns as a play's speeches (`USER:` / `ASSISTANT:`);
  the model never saw chat data, so its replies imitate the corpora, not an assistant.
- Objective: next-token cross-entropy + {h["router_aux_loss_coef"]} x the load-balancing loss of
  `transformers` (`router_aux_loss_coef`).
- Optimiser: AdamW (b2 0.95, weight decay {tc["weight_decay"]}), peak learning rate {tc["lr"]},
  {tc["warmup_steps"]} warmup steps then cosine decay to {tc["min_lr_ratio"]} x, gradient clipping
  {tc["grad_clip"]}, seed {tc["seed"]}.
- {record["steps"]} steps of {tc["batch_size"]} x {tc["seq_len"]} tokens: {record["tokens_seen"]:,} tokens
  seen in {minutes:.1f} min ({record["tokens_per_second"]:.0f} tokens/s, compilation included), expert
  dispatch kernel `{tc["kernel"]}`.
- Final training loss (mean of the last 20 steps): cross-entropy {record["final_train_ce"]:.3f} nats,
  load-balancing loss {record["final_train_aux"]:.3f} (top-k = {h["num_experts_per_tok"]} when balanced).

## Held-out loss (nats per token)

Windows of `<s>` + {tc["seq_len"] - 1} tokens over each domain's held-out text; the unigram baseline is
the cross-entropy of the same tokens under the add-one smoothed token frequencies of the train split.

| domain | tokens | NLL | perplexity | unigram NLL | unigram perplexity |
| --- | ---: | ---: | ---: | ---: | ---: |
{rows}

## Use

```python
import fmoe_jax as fj
model = fj.load_model("{name}")
print(fj.generate(model, ["Once upon a time"], max_new_tokens=32).texts[0])
```

The directory is a Hugging Face checkpoint: `transformers.AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load it. `fmoe_training.json` holds the training record (loss curve
every 10 steps). Reproduce with `python benchmarks/train_tiny_moe.py --preset {name} --steps
{tc["steps"]} --export DIR` (see `benchmarks/TRAINED_MODELS.md`).
"""


def evaluate_and_export(args, hf_config, result, tokenizer, sampler) -> None:
    """Held-out loss against the unigram baseline, the model card, and the bf16 HF checkpoint."""
    model = fj.from_module(result.module, tokenizer=tokenizer, kernel="blocked")
    held_out = train.held_out_nll(
        lambda t: fj.forward(model, t),
        tokenizer,
        workloads.load_corpora(args.corpora, "held_out"),
        seq_len=args.seq_len,
        max_windows=args.eval_windows,
    )
    train_ids = np.concatenate(list(sampler.tokens.values()))
    history = result.history
    record = dict(
        preset=args.preset,
        steps=result.step,
        finished=result.finished,
        tokens_seen=result.tokens_seen,
        train_tokens=int(train_ids.size),
        train_seconds=result.train_seconds,
        tokens_per_second=result.tokens_seen / result.train_seconds,
        parameters=parameter_counts(result.module),
        train_config=dataclasses.asdict(train_config(args)),
        final_train_ce=float(np.mean([h["ce"] for h in history[-20:]])),
        final_train_aux=float(np.mean([h["aux"] for h in history[-20:]])),
        held_out={
            d: dict(
                tokens=r["tokens"],
                nll=r["nll"],
                unigram_nll=train.unigram_nll(train_ids, r["targets"], len(tokenizer)),
            )
            for d, r in held_out.items()
        },
        history=[
            dict(step=i + 1, **h) for i, h in enumerate(history) if (i + 1) % 10 == 0 or i + 1 == len(history)
        ],
    )
    out = export_hf(
        result.module,
        hf_config,
        args.export,
        dtype="bfloat16",
        tokenizer=tokenizer,
        readme=model_card(args.preset, hf_config, record),
        extra_json={"fmoe_training.json": record},
    )
    print(f"exported to {out}")
    for d, r in record["held_out"].items():
        print(f"  {d:14s} held-out NLL {r['nll']:.3f}  unigram {r['unigram_nll']:.3f}")


def train_config(args) -> train.TrainConfig:
    return train.TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )


def bench_dispatch(args) -> None:
    """Forward+backward tokens/s of one MoE layer per kernel at the preset's shapes, and of a train step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import median_ms, print_table, save, save_png

    cfg = config_from_hf(train.PRESETS[args.preset])
    module = build_model(cfg, seed=0)
    n = args.batch_size * args.seq_len
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, cfg.hidden_size)), jnp.float32)
    layer, experts = module.layers[0], module.layer_experts(0)
    slots = jnp.arange(cfg.num_experts, dtype=jnp.int32)
    valid = jnp.ones((n,), bool)

    def layer_loss(experts, x, kernel):
        routing = layer.route(x)
        if kernel == "dense (reference)":
            y = reference_mixture(x, routing, experts)
        else:
            y = expert_mixture(x, routing, experts, slots, valid, kernel=kernel)
        return jnp.sum(y * x)

    rows = []
    for kernel in ("dense (reference)", "tiled", "ragged", "blocked"):
        grad = jax.jit(jax.grad(lambda e, x, k=kernel: layer_loss(e, x, k), argnums=(0, 1)))
        jax.block_until_ready(grad(experts, x))
        ms = median_ms(lambda g=grad: jax.block_until_ready(g(experts, x)), repeats=args.repeats)
        rows.append(dict(kernel=kernel, what="one MoE layer fwd+bwd", ms=ms, tokens_per_s=n / ms * 1e3))
    print_table(rows)
    graphdef, params = nnx.split(module)
    tc = train_config(args)
    optimizer = train.make_optimizer(tc)
    opt_state = optimizer.init(params)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len)), jnp.int32)
    step = lambda: jax.block_until_ready(  # noqa: E731
        train.train_step(
            params,
            opt_state,
            tokens,
            graphdef=graphdef,
            optimizer=optimizer,
            kernel="blocked",
            aux_coef=0.01,
            top_k=cfg.top_k,
        )
    )
    ms = median_ms(step, repeats=max(2, args.repeats // 2))
    rows.append(dict(kernel="blocked", what="whole train step", ms=ms, tokens_per_s=n / ms * 1e3))
    print_table(rows[-1:])
    out = Path(args.out)
    save("train_dispatch", dict(preset=args.preset, tokens_per_call=n, rows=rows), out)
    fig, ax = plt.subplots(figsize=(6, 3))
    layer_rows = [r for r in rows if r["what"] == "one MoE layer fwd+bwd"]
    ax.barh([r["kernel"] for r in layer_rows], [r["tokens_per_s"] for r in layer_rows])
    ax.set_xlabel("tokens/s, one MoE layer forward+backward")
    ax.set_title(f"{args.preset}: expert dispatch on {jax.default_backend()}, {n} tokens")
    fig.tight_layout()
    save_png(fig, out / "train_dispatch.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpora",
        default=str(ROOT.parent / "shared" / "data" / "corpora"),
        help="directory of the domain corpora",
    )
    parser.add_argument("--preset", choices=sorted(train.PRESETS), default="fmoe-tiny-mixtral")
    parser.add_argument("--workdir", default=None, help="checkpoints (default /tmp/fmoe-train/<preset>)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory, trained if empty (default <workdir>/../tokenizer)",
    )
    parser.add_argument("--minutes", type=float, default=None, help="wall-time budget of this run")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    parser.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len)
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr)
    parser.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--checkpoint-every", type=int, default=DEFAULTS.checkpoint_every)
    parser.add_argument("--export", default=None, help="after training, write the bf16 HF checkpoint here")
    parser.add_argument(
        "--eval-windows", type=int, default=64, help="held-out windows per domain for the card"
    )
    parser.add_argument("--bench-dispatch", action="store_true")
    parser.add_argument("--repeats", type=int, default=4, help="timed repeats (the median is reported)")
    parser.add_argument(
        "--out", default=str(RESULTS), help="directory for the JSON, PNG and markdown results"
    )
    args = parser.parse_args(argv)
    if args.bench_dispatch:
        bench_dispatch(args)
        return 0

    workdir = Path(args.workdir or f"/tmp/fmoe-train/{args.preset}")
    hf_config = train.PRESETS[args.preset]
    t0 = time.monotonic()
    tokenizer = train.prepare_tokenizer(args.corpora, args.tokenizer or workdir.parent / "tokenizer")
    sampler = train.TokenSampler.from_texts(tokenizer, workloads.load_corpora(args.corpora, "train"))
    print(f"{sampler.num_tokens:,} training tokens ({time.monotonic() - t0:.0f} s to tokenize)", flush=True)
    result = train.train(hf_config, sampler, train_config(args), workdir, minutes=args.minutes)
    print(
        f"step {result.step}/{args.steps}, {result.tokens_seen:,} tokens, "
        f"{result.train_seconds / 60:.1f} min, last ce {result.history[-1]['ce']:.3f}"
        if result.history
        else "no steps run",
        flush=True,
    )
    if args.export:
        if not result.finished:
            print("not exporting: training has not finished (run again to resume)", file=sys.stderr)
            return 1
        evaluate_and_export(args, hf_config, result, tokenizer, sampler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
