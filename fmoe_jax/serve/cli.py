"""`fmoe-serve MODEL` (also `python -m fmoe_jax.serve`): an OpenAI-compatible HTTP server for one model.

    fmoe-serve fmoe-tiny-mixtral --policy fmoe --cache-experts 16 --port 8000 --warmup
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "fmoe-tiny-mixtral", "prompt": "Once upon a time", "max_tokens": 32}'

Loads MODEL (a shipped model's name, or a converted / Hugging Face directory) resident, or with its routed
experts offloaded under `--policy`, and serves it with uvicorn until SIGTERM or Ctrl+C: then it stops taking
requests, lets those in flight finish (up to --shutdown-timeout, then cancels them), and closes the model,
which saves fMoE's expert-map store when --store-path is given. Needs the `serve` extra.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import logging.config
import signal
import sys
import time
from pathlib import Path

EXTRA_HINT = 'fmoe-serve needs the serve extra: pip install "fmoe-jax[serve]" (missing: {name})'


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` keeps the module docstring's layout and shows every option's default."""


def parser() -> argparse.ArgumentParser:
    from fmoe_jax.offload.policies import POLICIES

    ap = argparse.ArgumentParser(prog="fmoe-serve", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument(
        "model", help="a shipped model's name (fmoe_jax.shipped_models()) or a checkpoint directory"
    )
    ap.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="offload the routed experts to host memory under this policy (default: none, all resident)",
    )
    ap.add_argument(
        "--cache-experts", type=int, default=None, help="device expert-cache slots (default: 25%% of experts)"
    )
    ap.add_argument("--prefetch-distance", type=int, default=3, help="layers ahead a policy prefetches")
    ap.add_argument("--execution", choices=("copy", "hybrid"), default="copy", help="see OffloadConfig")
    ap.add_argument(
        "--store-path", default=None, help="fmoe: expert-map store file, loaded and saved at exit"
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="sequences decoding at once. Above 1, greedy requests are served by continuous batching: they "
        "join between iterations and leave when done, with their greedy tokens independent of the other "
        "requests (but, in bfloat16, not always generate's: see fmoe_jax.batching); 1 serves each request "
        "alone, as generate runs it",
    )
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="with --max-batch > 1: cache positions per sequence (default: the model's, at most 2048); "
        "longer requests are served alone",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=16,
        help="with --max-batch > 1: prompt tokens prefilled per iteration",
    )
    ap.add_argument("--max-queue", type=int, default=64, help="most waiting requests; beyond: 503")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    ap.add_argument(
        "--served-model-name", default=None, help="the model's id in the API (default: MODEL's name)"
    )
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="compile before taking requests. With --max-batch > 1: every program continuous batching runs "
        "(nothing compiles while serving, see the fmoe_compilations metric); with 1: what short prompts (up "
        "to 16 tokens) with 16 new tokens use",
    )
    ap.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM"
    )
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return ap


def require_serve_dependencies() -> None:
    """SystemExit naming the `serve` extra when a server dependency is missing."""
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise SystemExit(EXTRA_HINT.format(name=module)) from None


def warmup_alone(model) -> None:
    """Compiles what short requests served alone use: a prompt bucket of 16 and 16 new tokens. The prompt is
    random tokens, so that an offloaded layer meets as many experts as real requests make it (its programs
    depend on how many)."""
    import numpy as np

    import fmoe_jax as fj

    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 12)).tolist()
    fj.generate(model, prompt, max_new_tokens=16, stop_at_eos=False)


def _exit(signum: int, frame) -> None:
    raise SystemExit(0 if signum == signal.SIGTERM else 128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    require_serve_dependencies()
    import uvicorn

    import fmoe_jax as fj

    from .app import create_app

    # uvicorn's logging, and fmoe_jax's messages through its handler (uvicorn.Config applies it again)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["fmoe_jax"] = {"handlers": ["default"], "level": args.log_level.upper()}
    logging.config.dictConfig(log_config)
    log = logging.getLogger("fmoe_jax.serve")
    offload = None
    if args.policy is not None:
        options = {"store_path": args.store_path} if args.store_path else {}
        offload = fj.OffloadConfig(
            policy=args.policy,
            cache_experts=args.cache_experts,
            prefetch_distance=args.prefetch_distance,
            execution=args.execution,
            policy_options=options,
        )
    elif args.cache_experts is not None or args.store_path is not None:
        raise SystemExit("--cache-experts and --store-path need --policy (without it the model is resident)")
    start = time.perf_counter()
    model = fj.load_model(args.model, offload=offload)
    log.info("loaded %s in %.1f s (%s)", args.model, time.perf_counter() - start, args.policy or "resident")
    try:
        name = args.served_model_name or Path(args.model).name
        app = create_app(
            model,
            model_name=name,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            context=args.max_context,
            chunk=args.prefill_chunk,
        )
        if args.warmup:
            start = time.perf_counter()
            if args.max_batch > 1:
                app.state.scheduler.warmup()
            else:
                warmup_alone(model)
            log.info("warm-up compiled in %.1f s", time.perf_counter() - start)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config=log_config,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        # uvicorn handles SIGTERM and SIGINT while it runs (graceful shutdown), then restores these handlers
        # and raises the signal again: it then ends the process here, through `finally`.
        signal.signal(signal.SIGTERM, _exit)
        signal.signal(signal.SIGINT, _exit)
        uvicorn.Server(config).run()
    finally:
        model.close()  # saves fmoe's store (--store-path)
        log.info("model closed")
    sys.exit(0)
