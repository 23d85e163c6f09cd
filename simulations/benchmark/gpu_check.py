"""The GPU check: every CUDA test and GPU measurement of the project in one run, for a machine lent for minutes.

    python -m fed_dp.simulations.benchmark.gpu_check --out DIR [--steps tests,benchmark,seed003] [--budget 450]

Runs, one after another, each with its share of the time budget (a step that runs out is stopped and reported as
such, with what it printed): ``tests``, the test files with CUDA paths (clients, the engine, noise and its float
properties, the clip bound, diagnostics; their CUDA tests run only where a GPU is); ``benchmark``, ``fed-dp benchmark
--only gpu,small-users,secure-noise`` on the GPU (the engine against the hardware's limit, the many-small-users
workloads against their direct round, the noise sources); ``seed003``, seed 003's Figure 2 config end to end
(``fed-dp simulate seed003-heavy-tail``, the four optimizers) with its wall time. It leaves two files in ``--out``:
``gpu-check.json`` (the device, versions, every step's command, exit status, seconds and output tail, and the
benchmark's own JSON) and ``gpu-check.tar.gz`` (every step's full log, the benchmark's table and figure, the
simulation's results and figures). Nothing here needs a GPU to import; without one, the tests skip their CUDA
cases and the benchmark sections refuse, and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

#: Test files whose code has a CUDA path or CUDA-only tests.
TEST_FILES = ("tests/clients", "tests/simulations/test_engine.py", "tests/simulations/test_runner.py",
              "tests/fed_dp/test_noise.py", "tests/fed_dp/test_noise_float.py", "tests/fed_dp/test_randomness.py",
              "tests/fed_dp/test_clipping_float.py", "tests/fed_dp/test_diagnostics.py",
              "tests/simulations/test_benchmark_small_users.py")
#: Each step's share of the budget.
SHARES = {"tests": 0.35, "benchmark": 0.4, "seed003": 0.25}


def _commands(out: Path) -> dict[str, list[str]]:
    fed_dp = [sys.executable, "-m", "fed_dp.simulations.cli"]
    return {
        "tests": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "-m", "not faults",
                  "--durations=10", *TEST_FILES],
        "benchmark": [*fed_dp, "benchmark", "--only", "gpu,small-users,secure-noise", "--small-users-device", "cuda",
                      "--small-users-paper-rounds", "3", "--out", str(out / "benchmark")],
        "seed003": [*fed_dp, "simulate", "seed003-heavy-tail", "--out", str(out / "seed003")],
    }


def _run_step(name: str, command: list[str], seconds: float, log: Path) -> dict[str, Any]:
    """Run one step with a time limit; its output goes to ``log``; returns what the JSON says of it."""
    started = time.perf_counter()
    with log.open("w") as sink:
        try:
            rc = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=seconds).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = log.read_text(errors="replace")
    return {"step": name, "command": command, "returncode": rc, "timed_out": rc is None, "limit_seconds": seconds,
            "seconds": round(time.perf_counter() - started, 1), "output_tail": text[-4000:]}


def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda_version=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    return info


def check(out: Path, steps: list[str], budget: float, log=print) -> dict[str, Any]:
    """Run ``steps`` in order within ``budget`` seconds; write ``gpu-check.json`` and ``gpu-check.tar.gz``."""
    out.mkdir(parents=True, exist_ok=True)
    work = out / "gpu-check"
    work.mkdir(exist_ok=True)
    commands = _commands(work)
    result: dict[str, Any] = {"device": _device(), "budget_seconds": budget, "steps": []}
    for name in steps:
        seconds = budget * SHARES[name] / sum(SHARES[s] for s in steps)
        log(f"gpu-check: {name} (at most {seconds:.0f} s): {' '.join(commands[name])}")
        step = _run_step(name, commands[name], seconds, work / f"{name}.log")
        log(f"gpu-check: {name}: exit {step['returncode']}, {step['seconds']} s")
        result["steps"].append(step)
    report = work / "benchmark" / "benchmark.json"
    if report.exists():
        result["benchmark"] = json.loads(report.read_text())
    summary = work / "seed003" / "summary.json"
    if summary.exists():
        result["seed003"] = json.loads(summary.read_text())
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))
    with tarfile.open(out / "gpu-check.tar.gz", "w:gz") as archive:
        archive.add(work, arcname="gpu-check")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fed_dp.simulations.benchmark.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu-check.json and gpu-check.tar.gz")
    parser.add_argument("--steps", default=",".join(SHARES), help=f"comma-separated, of: {', '.join(SHARES)}")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all steps together (default 450)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(SHARES))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose among {', '.join(SHARES)}")
    if not args.budget > 0:
        parser.error("--budget must be > 0 seconds")
    result = check(args.out, steps, args.budget)
    return 0 if all(step["returncode"] == 0 for step in result["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
