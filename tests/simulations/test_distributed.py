"""A simulation spread over 2 processes (torchrun, gloo on the CPU) equals the same simulation in one process:
the same cohorts, the same noise and ε (rank 0 owns sampler, noise, optimizer and ledger), and the same model up
to the order of the float32 additions of Σu. A rank that fails to train stops the run with an error naming the failure (torchrun then ends every rank)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_run import run

from fed_dp.round_loop import TrainingStopped
from fed_dp.simulations.engine.distributed import current_workers

SCRIPT = Path(__file__).with_name("distributed_run.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, *args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 script --out out args`` (gloo: the script initializes the group)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(script), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(script.parent)])}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("optimizer", ["dp-adam-ime", "dp-adam-stp"])  # Σu² sent; s_t broadcast
def test_two_gloo_workers_train_the_same_run_as_one_process(tmp_path, optimizer):
    done = torchrun(tmp_path / "result.pt", "--optimizer", optimizer)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    leader, worker = (torch.load(tmp_path / f"result.pt.{rank}", weights_only=False) for rank in (0, 1))
    alone = run(optimizer=optimizer)

    assert [r["epsilon"] for r in leader["records"]] == [r["epsilon"] for r in alone.records]
    assert [r["nonprivate_cohort_size"] for r in leader["records"]] == [
        r["nonprivate_cohort_size"] for r in alone.records]
    assert sum(r["nonprivate_cohort_size"] for r in alone.records) > 0
    for mine, theirs in zip(leader["records"], alone.records, strict=True):
        assert mine["nonprivate_train_loss"] == pytest.approx(theirs["nonprivate_train_loss"], rel=1e-6, nan_ok=True)
    torch.testing.assert_close(leader["params"], alone.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(worker["params"], leader["params"], rtol=0, atol=0)  # rank 0's model, shared
    assert leader["state"] and not worker["state"]  # the noise state never leaves rank 0


def test_a_rank_that_cannot_train_stops_the_run(tmp_path):
    done = torchrun(tmp_path / "result.pt", "--poisoned-user", "5")
    assert done.returncode != 0
    output = done.stdout + done.stderr
    # rank 0 names the user (the smallest failed one of any rank) and stops as one process does (TrainingStopped:
    # nothing of round 1 released, the model so far returned)
    assert ("TrainingStopped: round 1, user 5: RuntimeError: 1 of the 2 ranks failed to train their users in round 1"
            in output), output[-4000:]
    assert "The run stopped before releasing round 1" in output
    assert "rank 1: training users [1, 3, 5, 7, 9]... failed in round 1" in output  # its traceback, in its log
    assert not list(tmp_path.glob("result.pt.*"))  # nothing saved by either rank
    with pytest.raises(TrainingStopped, match=r"round 1, user 5: ValueError: .*user") as alone:  # the same run in
        run(poisoned_user=5)                                                  # one process fails on the same user
    assert isinstance(alone.value.__cause__.__cause__, ValueError)


def test_the_example_runs_under_torchrun(tmp_path):
    done = torchrun(tmp_path / "digits.pt", "--users", "20", "--rounds", "2",
                    script=REPO / "examples" / "distributed_simulation.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 processes: user-level epsilon 3.000" in done.stdout
    saved = torch.load(tmp_path / "digits.pt", weights_only=False)
    assert [r["round"] for r in saved["records"]] == [0, 1, 2]  # 0: the initial model's evaluation
    assert saved["records"][-1]["epsilon"] <= 3.0


def test_one_process_is_not_distributed():
    assert current_workers() is None


def test_fed_dp_simulate_under_torchrun_equals_one_process_and_only_rank_0_reports(tmp_path):
    """`torchrun --nproc_per_node 2 $(which fed-dp) simulate ...`: the process group comes from torchrun's
    environment, both ranks train (every record says 2 processes), rank 0 alone prints the table and writes the
    results folder, and the results equal `fed-dp simulate` in one process."""
    import json

    from fed_dp.simulations.cli import main

    sets = ["--set", "privacy.rounds=3", "--set", "task.users=64", "--set", "task.largest=32",
            "--set", "privacy.expected-cohort=16", "--set", "run.optimizers=['dp-sgd','dp-adam-stp']"]
    fed_dp_command = Path(sys.executable).with_name("fed-dp")  # the console script of this environment
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(fed_dp_command), "simulate", "heavy-tail-quick", *sets,
               "--out", str(tmp_path / "two"), "--no-plot"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("results: ") == 1 and done.stdout.count("\ndp-sgd ") == 1, done.stdout
    assert main(["simulate", "heavy-tail-quick", *sets, "--out", str(tmp_path / "one"), "--no-plot", "--quiet"]) == 0

    files = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    for name in ("dp-sgd", "dp-adam-stp"):
        two, one = ([json.loads(line) for line in (tmp_path / run / f"rounds-{name}.jsonl").read_text().splitlines()]
                    for run in ("two", "one"))
        assert [r["round"] for r in two] == [r["round"] for r in one] == [0, 1, 2, 3]  # 0: the initial evaluation
        assert ("eval_loss" in two[0]) and two[0]["eval_loss"] == pytest.approx(one[0]["eval_loss"], rel=1e-5)
        two, one = two[1:], one[1:]  # the released rounds
        assert [r["processes"] for r in two] == [2.0] * 3 and all("processes" not in r for r in one)
        assert [r["epsilon"] for r in two] == [r["epsilon"] for r in one]
        assert [r["nonprivate_cohort_size"] for r in two] == [r["nonprivate_cohort_size"] for r in one]
        assert "eval_loss" in two[-1] and "eval_loss" in one[-1]
        for mine, theirs in zip(two, one, strict=True):
            assert ("eval_loss" in mine) == ("eval_loss" in theirs)
            if "eval_loss" in mine:
                assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
            assert mine["update_norm"] == pytest.approx(theirs["update_norm"], rel=1e-4)
