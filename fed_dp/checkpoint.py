"""Checkpoints of the server state: a publishable part and a secret part, committed together atomically.

    <folder>/checkpoint.json            the commit record: which round is saved, and its two files
    <folder>/checkpoint-<round>.pt      publishable: model, optimizer state, ε ledger, ζ_t, engine records
                                        and the run's description a resume must match (``fed_dp.run_setup``)
                                        (<round>: t, the rounds released, 000001 after the first)
    <folder>/published.json             the last round handed out (t) and its record as published
    <folder>/run.lock                   the lock of the run that owns the folder (``fed_dp.folder_lock``)
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

No lost or damaged file can make a run start afresh and spend the budget again: ``checkpoint.json`` records
each part's SHA-256, checked on load (a damaged, truncated or missing part is an error naming the file); files
of a committed round without ``checkpoint.json`` refuse to start. When a run starts it removes the temporary
files (``<name>.<random>.tmp``) that writes interrupted by a crash left.

A damaged ``checkpoint.json`` or ``published.json`` is an error naming the file and what to do; a torn last line of
``secret/diagnostics.jsonl`` (a process killed during its append) is cut off when a run starts
(:func:`repair_diagnostics`).

Rounds are numbered t = 1 … T everywhere (file names, records, the ledger, ``published.json``); checkpoints of
version 3, whose records and ledger counted from 0, are refused with a message saying so (:data:`OLDER_VERSIONS`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from fed_dp.atomic import remove_temporaries, write_atomically
from fed_dp.config import PrivacyConfig
from fed_dp.folder_lock import owning
from fed_dp.round import ServerState
from fed_dp.run_setup import SETUP_KEY, check_resume

COMMIT_NAME = "checkpoint.json"
PUBLISHED_NAME = "published.json"
SECRET_FOLDER = "secret"
DIAGNOSTICS_NAME = "diagnostics.jsonl"
OPERATOR_LOG_NAME = "operator.log"
FORMAT = "fed-dp/server-checkpoint"
VERSION = 4  # 3: checkpoint.json records each part's SHA-256; 4: records and the ledger number rounds 1 … T
#: Versions this fed-dp refuses with their own reason (they are fed-dp checkpoints, not other files).
OLDER_VERSIONS = {3: "its records, published.json and ledger number rounds from 0, this version numbers them "
                     "1 … T (round t is the t-th release)"}
RESULTS_NAME = "results.json"


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


def _save(path: Path, payload: dict[str, Any], mode: int | None = None) -> str:
    """Write ``payload`` atomically; returns the SHA-256 of the bytes written, which the commit records."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    write_atomically(path, lambda handle: handle.write(data), mode=mode)
    return hashlib.sha256(data).hexdigest()


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
    checksums = {
        "public": _save(public_path, {"format": FORMAT, "version": VERSION, "state": state.state_dict(),
                                      "extra": extra or {}}),
        "secret": _save(secret / secret_name(t), {"format": FORMAT, "version": VERSION,
                                                  "secret": state.secret_state_dict(), "extra": secret_extra or {}},
                        mode=0o600),
    }
    commit = {"format": FORMAT, "version": VERSION, "round": t, "public": public_path.name,
              "secret": f"{SECRET_FOLDER}/{secret_name(t)}", "sha256": checksums}
    write_atomically(folder / COMMIT_NAME, lambda handle: handle.write(json.dumps(commit).encode()))
    for stale in [*folder.glob("checkpoint-*.pt"), *secret.glob("noise-*.pt")]:
        if stale.name not in (public_name(t), secret_name(t)):
            stale.unlink(missing_ok=True)
    return public_path


def _unrecorded(folder: Path) -> list[Path]:
    """Files of a run that has committed a round, in a folder without ``checkpoint.json``. The parts of round 1
    alone are not among them: they are what a crash before the first commit leaves (nothing released yet);
    once round 1 is committed, ``secret/diagnostics.jsonl`` exists too."""
    first = {public_name(1), secret_name(1)}
    parts = [*folder.glob("checkpoint-*.pt"), *(folder / SECRET_FOLDER).glob("noise-*.pt")]
    return sorted([p for p in parts if p.name not in first]
                  + [p for p in (folder / PUBLISHED_NAME, folder / SECRET_FOLDER / DIAGNOSTICS_NAME) if p.exists()])


def _commit(folder: Path) -> dict[str, Any] | None:
    path = folder / COMMIT_NAME
    if not path.exists():
        orphans = _unrecorded(folder)
        if orphans:
            raise ValueError(
                f"{folder} holds files of a run that has released rounds ({', '.join(p.name for p in orphans)}) but "
                f"no {COMMIT_NAME}, the record of which round they belong to; starting afresh would spend the privacy "
                f"budget again and forget the rounds already released. Restore {COMMIT_NAME} from a backup of the "
                "folder; start afresh (in another folder) only if none of its rounds was ever published")
        return None
    try:
        commit = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is damaged ({error}): it records which round is committed. Restore it from a backup "
                         "of the folder; do not start afresh, which would spend the privacy budget again and forget "
                         "the rounds already released") from error
    if isinstance(commit, dict) and commit.get("format") == FORMAT and commit.get("version") in OLDER_VERSIONS:
        raise ValueError(_older(path, commit["version"]))
    if not isinstance(commit, dict) or commit.get("format") != FORMAT or commit.get("version") != VERSION \
            or not isinstance(commit.get("sha256"), dict):
        raise ValueError(f"{path} is not a fed-dp checkpoint record of version {VERSION}; move the folder away "
                         "to start afresh")
    return commit


def _older(path: Path, version: int) -> str:
    """Why a checkpoint of an older fed-dp is not resumed, and what to do."""
    return (f"{path} was written by an older fed-dp (checkpoint version {version}): {OLDER_VERSIONS[version]}, so "
            f"it cannot resume it. Finish that run with the fed-dp version that started it; start afresh in another "
            "folder only if none of its rounds was ever published (starting afresh spends the privacy budget again)")


def _load(folder: Path, commit: dict[str, Any], part: str) -> dict[str, Any]:
    """The ``part`` ("public" or "secret") of the commit, after checking its SHA-256 against the record."""
    path = folder / commit[part]
    keep = ("do not start afresh, which would spend the privacy budget again and forget the rounds already "
            "released")
    if not path.exists():
        raise ValueError(f"{path} is missing, but {folder / COMMIT_NAME} records it as the {part} part of round "
                         f"{commit['round']}: restore it from a backup of the folder; {keep}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != commit["sha256"].get(part):
        raise ValueError(f"{path} is damaged or truncated: its SHA-256 differs from the one {COMMIT_NAME} recorded "
                         f"when round {commit['round']} was committed. Restore it from a backup of the folder; {keep}")
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise ValueError(f"{path} is not a fed-dp server checkpoint of version {VERSION}; move it away to start afresh")
    return payload


def committed_round(folder: str | os.PathLike) -> int:
    """The round committed in ``folder`` (t, the rounds released; 0 when nothing is committed), from the commit
    record alone; ValueError when it is damaged or missing beside files of released rounds (as a resume would)."""
    commit = _commit(Path(folder))
    return 0 if commit is None else int(commit["round"])


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The publishable part of the committed checkpoint (``{"state", "extra", ...}``), or None when none."""
    commit = _commit(Path(folder))
    return None if commit is None else _load(Path(folder), commit, "public")


def load_secret(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The secret part of the committed checkpoint, or None when none."""
    commit = _commit(Path(folder))
    return None if commit is None else _load(Path(folder), commit, "secret")["secret"]


def resume(state: ServerState, folder: str | os.PathLike) -> dict[str, Any] | None:
    """Restore ``state`` from ``folder``'s committed checkpoint when there is one; returns its ``extra``.

    The state must be built from the same configuration (checked: a checkpoint of another privacy
    configuration is refused, so a ledger can never be continued under different accounting)."""
    restored = resume_with_secret(state, folder)
    return None if restored is None else restored[0]


def resume_with_secret(state: ServerState, folder: str | os.PathLike, setup: dict[str, Any] | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """:func:`resume`, returning the public ``extra`` and the ``secret_extra`` of the committed checkpoint.
    ``setup``: the new run's description (``fed_dp.run_setup.describe_run``), compared with the recorded one
    together with the privacy configuration before anything is restored (``fed_dp.run_setup.check_resume``).

    Called when a run starts: it first removes the temporary files of writes that a crash interrupted."""
    folder = Path(folder)
    remove_stale_temporaries(folder)
    commit = _commit(folder)
    if commit is None:
        return None
    public, secret = _load(folder, commit, "public"), _load(folder, commit, "secret")
    check_resume(folder, PrivacyConfig(**public["state"]["ledger"]["config"]), public["extra"].get(SETUP_KEY),
                 state.config, setup)
    state.load_state_dict(public["state"], secret["secret"])
    return public["extra"], secret.get("extra", {})


def recorded_run(folder: str | os.PathLike) -> tuple[PrivacyConfig, dict[str, Any] | None] | None:
    """The privacy configuration and the description (``fed_dp.run_setup``; None in a checkpoint written before
    descriptions were recorded) of the run committed in ``folder``, or None when it holds no checkpoint: what an
    engine reads before it builds the model (the seed an unseeded run drew, to resume with it) and an experiment
    runner before it writes anything. Read while owning the folder (``fed_dp.folder_lock``), so that a run writing
    it is named (``FolderInUseError``) instead of being read half-way."""
    folder = Path(folder)
    if not (folder / COMMIT_NAME).exists():
        return None
    with owning(folder):
        saved = load_checkpoint(folder)
    if saved is None:
        return None
    return PrivacyConfig(**saved["state"]["ledger"]["config"]), saved["extra"].get(SETUP_KEY)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove what interrupted atomic writes left of the checkpoint folder's files (whole models, noise states):
    only when the run that writes them starts, never while one may be writing."""
    folder = Path(folder)
    names = ("checkpoint-*.pt", COMMIT_NAME, PUBLISHED_NAME, RESULTS_NAME)
    return [*(path for name in names for path in remove_temporaries(folder, name)),
            *remove_temporaries(folder / SECRET_FOLDER, "noise-*.pt")]


def mark_published(folder: str | os.PathLike, record: dict[str, Any]) -> None:
    """Record, atomically, that round ``record["round"]`` is published, with its record as published (evaluation
    included; public keys only): written before the record is handed out, so that the evaluation is durable
    before the round counts as published and a crash never hands a round out twice."""
    text = json.dumps({"round": record["round"], "record": record}, default=str)
    write_atomically(Path(folder) / PUBLISHED_NAME, lambda handle: handle.write(text.encode()))


def read_published(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The last published round's ``{"round", "record"}`` (None when none), so that a resume never hands out a
    round twice, and restores the evaluation of the round published last, which the commit of that round does
    not hold (it is evaluated after its commit)."""
    path = Path(folder) / PUBLISHED_NAME
    if not path.exists():
        return None
    try:
        published = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        published = error
    if not (isinstance(published, dict) and isinstance(published.get("round"), int)
            and isinstance(published.get("record"), dict)):
        reason = f"not valid JSON: {published}" if isinstance(published, Exception) else "not a record of a round"
        raise ValueError(
            f"{path} is damaged ({reason}). It records the last round handed out, with its evaluation. Restore it "
            f"from a backup of the folder, or delete it to resume: the last committed round is then evaluated and "
            "handed out again (the same released model: no privacy budget is spent)")
    return published


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
    crashed before its commit, the last record of a round is the one that was committed). A last line without
    its end of line is a torn append (the process died while writing it) and is left out; any other line that is
    not a JSON record is an error naming the file and the line."""
    path = Path(folder) / SECRET_FOLDER / DIAGNOSTICS_NAME
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")[:-1]  # the part after the last end of line is a torn append, or empty
    records = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}, is not a JSON record of a round: the file is damaged. It is "
                             "the operator's record of past rounds and a run does not need it: move it aside (or cut "
                             "the line) to resume, the committed round's diagnostics are written again")
        records.append(record)
    return records


def repair_diagnostics(folder: str | os.PathLike) -> bool:
    """Cut a torn last line (an append the process died in) off ``secret/diagnostics.jsonl``, so that the next
    append starts a line of its own; True when there was one. Only when a run starts, before it appends."""
    path = Path(folder) / SECRET_FOLDER / DIAGNOSTICS_NAME
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    with open(path, "r+b") as handle:
        handle.truncate(data.rfind(b"\n") + 1)
    return True
