"""`fmoe-serve MODEL` (also `python -m fmoe_jax.serve`): an OpenAI-compatible HTTP server for one model.

    fmoe-serve fmoe-tiny-mixtral --policy fmoe --cache-experts 16 --port 8000 --warmup
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "fmoe-tiny-mixtral", "prompt": "Once upon a time", "max_tokens": 32}'

Loads MODEL (a shipped model's name, or a converted / Hugging Face directory) resident, or with its routed
experts offloaded under `--policy`, and serves it with uvicorn until SIGTERM or Ctrl+C: then it stops taking
requests, lets those in flight finish (up to --shutdown-timeout, then answers those left with a 503, or a
stream's error event and [DONE]), and closes the model, which saves fMoE's expert-map store when
--store-path is given. With --api-key (or FMOE_SERVE_API_KEY set), every route but /health asks for
`Authorization: Bearer KEY`. Needs the `serve` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib
import logging
import logging.config
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

EXTRA_HINT = 'fmoe-serve needs the serve extra: pip install "fmoe-jax[serve]" (missing: {name})'
API_KEY_ENV = "FMOE_SERVE_API_KEY"
CUT_OFF_MARGIN_S = 10.0  # after --shutdown-timeout, how long the requests cut off get to write their answer


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port (0: any free one)."""
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = _number(float, text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` keeps the module docstring's layout and shows every option's default."""


class Parser(argparse.ArgumentParser):
    """A mistake in the options is one line (argparse would print the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from fmoe_jax.offload.policies import POLICIES

    ap = Parser(prog="fmoe-serve", description=__doc__, formatter_class=HelpFormatter)
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
        "--cache-experts",
        type=positive_int,
        default=None,
        help="device expert-cache slots (default: 25%% of experts)",
    )
    ap.add_argument(
        "--prefetch-distance", type=positive_int, default=3, help="layers ahead a policy prefetches"
    )
    ap.add_argument("--execution", choices=("copy", "hybrid"), default="copy", help="see OffloadConfig")
    ap.add_argument(
        "--store-path", default=None, help="fmoe: expert-map store file, loaded and saved at exit"
    )
    ap.add_argument(
        "--max-batch",
        type=positive_int,
        default=1,
        help="sequences decoding at once. Above 1, greedy requests are served by continuous batching: they "
        "join between iterations and leave when done, with their greedy tokens independent of the other "
        "requests (but, in bfloat16, not always generate's: see fmoe_jax.batching); 1 serves each request "
        "alone, as generate runs it",
    )
    ap.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="with --max-batch > 1: cache positions per sequence (default: the model's, at most 2048); "
        "longer requests are served alone",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=16,
        help="with --max-batch > 1: prompt tokens prefilled per iteration",
    )
    ap.add_argument("--max-queue", type=positive_int, default=64, help="most waiting requests; beyond: 503")
    _listening_arguments(ap)
    return ap


def _listening_arguments(ap: argparse.ArgumentParser) -> None:
    """Where and how the server listens: address, name, warm-up, shutdown, request limits, key, log."""
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=port_number, default=8000, help="port to listen on (0: any free port)")
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
        "--shutdown-timeout",
        type=seconds,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM; those left are then answered 503",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=None,
        help="largest request body accepted; larger ones get a 413 (default: 4 MiB)",
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${API_KEY_ENV} if "
        "set, else no key)",
    )
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")


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


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads so that a port in use fails at once, in one line;
    uvicorn listens on it once the server is ready (until then, connections are refused)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"fmoe-serve: cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def offload_config(args: argparse.Namespace) -> Any:
    """The `OffloadConfig` the options ask for (None: resident)."""
    import fmoe_jax as fj

    if args.policy is None:
        if args.cache_experts is not None or args.store_path is not None:
            raise SystemExit(
                "fmoe-serve: --cache-experts and --store-path need --policy (without it, all is resident)"
            )
        return None
    options = {"store_path": args.store_path} if args.store_path else {}
    return fj.OffloadConfig(
        policy=args.policy,
        cache_experts=args.cache_experts,
        prefetch_distance=args.prefetch_distance,
        execution=args.execution,
        policy_options=options,
    )


def uvicorn_server(config: Any, server: Any, grace: float, ready: str) -> Any:
    """uvicorn's `Server` with fmoe-serve's start and end. Once it listens, it logs `ready`. On SIGTERM
    uvicorn stops taking connections and waits for those open; `grace` seconds in, `server.cut_off` answers
    the requests left (503, or a stream's error event and `[DONE]`), which close their connections well
    before uvicorn would cancel their tasks (it waits `CUT_OFF_MARGIN_S` longer:
    `config.timeout_graceful_shutdown`)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                logging.getLogger("fmoe_jax.serve").info(ready)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            async def cut_off() -> None:
                await asyncio.sleep(grace)
                await server.cut_off(grace)

            task = asyncio.ensure_future(cut_off())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

    return Server(config)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    require_serve_dependencies()
    import uvicorn

    import fmoe_jax as fj
    from fmoe_jax.loading import resolve

    from .app import DEFAULT_MAX_REQUEST_BYTES, create_app

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise SystemExit(f"fmoe-serve: the API key (--api-key or ${API_KEY_ENV}) is empty; give one, or none")
    try:
        resolve(args.model)
    except FileNotFoundError as err:
        raise SystemExit(f"fmoe-serve: {err}") from None
    offload = offload_config(args)
    sock = bind(args.host, args.port)
    # uvicorn's logging, and fmoe_jax's messages through its handler only (uvicorn.Config applies it again;
    # a handler some library puts on the root logger would print each line twice)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    level = args.log_level.upper()
    log_config["loggers"]["fmoe_jax"] = {"handlers": ["default"], "level": level, "propagate": False}
    logging.config.dictConfig(log_config)
    log = logging.getLogger("fmoe_jax.serve")
    start = time.perf_counter()
    try:
        model = fj.load_model(args.model, offload=offload)
    except (OSError, ValueError, TypeError) as err:  # a damaged checkpoint, a bad option: one line
        sock.close()
        raise SystemExit(f"fmoe-serve: {err}") from None
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
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            api_key=api_key,
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
            log_level=args.log_level,
            log_config=log_config,
            timeout_graceful_shutdown=args.shutdown_timeout + CUT_OFF_MARGIN_S,
        )
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        keyed = " with an API key" if api_key else ""
        ready = f"serving {name} on http://{shown}:{port}{keyed} (Press CTRL+C to quit)"
        # uvicorn handles SIGTERM and SIGINT while it runs (graceful shutdown), then restores these handlers
        # and raises the signal again: it then ends the process here, through `finally`.
        signal.signal(signal.SIGTERM, _exit)
        signal.signal(signal.SIGINT, _exit)
        uvicorn_server(config, app.state.server, args.shutdown_timeout, ready).run(sockets=[sock])
    finally:
        model.close()  # saves fmoe's store (--store-path)
        log.info("model closed")
    sys.exit(0)
