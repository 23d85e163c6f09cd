"""The GPU check's orchestration (simulations/benchmark/gpu_check.py), on the CPU: steps run as processes within
their share of the budget, a step that runs out is stopped and reported, and the run leaves one JSON and one archive
holding every step's log (what a short lease of a GPU machine brings back)."""

from __future__ import annotations

import json
import sys
import tarfile

import pytest

from fed_dp.simulations.benchmark import gpu_check


def test_steps_run_within_their_share_and_leave_one_json_and_one_archive(tmp_path, monkeypatch):
    quick = [sys.executable, "-c", "print('tests: 3 passed')"]
    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"]
    monkeypatch.setattr(gpu_check, "_commands", lambda work: {"tests": quick, "benchmark": slow, "seed003": quick})
    result = gpu_check.check(tmp_path, ["tests", "benchmark"], budget=4.0, log=lambda *_: None)
    tests, benchmark = result["steps"]
    assert tests["returncode"] == 0 and "3 passed" in tests["output_tail"] and not tests["timed_out"]
    assert benchmark["timed_out"] and benchmark["returncode"] is None and "started" in benchmark["output_tail"]
    assert benchmark["limit_seconds"] == pytest.approx(4.0 * 0.4 / 0.75) and benchmark["seconds"] < 10
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["gpu-check.json", "gpu-check.tar.gz"]
    assert json.loads((tmp_path / "gpu-check.json").read_text())["device"]["cuda"] == result["device"]["cuda"]
    with tarfile.open(tmp_path / "gpu-check.tar.gz") as archive:
        assert {"gpu-check/tests.log", "gpu-check/benchmark.log"} <= set(archive.getnames())


def test_unknown_steps_and_budgets_are_refused(tmp_path, capsys):
    for argv in (["--out", str(tmp_path), "--steps", "tests,gpu"], ["--out", str(tmp_path), "--budget", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.main(argv)
    assert "unknown steps ['gpu']" in capsys.readouterr().err
