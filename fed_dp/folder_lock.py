"""One run at a time per checkpoint folder: a lock the operating system releases when its holder dies.

Two runs started on one checkpoint folder would each sample, noise and release every round while the folder's
ledger showed the ε of one of them: half of what was spent would be hidden. So the round loop
(``fed_dp.round_loop.run_rounds``) owns its folder for as long as it runs:

    <folder>/run.lock     flock(2)-ed by the run that owns the folder; holds that run's pid, host, program and
                          start time (JSON), which a second run's error names

The lock is ``fcntl.flock`` on an open file: the kernel drops it when the holding process exits in any way —
a normal end, an exception, SIGKILL, a crash — so a lock left by a dead run never blocks the next one and nothing
has to be cleaned up by hand (the file stays, with the last holder's details, and is reused). The file is never
deleted: deleting it while a second run waits to lock it would let a third run lock a new file of the same name.

A second attempt on a held folder fails at once (no waiting) with :class:`FolderInUseError` (a ``ValueError``:
the configuration named a folder that is in use), before anything of the second run is resumed or released. The
lock is per open file, so a second attempt from the same process is refused as one from another process is.
It protects runs on one machine, or on several machines sharing a file system whose locks are kept by the server
(NFS v4, Lustre, most cluster file systems); a file system that offers no locks is refused with a message.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK_NAME = "run.lock"


class FolderInUseError(ValueError):
    """The checkpoint folder is owned by another run (``holder``: its pid, host, program and start time, as
    far as that run wrote them)."""

    def __init__(self, folder: Path, holder: dict[str, Any]) -> None:
        self.folder, self.holder = folder, holder
        lock = folder / LOCK_NAME
        if "pid" in holder:
            who = f"({_describe(holder)})"
            stop = (f"Wait for it to end, or stop it (kill {holder['pid']} on {holder.get('host', 'its host')}) and "
                    "start this run again to resume from the folder")
        else:  # it has locked the file but not written its details yet
            who, stop = "(which is starting)", "Wait for it to end"
        super().__init__(
            f"the checkpoint folder {folder} is in use by another run {who}: two runs on one folder would both "
            f"release every round while its ledger showed the ε of one. {stop}; for a separate run, give another "
            f"folder (server.checkpoint-dir, checkpoint_dir). The lock is {lock}: the system releases it when its "
            f"holder exits, so if that process is gone, one it started still holds it (fuser -v {lock} names it)")


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, {holder.get('program', 'a program')}, started {when}"


def _holder(handle: int) -> dict[str, Any]:
    """What the holder wrote in the lock file (``{}`` when it has not yet, or wrote something else)."""
    try:
        data = json.loads(os.pread(handle, 4096, 0).decode("utf-8") or "{}")
    except (ValueError, OSError):
        return {}
    return data if isinstance(data, dict) else {}


@contextmanager
def owning(folder: str | os.PathLike) -> Iterator[Path]:
    """Own ``folder`` (created if missing) while the block runs: the lock of the module docstring, released when
    the block ends (and by the system if the process dies first). Raises :class:`FolderInUseError` when another
    run owns it, and ``ValueError`` naming the folder when it cannot be created or written, or its file system
    has no locks."""
    import fcntl  # POSIX; imported here so that fed_dp imports where it is absent

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise _unusable(folder, error) from error
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUseError(folder, _holder(handle)) from None
        except OSError as error:
            raise ValueError(f"the checkpoint folder {folder} cannot be locked ({error.strerror}): its file system "
                             "offers no file locks, so fed-dp cannot make sure that a single run uses it. Give a "
                             "folder on a local file system (server.checkpoint-dir, checkpoint_dir)") from error
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "program": Path(sys.argv[0]).name or "python",
                  "started": time.time()}
        try:
            os.ftruncate(handle, 0)
            os.pwrite(handle, json.dumps(holder).encode("utf-8"), 0)
        except OSError as error:  # a full disk, before anything of the run
            raise _unusable(folder, error) from error
        yield folder
    finally:
        os.close(handle)  # closing the last descriptor of the open file releases the flock


def _unusable(folder: Path, error: OSError) -> ValueError:
    """The error of a checkpoint folder that cannot be created or written (read-only, a full disk)."""
    return ValueError(f"the checkpoint folder {folder} cannot be used: {error.strerror} ({error.filename or folder}). "
                      "Give a folder this process can create and write, on a disk with free space "
                      "(server.checkpoint-dir, checkpoint_dir)")

