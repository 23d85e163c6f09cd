"""Checkpoints of the server state: a publishable part and a secret part, committed together atomically.

    <folder>/checkpoint.json            the commit record: which round is saved, and its two files
    <folder>/checkpoint-<round>.pt      publishable: model, optimizer state, ε ledger, ζ_t, engine records
    <folder>/secret/                    mode 0700, files mode 0600: never publish or send anywhere
        noise-<round>.pt                the noise stream (source state, BandMF buffer), the sampler (every
                                        cohort), the clip-bit noise; whoever holds it can remove the noise;
                                        and the records' exact counts (``nonprivate_*`` of a simulation)
        diagnostics.jsonl               per-round operator diagnostics computed from users' data outside the
                                        accounted mechanism (cohort sizes, replies, clipped counts, the
                                        round's duration, which grows with the cohort), in every engine
        operator.log                    the same, as log lines: which nodes' sampled users were dropped and
                                        why (no reply, late, malformed), which setting to change

Saving round t writes both files of round t (each to a temporary file, fsync'ed, then renamed), and only then
replaces ``checkpoint.json`` — the commit point — and removes the files of earlier rounds. A crash at any
moment leaves the previous commit whole; a resume reads the commit record, so the public and the secret part
always come from the same round. A resumed run continues the ledger (never restarting ε at 0), continues the
noise stream (never reusing a noise vector) and draws the cohorts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fed_dp.atomic import write_atomically
from fed_dp.round import ServerState

COMMIT_NAME = "checkpoint.json"
PUBLISHED_NAME = "published.json"
SECRET_FOLDER = "secret"
DIAGNOSTICS_NAME = "diagnostics.jsonl"
OPERATOR_LOG_NAME = "operator.log"
FORMAT = "fed-dp/server-checkpoint"
VERSION = 2


def public_name(round_index: int) -> str:
    return f"checkpoint-{round_index:06d}.pt"


def secret_name(round_index: int) -> str:
    return f"noise-{round_index:06d}.pt"


def secret_folder(folder: str | os.PathLike) -> Path:
    """``folder/secret``, created with mode 0700 (owner only)."""
    path = Path(folder) / SECRET_FOLDER
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _save(path: Path, payload: dict[str, Any], mode: int | None = None) -> None:
    write_atomically(path, lambda handle: torch.save(payload, handle), mode=mode)


def save_checkpoint(state: ServerState, folder: str | os.PathLike, extra: dict[str, Any] | None = None,
                    secret_extra: dict[str, Any] | None = None) -> Path:
    """Commit round ``state.round``: both parts written, then ``checkpoint.json``; returns the public file.

    ``extra`` holds engine data (e.g. the published records so far) and goes into the public part;
    ``secret_extra`` (e.g. the records' exact counts) into the secret part."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    secret = secret_folder(folder)
    t = state.round
    public_path = folder / public_name(t)
    _save(public_path, {"format": FORMAT, "version": VERSION, "state": state.state_dict(), "extra": extra or {}})
    _save(secret / secret_name(t), {"format": FORMAT, "version": VERSION, "secret": state.secret_state_dict(),
                                    "extra": secret_extra or {}}, mode=0o600)
    commit = {"format": FORMAT, "version": VERSION, "round": t, "public": public_path.name,
              "secret": f"{SECRET_FOLDER}/{secret_name(t)}"}
    write_atomically(folder / COMMIT_NAME, lambda handle: handle.write(json.dumps(commit).encode()))
    for stale in [*folder.glob("checkpoint-*.pt"), *secret.glob("noise-*.pt")]:
        if stale.name not in (public_name(t), secret_name(t)):
            stale.unlink(missing_ok=True)
    return public_path


def _commit(folder: Path) -> dict[str, Any] | None:
    path = folder / COMMIT_NAME
    if not path.exists():
        return None
    try:
        commit = json.loads(path.read_text())
    except json.JSONDecodeError:
        commit = None
    if not isinstance(commit, dict) or commit.get("format") != FORMAT or commit.get("version") != VERSION:
        raise ValueError(f"{path} is not a fed-dp checkpoint record of version {VERSION}; move the folder away "
                         "to start afresh")
    return commit


def _load(path: Path) -> dict[str, Any]:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise ValueError(f"{path} is not a fed-dp server checkpoint of version {VERSION}; move it away to start afresh")
    return payload


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The publishable part of the committed checkpoint (``{"state", "extra", ...}``), or None when none."""
    commit = _commit(Path(folder))
    return None if commit is None else _load(Path(folder) / commit["public"])


def load_secret(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The secret part of the committed checkpoint, or None when none."""
    commit = _commit(Path(folder))
    return None if commit is None else _load(Path(folder) / commit["secret"])["secret"]


def resume(state: ServerState, folder: str | os.PathLike) -> dict[str, Any] | None:
    """Restore ``state`` from ``folder``'s committed checkpoint when there is one; returns its ``extra``.

    The state must be built from the same configuration (checked: a checkpoint of another privacy
    configuration is refused, so a ledger can never be continued under different accounting)."""
    restored = resume_with_secret(state, folder)
    return None if restored is None else restored[0]


def resume_with_secret(state: ServerState, folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """:func:`resume`, returning the public ``extra`` and the ``secret_extra`` of the committed checkpoint."""
    commit = _commit(Path(folder))
    if commit is None:
        return None
    public, secret = _load(Path(folder) / commit["public"]), _load(Path(folder) / commit["secret"])
    state.load_state_dict(public["state"], secret["secret"])
    return public["extra"], secret.get("extra", {})


def mark_published(folder: str | os.PathLike, round_index: int) -> None:
    """Record that round ``round_index``'s record was handed out (logged, evaluated, passed to the caller)."""
    write_atomically(Path(folder) / PUBLISHED_NAME, lambda handle: handle.write(json.dumps({"round": round_index}).encode()))


def last_published(folder: str | os.PathLike) -> int:
    """The last round whose record was handed out (−1 when none), so that a resume hands out a committed round
    exactly once even when the server died between committing it and handing it out."""
    path = Path(folder) / PUBLISHED_NAME
    return int(json.loads(path.read_text())["round"]) if path.exists() else -1


def append_diagnostics(folder: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one round's operator diagnostics to ``secret/diagnostics.jsonl`` (mode 0600)."""
    path = secret_folder(folder) / DIAGNOSTICS_NAME
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
    os.chmod(path, 0o600)


def operator_log_file(folder: str | os.PathLike) -> Path:
    """``secret/operator.log``, created (empty) with mode 0600 if it does not exist."""
    path = secret_folder(folder) / OPERATOR_LOG_NAME
    path.touch(mode=0o600, exist_ok=True)
    os.chmod(path, 0o600)
    return path


def read_diagnostics(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The operator diagnostics written so far (one record per round; a resumed run may repeat a round that
    crashed before its commit, the last record of a round is the one that was committed)."""
    path = Path(folder) / SECRET_FOLDER / DIAGNOSTICS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
