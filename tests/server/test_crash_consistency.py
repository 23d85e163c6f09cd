"""Crash consistency: the server process is killed (SIGKILL) at every phase boundary of a round and resumed from
its checkpoint folder; the resumed run must equal the uninterrupted one, release each round once, and count each
round once in the ledger.

The server here is the in-process engine (fed_dp.train runs the same round loop as the Flower Strategy) in a
child process that kills itself at the boundary under test (``on_phase``), the hardest way to stop: nothing of
its in-memory state survives, and no ``finally`` or ``atexit`` runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from fed_dp.checkpoint import load_checkpoint
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.server.round_loop import PHASES
from fed_dp.simulations.builtin_tasks import heavy_tail_task
from fed_dp.simulations.engine import train

PRIVACY = PrivacyConfig(expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)
KILLED_ROUND = 1  # the second round: a checkpoint of round 1 exists, and a round follows

CHILD = textwrap.dedent('''
    import os, signal, sys
    from fed_dp.config import LocalTraining, PrivacyConfig
    from fed_dp.simulations.builtin_tasks import heavy_tail_task
    from fed_dp.simulations.engine import train

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


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_each_phase_boundary_resumes_to_the_uninterrupted_run(phase, tmp_path, uninterrupted):
    folder, log = tmp_path / "ckpt", tmp_path / "released.txt"
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder), phase, str(KILLED_ROUND), str(log)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    saved = load_checkpoint(folder)["state"]["round"]
    assert saved == (KILLED_ROUND + 1 if phase in ("saved", "published") else KILLED_ROUND)  # the commit point

    released = []
    resumed = train(heavy_tail_task(), PRIVACY, "dp-adam", LOCAL, seed=4, checkpoint_dir=str(folder),
                    on_round=lambda record: released.append(record["round"]))
    before = [int(line) for line in log.read_text().split()]
    assert before + released == list(range(PRIVACY.rounds))  # every round released once, across the crash
    assert torch.equal(resumed.params, uninterrupted.params)  # same cohorts, noise and local training
    assert [r["round"] for r in resumed.records] == list(range(PRIVACY.rounds))  # each round once in the results
    assert [r["epsilon"] for r in resumed.records] == [r["epsilon"] for r in uninterrupted.records]
    ledger = load_checkpoint(folder)["state"]["ledger"]["records"]
    assert [r["round"] for r in ledger] == list(range(PRIVACY.rounds))  # each round counted once
    results = json.loads((folder / "results.json").read_text())
    assert [r["round"] for r in results] == list(range(PRIVACY.rounds))
