"""Atomic file writes: write a temporary file in the target folder, fsync it, then ``os.replace`` it.

A crash mid-write leaves the previous file (or none), never a truncated one, but it may leave the temporary
file (``<name>.<random>.tmp``, possibly a whole model or noise state): :func:`remove_temporaries` removes those
of a folder's files when the program that writes them starts again. Used for checkpoints and the BandMF
strategy cache. A write that fails (a full disk) is reported by :func:`reporting_writes` as a :class:`WriteError`
that says what became of the work.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


class WriteError(OSError):
    """A write that failed (a full disk, a folder made read-only), with a message that names the file, the cause
    and what became of the work and what to do; ``errno``, ``strerror`` and ``filename`` are the failed write's.
    The commands print it on one line and exit 1."""

    def __str__(self) -> str:
        return str(self.args[0])  # the message, not OSError's "[Errno …] strerror: filename"


@contextmanager
def reporting_writes(what: str, where: str | os.PathLike, kind: type[WriteError] = WriteError) -> Iterator[None]:
    """Turn an OSError of the block into ``kind`` (a :class:`WriteError`) whose message is ``could not write FILE
    (CAUSE): what``: FILE the failed write's, or ``where`` (the folder written to) when the error names none (a
    full disk is often found when a file is closed); ``what`` says what became of the work and what to do."""
    try:
        yield
    except WriteError:
        raise
    except OSError as error:
        failed = kind(f"could not write {error.filename or where} ({error.strerror or error}): {what}")
        failed.errno, failed.strerror, failed.filename = error.errno, error.strerror, error.filename or str(where)
        raise failed from error


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
