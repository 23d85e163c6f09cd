"""Run the project's Flower app with `flwr run .` (Flower's simulation engine) from tests.

Each call uses its own FLWR_HOME and local SuperLink ports, never the user's ~/.flwr, and the local
SuperLink that `flwr run` leaves behind is stopped afterwards (it is found by its FLWR_HOME path).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLWR = str(Path(sys.executable).with_name("flwr"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }


def run_config_arg(values: dict[str, object]) -> str:
    def literal(v: object) -> str:
        return f"'{v}'" if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)

    return " ".join(f"{k}={literal(v)}" for k, v in values.items())


def start(home: Path, run_config: dict[str, object], supernodes: int) -> subprocess.Popen:
    """`flwr run . --stream` in the background; its output goes to home/flwr-run.log."""
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "flwr-run.log", "ab")
    return subprocess.Popen(
        [FLWR, "run", ".", "--stream", "--run-config", run_config_arg(run_config),
         "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus=1"],
        cwd=REPO, env=flwr_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for child in children for c in [child, *map(str, _descendants(int(child)))]]


def stop_local_superlink(home: Path) -> None:
    """Kill the local SuperLink that `flwr run` started with this FLWR_HOME, and everything under it
    (SuperExec, the flwr-simulation process running the ServerApp, Ray)."""
    roots = [int(p) for p in subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout.split()]
    for pid in {p for root in roots for p in [root, *_descendants(root)]}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(home: Path, run_config: dict[str, object], supernodes: int, timeout: float = 240) -> str:
    """Run to completion; returns the streamed log. Raises if it does not finish in time."""
    process = start(home, run_config, supernodes)
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        stop_local_superlink(home)
    return (home / "flwr-run.log").read_text(errors="replace")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
