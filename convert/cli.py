"""`fmoe-convert`: Hugging Face safetensors -> fmoe_jax orbax checkpoint (streaming, atomic), and `verify`.

The console script and `python -m fmoe_jax.convert` call `main`; `convert` and `verify` are the same
steps as functions that raise instead of printing (tests, notebooks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from fmoe_jax.models import FAMILIES, UnsupportedConfigError
from fmoe_jax.models.quant import KINDS, ExpertQuantization, is_expert_matrix, quantized_params

import fmoe_jax
from fmoe_jax.checkpoint import orbax_io
from fmoe_jax.checkpoint.hf import CheckpointError, HFCheckpoint
from fmoe_jax.checkpoint.manifest import (
    FLOAT_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Interrupted,
    Manifest,
    files_under,
    verify_files,
)

from .destination import (
    PROG,
    ConvertError,
    check_destination,
    check_space,
    install,
    remove_stale,
    remove_tree,
    work_dir,
)
from .hashing import Hasher, progress_bar

DTYPES = ("bfloat16", "float16", "float32")
# Files copied next to the weights when the source has them (config.json is required and always copied).
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
)


def convert(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    poll: Callable[[], None] = lambda: None,
    expert_quantization: str | None = None,
    group_size: int | None = None,
    untie: bool = False,
) -> tuple[Manifest, float]:
    """Converts a Hugging Face checkpoint directory into an fmoe_jax checkpoint at `out_dir`.

    With `expert_quantization` ("int8" or "int4", `group_size` inputs per scale, default 64) the routed
    experts are stored quantized, as `load_model(..., expert_quantization=...)` would quantize them, and the
    manifest records it, so that loading never quantizes again. `untie`: see `HFCheckpoint`. Everything is
    checked before anything is written (a float16 `dtype` reads every tensor once first: none may overflow).
    Weights stream one layer at a time into a hidden directory beside `out_dir`, which is renamed to
    `out_dir` only once complete; on any failure or interruption it is removed. `poll` is called at every
    safe point (between tensors, after each item); raising from it abandons the conversion. Returns the
    manifest and the seconds it took.

    Raises:
      CheckpointError, UnsupportedConfigError: the source is incomplete, corrupt or not supported.
      ConvertError: the destination exists, lacks space or cannot be written (disk full, permission
        denied: one sentence naming OUT_DIR and the cause).
      OSError: a source file cannot be read (the message names it).
    """
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    ckpt = HFCheckpoint(hf_dir, untie=untie)
    if untie and not ckpt.untied:
        raise ConvertError(f"--untie: {hf_dir / 'config.json'} does not tie the embeddings; nothing to untie")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    np_dtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(ckpt.stored_dtype())
    cfg = ckpt.config
    quantization = _quantization_arg(expert_quantization, group_size, cfg, ckpt.expert_storage)
    bytes_per_expert, param_bytes = _stored_bytes(cfg, np_dtype, quantization)
    check_destination(out_dir, overwrite)
    parent = out_dir.parent
    remove_stale(parent, out_dir.name)
    check_space(parent, param_bytes)
    ckpt.check_cast(np_dtype, poll=poll)
    tmp = work_dir(out_dir)
    try:
        tmp.mkdir()
    except OSError as err:
        raise ConvertError(f"{parent}: cannot create the output there ({err.strerror})") from None

    hasher = Hasher()
    try:
        sizes = (bytes_per_expert, param_bytes)
        manifest = _write(ckpt, hf_dir, tmp, np_dtype, quantization, sizes, hasher, progress, poll)
        manifest.write(tmp)
        install(tmp, out_dir)
    except OSError as err:
        _abandon(hasher, tmp)
        raise _write_error(err, tmp, out_dir) from None
    except BaseException:
        _abandon(hasher, tmp)
        raise
    hasher.close()
    return manifest, time.perf_counter() - start


def _write(
    ckpt: HFCheckpoint,
    hf_dir: Path,
    tmp: Path,
    np_dtype: np.dtype,
    quantization: ExpertQuantization | None,
    sizes: tuple[int, int],
    hasher: Hasher,
    progress: bool,
    poll: Callable[[], None],
) -> Manifest:
    """Writes the conversion into `tmp` (side files, then items streamed from `ckpt`), hashes the sources and
    the outputs, and returns the manifest; `sizes`: bytes per expert and of all parameters, as stored."""
    cfg = ckpt.config
    bytes_per_expert, param_bytes = sizes
    side = [name for name in SIDE_FILES if (hf_dir / name).is_file()]
    sources = sorted({*(s.path.name for s in ckpt.shards.values()), *side})
    if (hf_dir / "model.safetensors.index.json").is_file():
        sources.append("model.safetensors.index.json")
    for name in sources:
        hasher.add(f"source/{name}", hf_dir / name)
    for name in side:
        shutil.copyfile(hf_dir / name, tmp / name)
        if name == "config.json" and ckpt.untied:
            (tmp / name).write_text(json.dumps(ckpt.hf_config, indent=2) + "\n")
        hasher.add(name, tmp / name)

    def item_written(item: str) -> None:
        for path in files_under(tmp / item):
            hasher.add(path.relative_to(tmp).as_posix(), path)

    with progress_bar(ckpt.total_bytes, "converting", progress) as bar:
        items = orbax_io.write_items(
            ckpt,
            tmp,
            np_dtype,
            on_bytes=_polling(bar.update, poll),
            on_item=_polling(item_written, poll),
            quantization=quantization,
        )
    outputs = [p.relative_to(tmp).as_posix() for p in files_under(tmp)]
    for name in outputs:
        if name not in hasher:
            hasher.add(name, tmp / name)
    with progress_bar(hasher.pending_bytes(), "hashing", progress) as bar:
        source_files = hasher.results([f"source/{n}" for n in sources], bar, poll)
        files = hasher.results(outputs, bar, poll)
    manifest = Manifest(
        family=cfg.family,
        dtype=str(jnp.dtype(np_dtype)),
        num_layers=cfg.num_layers,
        num_experts=cfg.num_experts,
        moe_layers=list(cfg.moe_layer_ids),
        bytes_per_expert=bytes_per_expert,
        param_bytes=param_bytes,
        items=items,
        source_dir=str(hf_dir.absolute()),
        source_layout=ckpt.layout,
        source_dtype=str(jnp.dtype(ckpt.stored_dtype())),
        source_files={k.removeprefix("source/"): v for k, v in source_files.items()},
        files=files,
        converter=f"fmoe-jax {fmoe_jax.__version__}",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        format_version=FORMAT_VERSION if quantization is not None else FLOAT_FORMAT_VERSION,
        expert_quantization=None if quantization is None else quantization.as_dict(),
    )
    return manifest


def _quantization_arg(
    kind: str | None, group_size: int | None, cfg: Any, stored: ExpertQuantization | None
) -> ExpertQuantization | None:
    """The command's `--expert-quantization` / `--group-size`, checked against the model's dimensions; or
    how the source stores its experts when it keeps them so (MXFP4), which nothing requantizes."""
    if stored is not None:
        if kind is not None or group_size is not None:
            raise ConvertError(
                f"the source stores its experts in {stored.kind.upper()}, which is kept as published; "
                "drop --expert-quantization / --group-size"
            )
        return stored
    if kind is None:
        if group_size is not None:
            raise ConvertError(
                f"--group-size {group_size} needs --expert-quantization ({' or '.join(KINDS)})"
            )
        return None
    try:
        quantization = ExpertQuantization(kind, 64 if group_size is None else group_size)
        quantization.check_model(cfg.hidden_size, cfg.expert_intermediate_size)
    except ValueError as err:
        raise ConvertError(f"--expert-quantization {kind} --group-size {group_size}: {err}") from None
    return quantization


def _stored_bytes(cfg: Any, dtype: np.dtype, quantization: ExpertQuantization | None) -> tuple[int, int]:
    """Bytes of one routed expert as stored (its biases included), and of all parameters."""
    items = orbax_io.expected_items(cfg, quantization)

    def nbytes(path: tuple, shape: tuple[int, ...]) -> int:
        return int(np.prod(shape)) * orbax_io.stored_dtype(path, dtype, quantization).itemsize

    total = sum(nbytes(*entry) for entries in items.values() for entry in entries.values())
    first = items[orbax_io.experts_item(cfg.moe_layer_ids[0])].values()
    return sum(nbytes(path, shape) for path, shape in first if path[2] == 0), total


def _abandon(hasher: Hasher, tmp: Path) -> None:
    """Stops hashing and removes the work directory; a further Ctrl-C does not stop it (`remove_tree`).

    Whether the directory is gone is for the caller to check (`work_dir`): `main` names it if not."""
    while True:
        try:
            hasher.close()
            break
        except KeyboardInterrupt:
            continue
    remove_tree(tmp)


def _write_error(err: OSError, tmp: Path, out_dir: Path) -> Exception:
    """A failure to write the output (disk full, permission denied) as one sentence naming OUT_DIR and the
    cause; an error about a source file, which names that file, is kept as it is."""
    path = Path(err.filename) if err.filename else None
    if path is not None and not (path.is_relative_to(tmp) or path == out_dir):
        return err
    cause = err.strerror or (str(err.args[0]) if err.args else type(err).__name__)
    where = f" (writing {path.relative_to(tmp)})" if path is not None and path.is_relative_to(tmp) else ""
    return ConvertError(f"{out_dir}: cannot write the checkpoint: {cause}{where}")


def verify(
    out_dir: str | os.PathLike,
    *,
    against: str | os.PathLike | None = None,
    progress: bool = False,
    poll: Callable[[], None] = lambda: None,
) -> str:
    """Checks a converted checkpoint: every file's size and sha256 against the manifest, every item
    restorable with the shapes the config implies and, with `against`, every tensor equal to the Hugging
    Face source cast to the checkpoint's dtype (and quantized, for quantized experts: the values and scales
    must be those `fmoe-convert` computes). Returns a one-line summary; raises `CheckpointError`.
    """
    out_dir = Path(out_dir)
    if not orbax_io.is_converted(out_dir):
        raise CheckpointError(f"{out_dir}: no {MANIFEST_NAME}; not a checkpoint written by {PROG}")
    manifest = Manifest.read(out_dir)
    with progress_bar(sum(r.size for r in manifest.files.values()), "hashing", progress) as bar:
        verify_files(out_dir, manifest.files, hashes=True, on_bytes=_polling(bar.update, poll))
    _, cfg, expected = orbax_io.open_converted(out_dir)
    hf = None
    if against is not None:
        hf = HFCheckpoint(against, untie=not cfg.tie_word_embeddings)
        if hf.config != cfg:
            raise CheckpointError(f"{against}: its config.json describes a different model than {out_dir}")
    dtype = np.dtype(jnp.dtype(manifest.dtype))
    compared = 0
    with progress_bar(manifest.param_bytes, "restoring" if hf is None else "comparing", progress) as bar:
        for name, arrays in orbax_io.read_items(out_dir, expected):
            poll()
            bar.update(sum(a.nbytes for a in arrays.values()))
            if hf is None:
                continue
            stream = hf.params(dtype, where=lambda t, name=name: orbax_io.item_of_tensor(t) == name)
            for tensor, target, value in stream:
                wanted = {target.path: value}
                if manifest.quantization is not None and is_expert_matrix(target.path):
                    wanted = quantized_params(target.path, value, manifest.quantization)
                for path, want in wanted.items():
                    ours = arrays[path]
                    if (
                        ours.dtype != want.dtype
                        or ours.shape != want.shape
                        or ours.tobytes() != want.tobytes()
                    ):
                        diff = np.max(np.abs(ours.astype(np.float32) - want.astype(np.float32)))
                        raise CheckpointError(
                            f"{out_dir / name}: {'/'.join(map(str, path))} differs from {tensor.key} in "
                            f"{against} (max |difference| {diff:.3g} in {ours.dtype})"
                        )
                compared += 1
    summary = (
        f"{out_dir}: OK: {len(manifest.files)} files match the manifest, "
        f"{len(expected)} items restore ({manifest.family}, {_stored_as(manifest)})"
    )
    if hf is not None:
        summary += f", all {compared} tensors equal {against} in {_stored_as(manifest)}"
    return summary


def _stored_as(manifest: Manifest) -> str:
    q = manifest.quantization
    return manifest.dtype if q is None else f"{manifest.dtype}, experts {q.kind} in groups of {q.group_size}"


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} HF_DIR OUT_DIR [--dtype {{{','.join(DTYPES)}}}] "
        f"[--expert-quantization {{{','.join(KINDS)}}}] [--group-size N] [--overwrite] [--quiet]\n"
        f"       {PROG} verify OUT_DIR [--against HF_DIR] [--quiet]\n"
        f"       {PROG} --version",
        description="Convert a Hugging Face Mixture-of-Experts checkpoint (safetensors; model_type "
        f"{', '.join(FAMILIES)}) into an fmoe_jax orbax checkpoint that `fmoe_jax.load_model(OUT_DIR, "
        "offload=...)` restores with routed experts straight into pinned host memory. The weights stream "
        "one MoE layer at a time, so the conversion needs about one layer's experts of RAM, not the "
        "model's size. The result appears at OUT_DIR only when complete; a failed or interrupted "
        "conversion leaves nothing behind.",
        epilog=f"Run `{PROG} verify --help` for checking a converted checkpoint.",
    )
    parser.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="Hugging Face model directory: config.json plus model.safetensors, or sharded safetensors "
        "with model.safetensors.index.json (hub layout or transformers-5 fused expert layout). "
        "Tokenizer files and generation_config.json are copied when present.",
    )
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="where to write the checkpoint; its parent directory must exist and have room for the "
        "weights in the chosen dtype",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the stored weights (default: the dtype most of the source's bytes are stored in); "
        "casting float32 to bfloat16 rounds to nearest even, as torch does",
    )
    parser.add_argument(
        "--expert-quantization",
        choices=KINDS,
        default=None,
        help="store the routed experts quantized (symmetric, one scale per group of inputs, int4 packed two "
        "to a byte); dense weights, routers and shared experts keep --dtype. load_model then serves them "
        "quantized without quantizing again (default: experts in --dtype)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="inputs sharing one scale; must divide hidden_size and the expert intermediate size "
        "(default with --expert-quantization: 64)",
    )
    parser.add_argument("--untie", action="store_true", help="use lm_head.weight though config.json ties it")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR if it exists (only an earlier fmoe-convert checkpoint or an empty directory; "
        "the old one is removed only after the new one is complete)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no summary line (errors still print)"
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {fmoe_jax.__version__} (writes checkpoint format {FORMAT_NAME} {FORMAT_VERSION})",
    )
    return parser


def _verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} verify",
        description="Check a checkpoint written by fmoe-convert: the size and sha256 of every file against "
        "its manifest, and that every orbax item restores with the shapes config.json implies. Exits "
        "non-zero with one line naming the first problem.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the converted checkpoint directory")
    parser.add_argument(
        "--against",
        metavar="HF_DIR",
        default=None,
        help="also compare every tensor, streamed one layer at a time, with this Hugging Face directory "
        "cast to the checkpoint's dtype (they must be bit-identical)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary line")
    return parser


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and err.filename:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def _polling(fn: Callable, poll: Callable[[], None]) -> Callable:
    def wrapped(*args):
        fn(*args)
        poll()

    return wrapped


class _Signals:
    """SIGINT and SIGTERM become a request honoured at the next safe point (`poll`): between tensors, after
    each item, every 0.2 s of hashing. The handler itself never raises. An exception raised wherever the
    main thread happens to be is not safe in orbax's and tensorstore's code: raised inside a lock or a
    condition wait of their save it left "release unlocked lock" as the run's error, and once a process
    that never exited (a thread the save left waiting, joined at shutdown; CI of stop 41). So a second
    Ctrl-C does not hurry the stop, which comes after the item being written, seconds at most. Unless
    `quiet`, the first signal says so on stderr. Once `finished`, signals are only noted: the outcome is
    being reported."""

    def __init__(self, quiet: bool = True) -> None:
        self.received: int | None = None
        self.finished = False
        self.quiet = quiet
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        first = self.received is None
        self.received = signum
        if first and not self.finished and not self.quiet:
            # os.write, not print: the handler may run while the main thread is inside a print to stderr
            os.write(2, f"\n{PROG}: stopping after the item being written\n".encode())

    def poll(self) -> None:
        if self.received is not None and not self.finished:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _quiet_background_failures() -> Iterator[None]:
    """Keeps what orbax's and tensorstore's threads print when a write fails or is interrupted off the
    terminal: absl ERROR logs with tracebacks, "Event loop is closed" from callbacks that outlive their
    asyncio loop (reported through `sys.unraisablehook`), and warnings about the coroutines of an abandoned
    save, and asyncio's "Task was destroyed but it is pending!" for the tasks of that save. The failure
    itself reaches `main` as an exception and is reported there in one line. Only the command does this,
    for its own process; `convert` does not."""
    absl, aio = logging.getLogger("absl"), logging.getLogger("asyncio")
    level, aio_level, unraisablehook = absl.level, aio.level, sys.unraisablehook
    absl.setLevel(logging.CRITICAL)
    aio.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
            yield
    finally:
        gc.collect()  # the abandoned save's tasks, if nothing holds them any more, go while we are quiet
        absl.setLevel(level)
        aio.setLevel(aio_level)
        sys.unraisablehook = unraisablehook


def _run(args: argparse.Namespace, is_verify: bool, progress: bool, poll: Callable[[], None]) -> str:
    """Runs the command; returns its summary line."""
    if is_verify:
        return verify(args.out_dir, against=args.against, progress=progress, poll=poll)
    manifest, seconds = convert(
        args.hf_dir,
        args.out_dir,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=progress,
        poll=poll,
        expert_quantization=args.expert_quantization,
        group_size=args.group_size,
        untie=args.untie,
    )
    source_bytes = sum(r.size for r in manifest.source_files.values())
    note = HFCheckpoint(args.hf_dir, untie=args.untie).not_converted_note
    return (
        f"{args.out_dir}: {manifest.family}, {manifest.num_layers} layers x {manifest.num_experts} experts, "
        f"{_stored_as(manifest)}, {manifest.param_bytes / 1e9:.2f} GB written in {seconds:.1f} s "
        f"({source_bytes / 1e6 / seconds:.0f} MB/s of source)" + (f"\n{note}" if note else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `fmoe-convert`; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted).

    Whatever goes wrong with the input or the output ends in one line on stderr, never a traceback."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    is_verify = bool(argv) and argv[0] == "verify"
    parser = _verify_parser() if is_verify else _convert_parser()
    try:
        args = parser.parse_args(argv[1:] if is_verify else argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    progress = not args.quiet and sys.stderr.isatty()
    with _Signals(quiet=args.quiet) as signals, _quiet_background_failures():
        try:
            summary, status = _run(args, is_verify, progress, signals.poll), 0
        except KeyboardInterrupt:
            summary, status = "interrupted" + ("" if is_verify else "; nothing was written"), 130
        except (CheckpointError, UnsupportedConfigError, ConvertError, Interrupted, OSError) as err:
            summary, status = f"error: {_message(err)}", 1
        signals.finished = True
        left = None if is_verify else work_dir(Path(args.out_dir).absolute())
        if status and left is not None and (left.exists() or left.is_symlink()):
            summary = summary.replace("; nothing was written", "")
            summary += f"; its work directory {left} could not be removed: delete it yourself"
        if status:
            print(f"{PROG}: {summary}", file=sys.stderr)
        elif not args.quiet:
            print(summary)
    if status:
        # The process ends now. Tasks of an abandoned save that a background thread still held are
        # destroyed at exit, and asyncio would log each after the one line above.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if from_command_line and threading.current_thread() is threading.main_thread():
        # The outcome is reported and the command returns to exit: a Ctrl-C pressed now would only make the
        # interpreter's shutdown print a KeyboardInterrupt traceback after that line (seen under load).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status
