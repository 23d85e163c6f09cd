"""Atomic file writes: write a temporary file in the target folder, fsync it, then ``os.replace`` it.

A crash mid-write leaves the previous file (or none), never a truncated one, but it may leave the temporary
file (``<name>.<random>.tmp``, possibly a whole model or noise state): :func:`remove_temporaries` removes those
of a folder's files when the program that writes them starts again. Used for checkpoints and the BandMF
strategy cache.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


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


def write_json_atomically(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """``payload`` as indented JSON (UTF-8) at ``path``, written atomically (:func:`write_atomically`)."""
    return write_atomically(path, lambda handle: handle.write(json.dumps(payload, indent=1).encode("utf-8")))


def remove_temporaries(folder: str | os.PathLike, name_pattern: str) -> list[Path]:
    """Remove the temporary files that an interrupted :func:`write_atomically` left in ``folder`` for targets
    whose names match the glob ``name_pattern``; returns them. Only when no write to them can be under way."""
    stale = sorted(Path(folder).glob(f"{name_pattern}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
