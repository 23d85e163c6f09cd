"""Atomic file writes: write a temporary file in the target folder, fsync it, then ``os.replace`` it.

A crash mid-write leaves the previous file (or none), never a truncated one. Used for checkpoints and
the BandMF strategy cache.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], None], *, mode: int | None = None) -> Path:
    """Call ``write(binary_handle)`` on a temporary file and move it to ``path`` atomically; ``mode`` sets its
    permissions before any byte is written (0o600 for secrets: never readable by others, not even briefly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False)
    try:
        with handle:
            if mode is not None:
                os.chmod(handle.name, mode)
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return path
