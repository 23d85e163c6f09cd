"""Submit a run to a SuperLink and exit with its outcome: ``fed-dp submit``.

    fed-dp submit fed-dp --run-config "privacy.rounds=100 server.checkpoint-dir='/abs/ckpt'"

It runs ``flwr run <app> <federation> --stream`` (the log is printed as it comes), then reads the run's final
status with ``flwr ls <federation> --run-id <id> --format json``. In flwr 1.41 ``flwr run --stream`` exits 0
even when the ServerApp failed; this command exits 0 only when the run's status is ``finished:completed``, 1
when it failed, was stopped or cannot be read (the SuperLink went away), and says what to do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from fed_dp.simulations.launch.local_simulation import FLWR

COMPLETED = "finished:completed"


@dataclass
class RunOutcome:
    """A submitted run: ``flwr run``'s exit code and output, the run id, its final status and ``flwr ls``'s
    entry for it (``details``); ``problem`` says why the status could not be read."""

    returncode: int
    output: str
    run_id: int | None
    status: str
    details: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == COMPLETED


def run_id_of(output: str) -> int | None:
    """The run id in ``flwr run``'s output ("Successfully started run <id>"), or None."""
    match = re.search(r"Successfully started run (\d+)", output)
    return int(match.group(1)) if match else None


def run_details(run_id: int, federation: str | None, *, cwd: str | os.PathLike | None = None,
                env: dict[str, str] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """The run's entry of ``flwr ls [federation] --run-id <id> --format json``; RuntimeError with flwr's own
    message when it cannot answer (e.g. the SuperLink is unreachable)."""
    command = [FLWR, "ls", *([federation] if federation else []), "--run-id", str(run_id), "--format", "json"]
    listed = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        answer = json.loads(listed.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"flwr ls failed ({listed.returncode}): {listed.stdout}{listed.stderr}") from None
    if not answer.get("success", True) or "runs" not in answer:
        raise RuntimeError(f"flwr ls could not list run {run_id}: {answer.get('error-message', answer)}")
    return next((run for run in answer["runs"] if int(run["run-id"]) == run_id), {})


def outcome(returncode: int, output: str, federation: str | None, *, cwd: str | os.PathLike | None = None,
            env: dict[str, str] | None = None) -> RunOutcome:
    """The outcome of a finished ``flwr run --stream``: its run id and the status ``flwr ls`` reports."""
    run_id = run_id_of(output)
    if run_id is None:
        return RunOutcome(returncode, output, None, "not started",
                          problem="flwr run did not start a run (see its output above)")
    try:
        details = run_details(run_id, federation, cwd=cwd, env=env)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return RunOutcome(returncode, output, run_id, "unknown", problem=str(error))
    return RunOutcome(returncode, output, run_id, details.get("status", "unknown"), details)


def submit(app: str | os.PathLike, federation: str | None, run_config: str | None, *,
           env: dict[str, str] | None = None, echo: TextIO | None = None) -> RunOutcome:
    """Run ``flwr run <app> [federation] --stream [--run-config ...]`` and return its :class:`RunOutcome`.
    ``echo``: where to copy the log as it streams (None: nowhere)."""
    command = [FLWR, "run", str(app), *([federation] if federation else []), "--stream"]
    command += ["--run-config", run_config] if run_config else []
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, env=env) as process:
        for line in process.stdout:
            lines.append(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
    return outcome(process.returncode, "".join(lines), federation, env=env)


def explain(result: RunOutcome) -> str:
    """One paragraph for the operator: the status and, unless completed, what to do."""
    where = f"run {result.run_id}" if result.run_id is not None else "the run"
    if result.succeeded:
        return f"{where}: {result.status}"
    text = f"{where}: {result.status}"
    details = result.details.get("status-details")
    if details and details != "N/A":
        text += f" ({details})"
    if result.problem:
        text += f". {result.problem}"
    return text + (". If the SuperLink restarted, restart it with the same --database and submit the run again "
                   "with the same server.checkpoint-dir: it resumes after the last committed round. The ServerApp's "
                   "log above says why a run failed")


def main(app: str, federation: str | None, run_config: str | None) -> int:
    """``fed-dp submit``: 0 when the run completed, 1 otherwise."""
    result = submit(app, federation, run_config, echo=sys.stdout)
    print(explain(result), file=sys.stdout if result.succeeded else sys.stderr)
    return 0 if result.succeeded else 1
