"""Where `fmoe-convert` writes: checks on OUT_DIR, the hidden work directory beside it, and the final swap.

`fmoe_jax.convert.cli.convert` calls these; they never delete anything fmoe-convert did not write.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from fmoe_jax.checkpoint.hf import CheckpointError
from fmoe_jax.checkpoint.manifest import MANIFEST_NAME, listed_files

PROG = "fmoe-convert"
TMP_TAG, OLD_TAG = ".fmoe-tmp-", ".fmoe-old-"
REMOVE_TIMEOUT_S = 10.0
SPACE_MARGIN_BYTES = 64 << 20  # orbax metadata, OCDBT indices, copied side files


class ConvertError(Exception):
    """The conversion cannot start or finish for a reason the user can fix (the message says which)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def work_dir(out_dir: Path) -> Path:
    """The hidden directory beside OUT_DIR that this process writes the checkpoint into."""
    return out_dir.parent / f".{out_dir.name}{TMP_TAG}{os.getpid()}"


def remove_tree(path: Path) -> bool:
    """Removes a directory; returns whether it is gone.

    Writer threads of an aborted orbax save may still create files in it for a moment, so removal is
    retried until the directory stays away (for at most `REMOVE_TIMEOUT_S`). A Ctrl-C meanwhile does not
    stop it: pressing Ctrl-C twice must not leave the work directory behind. Nor does an `OSError` that
    escapes `rmtree` (its own clean-up of directory descriptors, cut by a Ctrl-C, once raised EBADF here,
    which replaced the interrupt and left the directory): the next try starts afresh.
    """
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    while True:
        try:
            shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.05)
            if not (path.exists() or path.is_symlink()):
                return True
            if time.monotonic() > deadline:
                return False
        except (KeyboardInterrupt, OSError):
            if time.monotonic() > deadline:
                return False
            continue


def remove_stale(parent: Path, name: str) -> None:
    """Removes work directories of earlier conversions to the same OUT_DIR whose process is gone."""
    for tag in (TMP_TAG, OLD_TAG):
        for path in parent.glob(f".{name}{tag}*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                remove_tree(path)


def check_destination(out_dir: Path, overwrite: bool) -> None:
    parent = out_dir.parent
    if not parent.is_dir():
        raise ConvertError(f"{parent}: not an existing directory (the parent of OUT_DIR must exist)")
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if not overwrite:
        raise ConvertError(f"{out_dir}: already exists; pass --overwrite to replace it")
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise ConvertError(f"{out_dir}: exists and is not a directory; refusing to replace it")
    check_replaceable(out_dir)


def check_replaceable(out_dir: Path) -> None:
    """Raises `ConvertError` unless `out_dir` is empty or a checkpoint fmoe-convert wrote: a manifest of our
    format whose file list covers every file present. Anything else would be lost by `--overwrite`."""
    if not any(out_dir.iterdir()):
        return
    if not (out_dir / MANIFEST_NAME).exists():
        reason = f"it is not empty and has no {MANIFEST_NAME}, so fmoe-convert did not write it"
    else:
        try:
            listed = listed_files(out_dir)
        except CheckpointError as err:
            listed, reason = None, str(err)
        if listed is not None:
            unlisted = unlisted_files(out_dir, set(listed) | {MANIFEST_NAME})
            if not unlisted:
                return
            more = f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else ""
            reason = f"it holds files its {MANIFEST_NAME} does not list: {', '.join(unlisted[:5])}{more}"
    raise ConvertError(
        f"{out_dir}: not replaced: {reason}. --overwrite replaces only a checkpoint written by "
        f"{PROG}, to lose nothing else; remove the directory yourself or choose another OUT_DIR"
    )


def unlisted_files(directory: Path, listed: set[str]) -> list[str]:
    """Everything below `directory` but directories (files, links, sockets...) whose path is not `listed`."""

    def fail(err: OSError) -> None:
        raise ConvertError(
            f"{err.filename}: cannot be listed ({err.strerror}); refusing to replace {directory}"
        )

    found = []
    for root, dirs, files in os.walk(directory, onerror=fail):
        links = [name for name in dirs if os.path.islink(os.path.join(root, name))]
        for name in files + links:
            relative = Path(root, name).relative_to(directory).as_posix()
            if relative not in listed:
                found.append(relative)
    return sorted(found)


def check_space(parent: Path, needed: int) -> None:
    free = shutil.disk_usage(parent).free
    if free < needed + SPACE_MARGIN_BYTES:
        raise ConvertError(
            f"{parent}: not enough free disk space: the checkpoint needs about "
            f"{(needed + SPACE_MARGIN_BYTES) / 1e9:.2f} GB, {free / 1e9:.2f} GB are free"
        )


def install(tmp: Path, out_dir: Path) -> None:
    """Moves the finished checkpoint into place; an existing OUT_DIR is swapped out, then deleted."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    check_replaceable(out_dir)  # again: files may have been added to it while converting
    old = out_dir.parent / f".{out_dir.name}{OLD_TAG}{os.getpid()}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    remove_tree(old)
