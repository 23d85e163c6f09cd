"""Atomic checkpoints of the whole server state, and resuming from them.

A checkpoint holds everything a run needs to continue exactly (``ServerState.state_dict``): the model,
the optimizer state, the privatizer (round index, ring buffer, generator state), the sampler (seed, round
count, generator state), the ledger and the round index. It is written to a temporary file in the same
folder and moved into place with ``os.replace``, so a crash mid-write leaves the previous checkpoint.

A resumed run continues the ledger (never restarting ε at 0), continues the noise stream (never reusing a
noise vector) and draws the same cohorts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fed_dp.atomic import write_atomically
from fed_dp.round import ServerState

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT = "fed-dp/server-checkpoint"
VERSION = 1


def save_checkpoint(state: ServerState, folder: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write ``folder/checkpoint.pt`` atomically; ``extra`` holds engine data (e.g. the metrics so far)."""
    payload = {"format": FORMAT, "version": VERSION, "state": state.state_dict(), "extra": extra or {}}
    return write_atomically(Path(folder) / CHECKPOINT_NAME, lambda handle: torch.save(payload, handle))


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The saved payload of ``folder/checkpoint.pt``, or None when there is none."""
    path = Path(folder) / CHECKPOINT_NAME
    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise ValueError(f"{path} is not a fed-dp server checkpoint of version {VERSION}; move it away to start afresh")
    return payload


def resume(state: ServerState, folder: str | os.PathLike) -> dict[str, Any] | None:
    """Restore ``state`` from ``folder``'s checkpoint when there is one; returns its ``extra`` (or None).

    The state must be built from the same configuration (checked: a checkpoint of another privacy
    configuration is refused, so a ledger can never be continued under different accounting).
    """
    payload = load_checkpoint(folder)
    if payload is None:
        return None
    state.load_state_dict(payload["state"])
    return payload["extra"]
