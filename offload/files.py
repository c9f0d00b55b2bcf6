"""Writing a file whole or not at all: readers never see half of one, and concurrent writers of the same path
(two benchmark processes recording the same traces, say) never collide on a shared temporary name."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Calls `write` on a fresh temporary file beside `path`, flushes it to disk, then renames it over
    `path`; on any error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(path: str | os.PathLike) -> str | None:
    """Why `write_atomically(path, ...)` would fail before it wrote anything, in a few words (`path` a
    directory, its folder missing, a folder this process may not write to), or None: checked up front by
    those who write only at the end of long work, so that the work is not lost to a bad path."""
    path = Path(path)
    if path.is_dir():
        return "is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"its folder {parent} does not exist"
    try:  # a probe file: the file system answers, not the permission bits as os.access reads them
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as err:
        return f"cannot write to {parent} ({err.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None
