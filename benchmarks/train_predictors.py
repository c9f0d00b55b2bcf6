"""Trains the learned predictors of the `promoe` and `duoserve` baselines on routing traces of a model.

    .venv/bin/python -m benchmarks.train_predictors --model fmoe-tiny-mixtral \\
        --prompts ../shared/data/prompts/sharegpt_500.json --out benchmarks/results/predictors/tiny-mixtral

Records routing traces (router inputs included) with the resident model on the store split (70 %,
`workloads.split_store_eval`; the eval split stays unseen for benchmarks), holds out `--eval-fraction` of
those requests, trains both predictors (`fmoe_jax.offload.predictors`), prints a table of top-k accuracy
against the popularity baseline, and writes to --out: `promoe.{npz,json}`, `duoserve.{npz,json}`,
`train_predictors.json` and `train_predictors.png`. Serve with, e.g.,
`OffloadConfig(policy=ProMoE(predictor=OUT / "promoe"), prefetch_distance=STRIDE)`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import HelpFormatter, bar_plot, print_table, save

LOADERS = {"sharegpt": "load_sharegpt", "mt_bench": "load_mt_bench", "alpaca_eval": "load_alpaca_eval"}


def prompt_format(path: Path, given: str) -> str:
    if given != "auto":
        return given
    for name in LOADERS:
        if name in path.name.lower():
            return name
    raise SystemExit(
        f"cannot tell the format of {path} from its name: pass --prompt-format ({', '.join(LOADERS)})"
    )


def encode(model, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids per prompt, cut to `max_tokens`. A model without a tokenizer (a random checkpoint) gets the
    UTF-8 bytes folded into its vocabulary: its routing statistics are still real, its texts are not."""
    if model.tokenizer is None:
        print(f"{model.source} has no tokenizer: feeding prompts as byte ids")
        return [[b % model.config.vocab_size for b in t.encode()][:max_tokens] or [0] for t in texts]
    from fmoe_jax.prompts import encode_prompts

    return [ids[:max_tokens] for ids in encode_prompts(model, texts)]


def record_traces(model, prompts: list[list[int]], batch_size: int, new_tokens: int) -> list:
    """One trace per batch of prompts, with hidden states; prompts sorted by length to limit padding."""
    import fmoe_jax as fj

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    traces = []
    for start in range(0, len(order), batch_size):
        batch = [prompts[i] for i in order[start : start + batch_size]]
        out = fj.generate(model, batch, new_tokens, stop_at_eos=False, record_trace=True, record_hidden=True)
        traces.append(out.trace)
        print(f"recorded {min(start + batch_size, len(order))}/{len(order)} prompts", flush=True)
    return traces


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, help="model directory or shipped model name")
    parser.add_argument(
        "--prompts", type=Path, required=True, help="prompt file (ShareGPT, MT-Bench, AlpacaEval)"
    )
    parser.add_argument(
        "--prompt-format",
        default="auto",
        choices=["auto", *LOADERS],
        help="prompt file format (auto: from the file name)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the predictors and results")
    parser.add_argument("--max-prompts", type=int, default=200, help="store-split prompts to record")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=256, help="prompt ids cut to this many tokens"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stride", type=int, default=3, help="ProMoE's look-ahead d (= prefetch_distance)")
    parser.add_argument("--promoe-hidden", default="128", help="hidden widths, comma separated")
    parser.add_argument("--duoserve-hidden", default="256,128,64", help="paper: 2048,1024,512,256,128,64")
    parser.add_argument("--promoe-epochs", type=int, default=10)
    parser.add_argument("--duoserve-epochs", type=int, default=20)
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="recorded requests held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    from fmoe_jax.models import model_identity
    from fmoe_jax.research import predictor_training, workloads

    import fmoe_jax as fj

    fmt = prompt_format(args.prompts, args.prompt_format)
    store, _ = workloads.split_store_eval(getattr(workloads, LOADERS[fmt])(args.prompts), 0.7, seed=args.seed)
    store = store[: args.max_prompts]
    model = fj.load_model(args.model)
    model_id = model_identity(model.config)
    start = time.perf_counter()
    prompts = encode(model, [p.text for p in store], args.max_prompt_tokens)
    traces = record_traces(model, prompts, args.batch_size, args.new_tokens)
    record_s = time.perf_counter() - start
    train, held_out = predictor_training.split_requests(traces, args.eval_fraction, seed=args.seed)
    common = dict(model_id=model_id, seed=args.seed, progress=not args.quiet)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, results = [], {}
    for kind in ("promoe", "duoserve"):
        start = time.perf_counter()
        if kind == "promoe":
            hidden = tuple(int(w) for w in args.promoe_hidden.split(","))
            predictor = predictor_training.train_promoe(
                train, stride=args.stride, hidden=hidden, epochs=args.promoe_epochs, **common
            )
        else:
            hidden = tuple(int(w) for w in args.duoserve_hidden.split(","))
            predictor = predictor_training.train_duoserve(
                train, hidden=hidden, epochs=args.duoserve_epochs, **common
            )
        train_s = time.perf_counter() - start
        scores = predictor_training.evaluate(predictor, held_out)
        predictor.meta["held_out"] = scores
        path = predictor.save(args.out / kind)
        results[kind] = {"path": str(path), "train_s": train_s, "meta": predictor.meta, **scores}
        rows.append(
            {
                "predictor": kind,
                "recall": scores["recall"],
                "all_hit": scores["all_hit"],
                "any_hit": scores["any_hit"],
                "popularity_recall": scores["popularity_recall"],
                "held_out_samples": scores["samples"],
                "train_s": train_s,
            }
        )
    print_table(rows)
    payload = {
        "model": args.model,
        "model_id": model_id,
        "prompts": str(args.prompts),
        "recorded_prompts": len(store),
        "record_s": record_s,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    save("train_predictors", payload, args.out)
    bar_plot(
        args.out / "train_predictors.png",
        f"held-out top-{model.config.top_k} recall ({args.model})",
        {
            kind: {"predictor": results[kind]["recall"], "popularity": results[kind]["popularity_recall"]}
            for kind in results
        },
        "recall",
    )
    return payload


if __name__ == "__main__":
    main()
