"""A real Flower deployment on 127.0.0.1: SuperLink, SuperNodes and ``flwr run`` as processes.

Used by the deployment and fault-injection tests and by ``fed-dp benchmark --only deployment``.

    with deployment(tmp_path, certificates) as d:       # certificates: make_certificates(folder)
        d.start_superlink()
        nodes = [d.start_supernode({"users": "0-19"}), d.start_supernode({"users": "20-39"})]
        d.wait_for_nodes(nodes)
        result = d.run({"privacy.rounds": 3, "server.checkpoint-dir": str(tmp_path / "ck")})
        assert result.status == "finished:completed", d.diagnostics()

Every process starts in its own session (``start_new_session``), so stopping it with ``killpg`` also stops
what it spawned (the SuperExec, ``flwr-serverapp``, ``flwr-clientapp``); ``Deployment.stop`` (called by the
context manager, also on failure) stops all of them. Ports are free ones chosen at start-up; every
process gets its own ``FLWR_HOME`` under the deployment folder (``~/.flwr`` is never touched), and the
``flwr`` CLI's home holds the connection entry named ``Deployment.federation``. The ServerApp runs in the
SuperLink's working directory, so paths in the run config must be absolute.

Facts of flwr 1.41 this relies on: the SuperLink serves its Fleet, Control and Runtime APIs on one HTTP(S)
port with ``GET /health``; with ``--database`` its state (node ids, runs) survives a restart and the SuperNodes
reconnect by themselves (without it they get 401 for their old ids and exit); each SuperNode needs its own Runtime API ``--port``; ``flwr run --stream`` exits
0 even when the ServerApp fails, so the outcome is read with ``flwr ls --format json``.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fed_dp.clients.node_service import NODE_CONFIG_KEY
from fed_dp.simulations.launch.local_simulation import REPO, bundle_folder, format_run_config, free_port
from fed_dp.simulations.launch.submit import RunOutcome, outcome, run_details

__all__ = ["Deployment", "Process", "deployment", "executable", "format_node_config", "tail"]


def executable(name: str) -> str:
    """A Flower or fed-dp command: the one installed beside this Python (its virtual environment), else by name
    from the PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


def format_node_config(values: dict[str, Any]) -> str:
    """``{"users": "0-13"}`` → ``users='0-13'`` for ``flower-supernode --node-config``."""
    return " ".join(f"{key}='{value}'" if isinstance(value, str) else f"{key}={value}" for key, value in values.items())


@dataclass(frozen=True)
class _Task:
    """One line of the process table (Linux /proc): enough to find a process's family and to recognise it."""

    pid: int
    ppid: int
    pgid: int
    state: str
    started: int  # clock ticks after boot: with the pid, names the process even if the pid is reused later
    name: str


def _process_table() -> list[_Task]:
    tasks = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        head, _, rest = text.rpartition(")")  # "pid (comm) state ppid pgrp ... starttime ..."; comm may hold ")"
        fields = rest.split()
        pid, _, name = head.partition(" (")
        tasks.append(_Task(int(pid), int(fields[1]), int(fields[2]), fields[0], int(fields[19]), name))
    return tasks


def _family(pid: int) -> set[tuple[int, int]]:
    """(pid, start time) of every descendant of ``pid`` now (wherever its process group or session is)."""
    table = _process_table()
    found, frontier = set(), {pid}
    while frontier:
        children = {t for t in table if t.ppid in frontier and t.state != "Z"}
        found |= {(t.pid, t.started) for t in children}
        frontier = {t.pid for t in children}
    return found


def _alive(pgid: int, family: set[tuple[int, int]]) -> list[str]:
    """Names of the live (not zombie) members of group ``pgid`` and of ``family``."""
    return [t.name for t in _process_table()
            if t.state != "Z" and (t.pgid == pgid or (t.pid, t.started) in family)]


@dataclass
class Process:
    """One started command: its process group and descendants, its log file, and how to stop them all."""

    name: str
    popen: subprocess.Popen
    log: Path
    family: set[tuple[int, int]] = field(default_factory=set)

    def running(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for_output(self, pattern: str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in the log; raises if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if match := re.search(pattern, self.output()):
                return match
            if not self.running():
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before logging "
                                   f"{pattern!r}:\n{tail(self.output())}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not log {pattern!r} within {timeout:.0f} s:\n"
                                   f"{tail(self.output())}")
            time.sleep(0.1)

    def stop(self, sig: signal.Signals = signal.SIGTERM, grace: float = 20.0) -> None:
        """Send ``sig`` to the process group, SIGKILL it after ``grace`` s, then SIGKILL what is left of it.

        Descendants are noted first: the SuperLink's SuperExec runs in a session of its own, so its
        ``flwr-serverapp`` is outside the group and would outlive the SuperLink for half a minute.
        """
        pgid = self.popen.pid
        if self.running():
            self.family |= _family(pgid)
            _signal_group(pgid, sig)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.popen.wait()
        for task in _process_table():
            if task.state != "Z" and (task.pid, task.started) in self.family:
                _signal(task.pid, signal.SIGKILL)
        if _alive(pgid, set()):  # members that outlived their leader: while they live, the group id is ours
            _signal_group(pgid, signal.SIGKILL)

    def leftovers(self) -> list[str]:
        """Names of this process's group members and noted descendants that are still alive."""
        return _alive(self.popen.pid, self.family)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Deployment:
    """A SuperLink, its SuperNodes and the ``flwr`` CLI, all under one folder; see the module docstring."""

    def __init__(self, folder: Path, certificates: Path | None, *, auth: bool = False,
                 federation: str = "fed-dp-test") -> None:
        if auth and certificates is None:
            raise ValueError("SuperNode authentication needs TLS (certificates)")
        self.folder = folder
        self.certificates = certificates
        self.auth = auth
        self.federation = federation
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.superlink: Process | None = None
        self.superlinks: list[Process] = []  # every start, the running one last
        self.supernodes: list[Process] = []
        self.services: list[Process] = []  # node services beside SuperNodes (start_supernode(service=True))
        self.runs: list[Process] = []
        self._cli_home = self._home("cli")
        self._write_cli_config()

    # --- environment ---------------------------------------------------------------------------------------

    def _home(self, name: str) -> Path:
        home = self.folder / "flwr-home" / name
        home.mkdir(parents=True, exist_ok=True)
        return home

    def _env(self, home: Path) -> dict[str, str]:
        return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1"}

    def _write_cli_config(self) -> None:
        """The ``flwr`` CLI's connection entry: ``[superlink.<federation>]`` in $FLWR_HOME/config.toml."""
        entry = [f'[superlink]\ndefault = "{self.federation}"\n', f"[superlink.{self.federation}]",
                 f'address = "{self.address}"']
        if self.certificates is None:
            entry.append("insecure = true")
        else:
            entry.append(f'root-certificates = "{self.certificates / "ca.crt"}"')
        (self._cli_home / "config.toml").write_text("\n".join(entry) + "\n")

    def _start(self, name: str, command: list[str], cwd: Path) -> Process:
        log = self.folder / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=cwd, env=self._env(self._home(name)), start_new_session=True)
        return Process(name, popen, log)

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run one ``flwr`` CLI command from the repository root against this deployment."""
        return subprocess.run([executable("flwr"), *args], check=False, cwd=REPO, env=self._env(self._cli_home),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    # --- processes -----------------------------------------------------------------------------------------

    def superlink_command(self) -> list[str]:
        """The SuperLink with its state in ``folder/superlink/state.db`` (it survives a restart), on TLS."""
        command = [executable("flower-superlink"), "--disable-runtime-dependency-installation", "--port", str(self.port),
                   "--database", str(self.folder / "superlink" / "state.db")]
        if self.certificates is None:
            return [*command, "--insecure"]
        command += ["--ssl-ca-certfile", str(self.certificates / "ca.crt"),
                    "--ssl-certfile", str(self.certificates / "server.pem"),
                    "--ssl-keyfile", str(self.certificates / "server.key")]
        return [*command, "--enable-supernode-auth"] if self.auth else command

    def start_superlink(self, timeout: float = 60.0) -> Process:
        """Start the SuperLink (working directory ``folder/superlink``) and wait until /health answers. Called
        again after a stop, it restarts the SuperLink on the same port and database (its log: superlink-1, ...)."""
        name = "superlink" if not self.superlinks else f"superlink-{len(self.superlinks)}"
        self.superlink = self._start(name, self.superlink_command(), self.folder / "superlink")
        self.superlinks.append(self.superlink)
        context = ssl.create_default_context(cafile=str(self.certificates / "ca.crt")) if self.certificates else None
        url = f"{'https' if self.certificates else 'http'}://{self.address}/health"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as response:
                    if response.status == 200:
                        return self.superlink
            except OSError:
                pass
            if not self.superlink.running() or time.monotonic() > deadline:
                raise RuntimeError(f"the SuperLink did not become healthy at {url}:\n{tail(self.superlink.output())}")
            time.sleep(0.2)

    def register(self, public_key: Path) -> subprocess.CompletedProcess:
        """``flwr supernode register <public_key> <federation>`` (SuperNode authentication)."""
        return self.flwr("supernode", "register", str(public_key), self.federation, "--format", "json")

    def supernode_command(self, node_config: dict[str, Any], private_key: Path | None = None,
                          port: int | None = None) -> list[str]:
        command = [executable("flower-supernode"), "--superlink", self.address, "--port", str(port or free_port()),
                   "--node-config", format_node_config(node_config)]
        command += ["--root-certificates", str(self.certificates / "ca.crt")] if self.certificates else ["--insecure"]
        return [*command, "--auth-supernode-private-key", str(private_key)] if private_key else command

    def start_supernode(self, node_config: dict[str, Any], private_key: Path | None = None,
                        extra: tuple[str, ...] = (), *, service: bool = False) -> Process:
        """Start one SuperNode (its Runtime API on a free port) hosting the users of ``node_config``; ``service``:
        first a node service beside it (``fed-dp node-service``, socket ``folder/<name>/node.sock``), named in its
        node config."""
        name = f"supernode{len(self.supernodes)}"
        if service:
            socket = self.folder / name / "node.sock"
            started = self._start(f"{name}-service", [executable("fed-dp"), "node-service", "--socket", str(socket)],
                                  self.folder / name)
            self.services.append(started)
            started.wait_for_output("node service listening", timeout=60)
            node_config = {**node_config, NODE_CONFIG_KEY: str(socket)}
        node = self._start(name, [*self.supernode_command(node_config, private_key), *extra], self.folder / name)
        self.supernodes.append(node)
        return node

    def wait_for_nodes(self, nodes: list[Process], timeout: float = 60.0) -> dict[int, Process]:
        """node id → SuperNode, once every node has logged the id the SuperLink gave it."""
        return {int(node.wait_for_output(r"SuperNode ID: (\d+)", timeout).group(1)): node for node in nodes}

    # --- runs ----------------------------------------------------------------------------------------------

    def submit(self, run_config: dict[str, Any], *, fed_dp: bool = False, app: Path = REPO) -> Process:
        """Start ``flwr run . <federation> --stream --run-config ...`` for the Flower app folder ``app`` (default:
        the repository root, the project's app), from a folder holding only what ``flwr run`` bundles of it
        (:func:`~fed_dp.simulations.launch.local_simulation.bundle_folder`: the same app, without Flower's CLI listing the
        ~48,000 files of a ``.venv`` inside the project, ~2.7 CPU seconds a run); ``fed_dp``: ``fed-dp submit
        <federation> --run-config ...`` instead (its exit status says whether the run completed)."""
        overrides = format_run_config(run_config)
        folder = bundle_folder(app, self.folder / f"bundle-{len(self.runs)}")
        command = ([executable("fed-dp"), "submit", self.federation, "--run-config", overrides] if fed_dp else
                   [executable("flwr"), "run", ".", self.federation, "--stream", "--run-config", overrides])
        log = self.folder / "logs" / f"flwr-run-{len(self.runs)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=folder, env=self._env(self._cli_home), start_new_session=True)
        self.runs.append(Process("flwr-run", popen, log))
        return self.runs[-1]

    def finish(self, submitted: Process, timeout: float) -> RunOutcome:
        """Wait for a submitted run's stream to end, then read the run's status with ``flwr ls``
        (``fed_dp.simulations.launch.submit.outcome``, what ``fed-dp submit`` does)."""
        try:
            submitted.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            submitted.stop()
            raise TimeoutError(f"flwr run did not finish within {timeout:.0f} s\n{self.diagnostics()}") from None
        return outcome(submitted.popen.returncode, submitted.output(), self.federation, cwd=REPO,
                       env=self._env(self._cli_home))

    def run(self, run_config: dict[str, Any], timeout: float = 120.0) -> RunOutcome:
        """Submit a run and wait for it (see ``submit`` and ``finish``)."""
        return self.finish(self.submit(run_config), timeout)

    def run_details(self, run_id: int) -> dict[str, Any]:
        """The run's entry of ``flwr ls <federation> --run-id <id> --format json`` (status, elapsed, ...)."""
        return run_details(run_id, self.federation, cwd=REPO, env=self._env(self._cli_home))

    # --- teardown ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every ``flwr run`` client still streaming, every SuperNode and node service, then the SuperLink
        (process groups)."""
        for process in [*self.runs, *self.supernodes, *self.services, *self.superlinks]:
            process.stop()

    def leftovers(self, wait: float = 10.0) -> dict[str, list[str]]:
        """Process name → live members of its group, after up to ``wait`` s; empty once all have exited."""
        started = [*self.superlinks, *self.supernodes, *self.services, *self.runs]
        deadline = time.monotonic() + wait
        while True:
            alive = {p.name: members for p in started if (members := p.leftovers())}
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def diagnostics(self, lines: int = 30) -> str:
        """The last lines of every log, for assertion messages."""
        logs = sorted((self.folder / "logs").glob("*.log"))
        return "\n".join(f"--- {log.name}\n{tail(log.read_text(errors='replace'), lines)}" for log in logs)


@contextmanager
def deployment(folder: Path, certificates: Path | None, **options: Any) -> Iterator[Deployment]:
    """A ``Deployment`` that is stopped on exit, whatever happened inside."""
    running = Deployment(folder, certificates, **options)
    try:
        yield running
    finally:
        running.stop()
