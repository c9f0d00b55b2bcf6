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
