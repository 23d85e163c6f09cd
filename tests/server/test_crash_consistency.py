"""Crash consistency: the server process is killed (SIGKILL) at every phase boundary of a round and resumed from
its checkpoint folder; the resumed run must equal the uninterrupted one, release each round once, and count each
round once in the ledger.

The server here is the in-process engine (fed_dp.train runs the same round loop as the Flower Strategy) in a
child process that kills itself at the boundary under test (``on_phase``), the hardest way to stop: nothing of
its in-memory state survives, and no ``finally`` or ``atexit`` runs. A cheaper in-process test then kills at every
phase boundary of every round and before and after the rename of every atomic write, and compares every record
and file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fed_dp import atomic
from fed_dp.checkpoint import load_checkpoint, read_diagnostics
from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.round_loop import PHASES
from fed_dp.simulations.tasks.builtin import heavy_tail_task
from fed_dp.simulations.engine.inprocess import train

PRIVACY = PrivacyConfig(expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)
KILLED_ROUND = 2  # the second round (rounds are numbered 1 … T): a checkpoint of round 1 exists, and a round follows

CHILD = textwrap.dedent('''
    import os, signal, sys
    from fed_dp.config import LocalTraining, PrivacyConfig
    from fed_dp.simulations.tasks.builtin import heavy_tail_task
    from fed_dp.simulations.engine.inprocess import train

    folder, phase, round_index, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def crash(name, index):
        if (name, index) == (phase, round_index):
            os.kill(os.getpid(), signal.SIGKILL)

    def release(record):  # what the world saw: one line per round handed out, on disk before going on
        with open(log, "a") as handle:
            handle.write(f"{record['round']}\\n")
            handle.flush()
            os.fsync(handle.fileno())

    train(heavy_tail_task(), PrivacyConfig(expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5,
          accountant="rdp"), "dp-adam", LocalTraining(batch_size=2, lr=0.5), seed=4, checkpoint_dir=folder,
          on_phase=crash, on_round=release)
''')


@pytest.fixture(scope="module")
def uninterrupted():
    return train(heavy_tail_task(), PRIVACY, "dp-adam", LOCAL, seed=4)


@pytest.mark.parametrize("phase", [name for name in PHASES if name != "evaluated"])  # all: in process, below
def test_a_kill_at_each_phase_boundary_resumes_to_the_uninterrupted_run(phase, tmp_path, uninterrupted):
    folder, log = tmp_path / "ckpt", tmp_path / "released.txt"
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder), phase, str(KILLED_ROUND), str(log)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    saved = load_checkpoint(folder)["state"]["round"]
    assert saved == (KILLED_ROUND if phase in ("saved", "evaluated", "published") else KILLED_ROUND - 1)  # commit

    released = []
    resumed = train(heavy_tail_task(), PRIVACY, "dp-adam", LOCAL, seed=4, checkpoint_dir=str(folder),
                    on_round=lambda record: released.append(record["round"]))
    before = [int(line) for line in log.read_text().split()]
    assert before + released == list(range(1, PRIVACY.rounds + 1))  # every round released once, across the crash
    assert torch.equal(resumed.params, uninterrupted.params)  # same cohorts, noise and local training
    assert [r["round"] for r in resumed.records] == list(range(PRIVACY.rounds + 1))  # round 0 (initial), each once
    assert [r["epsilon"] for r in resumed.records] == [r["epsilon"] for r in uninterrupted.records]
    ledger = load_checkpoint(folder)["state"]["ledger"]["records"]
    assert [r["round"] for r in ledger] == list(range(1, PRIVACY.rounds + 1))  # each round counted once
    results = json.loads((folder / "results.json").read_text())
    assert [r["round"] for r in results] == list(range(PRIVACY.rounds + 1))


# --- in process: a kill at every phase boundary and inside every atomic write, comparing the records --------------

class Killed(BaseException):
    """The emulated SIGKILL: raised once the checkpoint folder was copied as the kill left it on disk (what the
    run does after the exception, such as writing results.json in a ``finally``, happens to the original)."""


def _tiny_task() -> Task:
    g = torch.Generator().manual_seed(0)
    users = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(12)]
    x, y = torch.cat([u[0] for u in users]), torch.cat([u[1] for u in users])
    return Task(name="tiny", users=Users.in_memory(users), model=lambda: nn.Linear(6, 3), loss=losses.classification,
                evaluate=evaluation.classification((x, y)))


TINY = _tiny_task()


def _tiny_run(folder, released, on_phase=None):
    return train(TINY, PrivacyConfig(expected_cohort=4, rounds=3, noise_multiplier=1.0, delta=1e-4, accountant="rdp"),
                 "dp-adam", LocalTraining(steps=1, batch_size=4, lr=0.5), seed=4, checkpoint_dir=str(folder),
                 device="cpu", on_phase=on_phase, on_round=lambda record: released.append(record["round"]))


def _atomic_writes(monkeypatch, stop=None):
    """The names of the files written atomically (``fed_dp.atomic``), in order; with ``stop = (k, when, snapshot)``
    call ``snapshot`` (which raises :class:`Killed`) before or after the k-th rename, its temporary file cut to
    half when before."""
    targets: list[str] = []

    def replace(source, target):
        targets.append(Path(target).name)
        hit = stop is not None and len(targets) == stop[0]
        if hit and stop[1] == "before rename":
            Path(source).write_bytes(Path(source).read_bytes()[: Path(source).stat().st_size // 2])
            stop[2]()
        os_replace(source, target)
        if hit and stop[1] == "after rename":
            stop[2]()

    os_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", replace)
    return targets


def _published_files(folder):
    """What the folder says: results.json, the published mark, the public records, the ledger and the
    operator's diagnostics (without the durations, which differ from run to run)."""
    diagnostics = [{k: v for k, v in d.items() if k != "round_seconds"} for d in read_diagnostics(folder)]
    checkpoint = load_checkpoint(folder)
    return (json.loads((folder / "results.json").read_text()), json.loads((folder / "published.json").read_text()),
            checkpoint["extra"]["records"], checkpoint["state"]["ledger"], diagnostics)


def _untimed(records):
    return [{k: v for k, v in r.items() if k != "nonprivate_round_seconds"} for r in records]


def test_a_kill_anywhere_resumes_to_the_same_records_each_round_published_once(tmp_path, monkeypatch):
    """Issue 25 item 9, in process (cheap: one small run per kill point): the kill is emulated by copying the
    folder as it is at the kill point, then stopping the run; the copy is resumed. Kill points: every phase
    boundary of every round, and before (the temporary file half written) and after the rename of every atomic
    write. The resumed run must equal the uninterrupted one in its records (evaluations included), its files
    (results.json, published.json, the public records, the ledger, the diagnostics) and its model, and hand
    every round out exactly once, but for one point: a kill right after a round's mark in published.json and
    before its log line and on_round (no side effect outside the folder can be made exactly-once) leaves that
    round's record published and never hands it out, rather than twice. On main a kill after a round's publication lost its evaluation for good, a
    kill in the published.json write handed a round out twice, and the diagnostics of a round whose commit was
    followed by the kill were lost."""
    released: list[int] = []
    writes = _atomic_writes(monkeypatch)
    straight = _tiny_run(tmp_path / "straight", released)
    expected = _published_files(tmp_path / "straight")
    assert released == [1, 2, 3] and all("eval_accuracy" in r for r in straight.records)
    assert [r["round"] for r in straight.records] == [0, 1, 2, 3]  # 0: the initial model's evaluation
    points = [("phase", (name, t)) for t in (1, 2, 3) for name in PHASES] + \
        [("write", (k, when)) for k in range(1, len(writes) + 1) for when in ("before rename", "after rename")]
    for number, (kind, where) in enumerate(points):
        folder, copy = tmp_path / f"run{number}", tmp_path / f"kill{number}"

        def kill():
            shutil.copytree(folder, copy) if folder.exists() else copy.mkdir()  # a kill before the first write
            raise Killed

        before: list[int] = []
        if kind == "phase":
            _atomic_writes(monkeypatch)
            with pytest.raises(Killed):
                _tiny_run(folder, before, on_phase=lambda name, t: kill() if (name, t) == where else None)
        else:
            _atomic_writes(monkeypatch, (*where, kill))
            with pytest.raises(Killed):
                _tiny_run(folder, before)
            _atomic_writes(monkeypatch)
        marked = kind == "write" and where == (where[0], "after rename") and writes[where[0] - 1] == "published.json"
        unreleased = json.loads((copy / "published.json").read_text())["round"] if marked else None
        after: list[int] = []
        resumed = _tiny_run(copy, after)
        assert before + after == [t for t in (1, 2, 3) if t != unreleased], (kind, where)
        assert _untimed(resumed.records) == _untimed(straight.records), (kind, where)
        assert _published_files(copy) == expected, (kind, where)
        assert torch.equal(resumed.params, straight.params), (kind, where)
        assert not list(copy.rglob("*.tmp")), (kind, where)
