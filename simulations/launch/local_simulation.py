"""Run the project's Flower apps with ``flwr run .`` (Flower's simulation engine) from Python, isolated.

Used by the tests and by ``fed-dp benchmark``. Each call gets its own ``FLWR_HOME`` and free local
SuperLink ports, so the user's ``~/.flwr`` is never touched and runs do not collide; the local SuperLink
that ``flwr run`` starts and leaves running is stopped afterwards (found by its ``FLWR_HOME`` path, with
everything it spawned: SuperExec, the ``flwr-simulation`` process running the ServerApp, Ray).

``flwr run`` is started in a folder holding only what it bundles (:func:`bundle_folder`), not in the app folder
itself: Flower's CLI lists every file under the folder before it applies ``fab-include`` (flwr 1.41
``flwr.cli.utils.collect_files``), which with the README's ``.venv`` inside the project is about 48,000 files
and 2.5 s per run on these machines. The bundle it builds is the same file either way (tested).

Facts of flwr 1.41 this relies on: ``flwr run`` starts a local SuperLink on the ports named by
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and ``FLWR_LOCAL_CONTROL_API_PORT``; ``--federation-config``
takes ``num-supernodes`` and ``client-resources-num-cpus``; run-config values are TOML scalars.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The project root (holds pyproject.toml with the Flower app's [tool.flwr.app] tables).
REPO = Path(__file__).resolve().parents[2]
FLWR = str(Path(sys.executable).with_name("flwr"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def format_run_config(values: dict[str, Any]) -> str:
    """``{"privacy.rounds": 3, "task.name": "x"}`` → ``privacy.rounds=3 task.name='x'`` (TOML values)."""

    def toml(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        text = str(value)
        if "'" in text or "\n" in text:
            raise ValueError(f"run-config value {text!r}: a single quote or newline cannot pass flwr's parser")
        return f"'{text}'"

    return " ".join(f"{key}={toml(value)}" for key, value in values.items())


def flwr_env(home: Path) -> dict[str, str]:
    """The environment of an isolated ``flwr run``: its own home and ports, no telemetry or update check."""
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }


def bundle_folder(app: Path, into: Path) -> Path:
    """A copy of what ``flwr run`` bundles from the Flower app folder ``app`` — its pyproject.toml and the files
    its ``[tool.flwr.app] fab-include`` patterns name — made in ``into`` (module docstring); ``app`` itself when
    its pyproject names no ``fab-include`` (then Flower decides what to bundle from the folder)."""
    flwr_app = tomllib.loads((app / "pyproject.toml").read_text()).get("tool", {}).get("flwr", {}).get("app", {})
    include = flwr_app.get("fab-include")
    if not include:
        return app
    into.mkdir(parents=True, exist_ok=True)
    for pattern in ["pyproject.toml", *include]:
        matches = [path for path in app.glob(pattern) if path.is_file()]
        if not matches:
            raise FileNotFoundError(f"{app / 'pyproject.toml'}: fab-include names {pattern!r}, which matches no file")
        for path in matches:
            target = into / path.relative_to(app)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return into


def start(home: Path, run_config: dict[str, Any], supernodes: int, *, client_cpus: int = 1,
          app: Path = REPO, environment: dict[str, str] | None = None) -> subprocess.Popen:
    """``flwr run . --stream`` of the Flower app folder ``app`` (default: this project's; run from
    :func:`bundle_folder`) in the background; its output goes to ``home/flwr-run.log``. ``environment``: more
    variables for the Flower processes (the SuperLink and the apps it starts copy them), e.g. the ServerApp's
    ``FED_DP_SERVER_SEED`` of a research run that must draw the same cohorts and noise as an in-process one."""
    home.mkdir(parents=True, exist_ok=True)
    folder = bundle_folder(app, home / "bundle")
    log = open(home / "flwr-run.log", "ab")
    command = [FLWR, "run", ".", "--stream", "--federation-config",
               f"num-supernodes={supernodes} client-resources-num-cpus={client_cpus}"]
    if run_config:
        command += ["--run-config", format_run_config(run_config)]
    return subprocess.Popen(command, cwd=folder, env={**flwr_env(home), **(environment or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for child in children for c in [child, *map(str, _descendants(int(child)))]]


def stop_local_superlink(home: Path) -> None:
    """Kill the local SuperLink that ``flwr run`` started with this ``FLWR_HOME``, and everything under it."""
    roots = [int(p) for p in subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout.split()]
    for pid in {p for root in roots for p in [root, *_descendants(root)]}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(home: Path, run_config: dict[str, Any], supernodes: int, *, client_cpus: int = 1,
        timeout: float = 240, app: Path = REPO, environment: dict[str, str] | None = None) -> str:
    """Run to completion and clean up; returns the streamed log. Raises ``TimeoutError`` if not done in time.

    ``flwr run --stream`` exits 0 even when the ServerApp fails: callers check the log or the results."""
    process = start(home, run_config, supernodes, client_cpus=client_cpus, app=app, environment=environment)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"flwr run did not finish in {timeout:.0f} s; log: {home / 'flwr-run.log'}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        stop_local_superlink(home)
    return (home / "flwr-run.log").read_text(errors="replace")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
