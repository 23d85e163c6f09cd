"""One run per checkpoint folder (issue 40, item 10): a second run on a folder in use is refused before it resumes or
releases anything, naming the holder; the lock goes with its holder, even one killed with SIGKILL.

The second run is a real second process (``subprocess``): a run of the round loop that stops inside its first
round's exchange and waits there, holding its folder, while this process starts a run on the same folder. A second
attempt from the same process is refused too: ``flock`` locks belong to an open file, not to a process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fed_dp.checkpoint import COMMIT_NAME, load_checkpoint
from fed_dp.config import PrivacyConfig
from fed_dp.contribution import Contribution
from fed_dp.folder_lock import LOCK_NAME, FolderInUseError, owning
from fed_dp.optimizers import make_optimizer
from fed_dp.round import init_server
from fed_dp.round_loop import RoundReplies, run_rounds

CONFIG = PrivacyConfig(num_users=20, expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-4, accountant="rdp")
DIM = 4

#: A run of the round loop on argv[1] that announces its first round and then waits (its exchange reads stdin).
HOLDER = textwrap.dedent('''
    import sys
    import torch
    from fed_dp.config import PrivacyConfig
    from fed_dp.contribution import Contribution
    from fed_dp.optimizers import make_optimizer
    from fed_dp.round import init_server
    from fed_dp.round_loop import RoundReplies, run_rounds

    def exchange(plan):
        print("in round", plan.round + 1, flush=True)
        sys.stdin.readline()
        return RoundReplies([Contribution(torch.zeros(4), plan.cohort.numel())])

    config = PrivacyConfig(num_users=20, expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-4,
                           accountant="rdp")
    run_rounds(init_server(config, make_optimizer("dp-sgd"), torch.zeros(4), seed=1), exchange,
               checkpoint_dir=sys.argv[1])
''')


def _exchange(plan):
    return RoundReplies([Contribution(torch.zeros(DIM), plan.cohort.numel())])


def _run(folder: Path, rounds: int | None = None):
    return run_rounds(init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1), _exchange,
                      rounds=rounds, checkpoint_dir=folder)


def test_a_second_process_on_a_folder_in_use_is_refused_naming_it_and_runs_once_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "in round 1"  # it owns the folder, inside its first round
        with pytest.raises(FolderInUseError) as refused:
            _run(tmp_path)
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message and "started 20" in message
        assert str(tmp_path) in message and f"kill {holder.pid}" in message
        assert isinstance(refused.value, ValueError)  # a configuration mistake: the CLI prints it on one line
        assert not (tmp_path / COMMIT_NAME).exists()  # the refused run resumed and released nothing
        holder.send_signal(signal.SIGKILL)  # no finally, no atexit: the kernel drops the lock with the process
        holder.wait()
    finally:
        holder.kill()
        holder.wait()
    done = _run(tmp_path)  # the dead run's lock is no obstacle, and nothing needed cleaning up by hand
    assert done.state.round == CONFIG.rounds and load_checkpoint(tmp_path)["state"]["round"] == CONFIG.rounds


def test_a_second_run_in_the_same_process_is_refused_and_a_finished_run_leaves_the_folder_free(tmp_path):
    with owning(tmp_path):
        with pytest.raises(FolderInUseError, match=f"pid {os.getpid()}"):
            _run(tmp_path)
    assert not (tmp_path / COMMIT_NAME).exists()
    assert _run(tmp_path, rounds=1).state.round == 1  # ends: the folder is free again
    assert _run(tmp_path).state.round == CONFIG.rounds  # and resumes there
    assert (tmp_path / LOCK_NAME).exists()  # never deleted (a waiting run would lock a file nobody else sees)


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's read-only /sys")
def test_a_folder_that_cannot_be_created_is_a_clear_error_before_round_1():
    with pytest.raises(ValueError, match="checkpoint folder /sys/fed-dp-test cannot be used.*server.checkpoint-dir"):
        _run(Path("/sys/fed-dp-test"))
