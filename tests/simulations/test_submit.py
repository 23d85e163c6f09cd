"""``fed-dp submit``: its exit status and last line come from the run's status, never from ``flwr run``'s exit code
(which is 0 even when the ServerApp failed). The deployment paths are in tests/server/test_deployment.py and test_faults.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from fed_dp.simulations.launch.submit import COMPLETED, RunOutcome, explain, run_id_of


def test_the_run_id_is_read_from_flwr_runs_output():
    assert run_id_of("...\n🎊 Successfully started run 8165312741226071155\n...") == 8165312741226071155
    assert run_id_of("Failed to load Flower App configuration") is None


def test_only_a_completed_run_succeeds_and_every_other_status_says_what_to_do():
    completed = RunOutcome(0, "", 7, COMPLETED)
    assert completed.succeeded and explain(completed) == "run 7: finished:completed"
    for status in ("finished:failed", "finished:stopped", "running", "unknown"):
        failed = RunOutcome(0, "", 7, status, {"status-details": "ServerApp raised NoRepliesError"})
        assert not failed.succeeded, status
        text = explain(failed)
        assert text.startswith(f"run 7: {status} (ServerApp raised NoRepliesError)"), text
        assert "server.checkpoint-dir" in text and "resumes" in text, text


@pytest.mark.skipif(shutil.which("flwr") is None or shutil.which("fed-dp") is None, reason="needs the CLIs")
def test_a_run_that_cannot_start_exits_1_with_the_reason(tmp_path):
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    done = subprocess.run(["fed-dp", "submit", "local", "--app", str(tmp_path / "no-app")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the run: not started. flwr run did not start a run" in done.stderr, done.stderr
