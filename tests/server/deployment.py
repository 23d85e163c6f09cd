"""The deployment tests' run config and checks; the deployment itself (SuperLink, SuperNodes and ``flwr run`` as
processes on 127.0.0.1) is ``fed_dp.simulations.launch.local_deployment``, whose names this module re-exports for
the tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from deployment_task import REFERENCE as TASK

from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.checkpoint import load_checkpoint
from fed_dp.clients.task import build_task, initial_model
from fed_dp.config import PrivacyConfig
from fed_dp.round import begin_round, finish_round, init_server
from fed_dp.run_config import RunConfig
from fed_dp.simulations.launch.local_deployment import Deployment, Process, deployment, format_node_config, tail  # noqa: F401
from fed_dp.simulations.launch.submit import COMPLETED, RunOutcome

REPO = Path(__file__).resolve().parents[2]
#: ``pytestmark`` of the deployment tests: skipped, saying why, where the tools they need are missing.
REQUIRES_TOOLS = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to create the TLS certificates"),
    pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen is needed for SuperNode keys"),
    pytest.mark.skipif(shutil.which("flower-superlink") is None or shutil.which("flwr") is None,
                       reason="the Flower executables (flower-superlink, flower-supernode, flwr) are not on PATH"),
]
CERTIFICATE_SCRIPT = REPO / "server" / "make_certificates.sh"


def make_certificates(folder: Path, nodes: int = 0) -> Path:
    """Run server/make_certificates.sh into ``folder`` (CA, server certificate, ``nodes`` auth key pairs)."""
    subprocess.run(["bash", str(CERTIFICATE_SCRIPT), str(folder), str(nodes)], check=True, capture_output=True,
                   text=True, timeout=60)
    return folder


# --- the run config of the deployment tests and the checks of what a run wrote -------------------------------

USERS = ("0-13", "14-26", "27-39")  # task.users = 40, one disjoint range per SuperNode
SEED = 1


def run_config(checkpoint_dir: Path, rounds: int, **extra: Any) -> dict[str, Any]:
    """The run-config overrides of these tests (everything else: pyproject.toml's defaults); the task is
    deployment_task.py's (heavy-tail without Flower Datasets: see there why)."""
    return {"task.ref": TASK, "run.seed": SEED, "privacy.rounds": rounds, "privacy.accountant": "rdp",
            "server.checkpoint-dir": str(checkpoint_dir), "server.min-nodes": len(USERS), "server.reply-timeout": 30.0,
            "client.device": "cpu", **extra}


def pyproject_run_config() -> dict[str, Any]:
    """[tool.flwr.app.config] flattened to the dotted keys the ServerApp receives."""
    tables = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in table.items():
            flat.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return flat

    return flatten(tables)


def expected_privacy(overrides: dict[str, Any]) -> PrivacyConfig:
    """The mechanism of the run, built by hand from pyproject's values and checked against the ServerApp's parse."""
    rounds = int(overrides["privacy.rounds"])
    config = PrivacyConfig(num_users=40, expected_cohort=10, rounds=rounds, noise_multiplier=1.0, delta=1e-5,
                           accountant=overrides["privacy.accountant"])
    parsed = RunConfig.from_flat({**pyproject_run_config(), **overrides}).privacy.replace(num_users=40)
    assert parsed == config, f"pyproject's run config no longer gives the PrivacyConfig these tests expect: {parsed}"
    return config


def uninterrupted_cohorts(overrides: dict[str, Any]) -> list[set[int]]:
    """The users the ServerApp samples each round with run.seed, from fed_dp alone (no Flower, nobody drops)."""
    run = RunConfig.from_flat({**pyproject_run_config(), **overrides})
    privacy = resolve_privacy(run.privacy, 40)
    params = initial_model(build_task(run.task), run.run.seed)[2]
    state = init_server(privacy, run.optimizer.build(), params, seed=run.run.seed)
    cohorts = []
    for _ in range(privacy.rounds):
        plan = begin_round(state)
        cohorts.append(set(plan.cohort.tolist()))
        state, _ = finish_round(state, plan, [])  # the cohorts do not depend on the replies
    return cohorts


def start_nodes(d: Deployment) -> dict[int, Any]:
    """The SuperLink and one SuperNode per range of USERS; node id → SuperNode process once all connected."""
    d.start_superlink()
    return d.wait_for_nodes([d.start_supernode({"users": users}) for users in USERS])


def assert_completed(result: RunOutcome, d: Deployment) -> None:
    assert result.returncode == 0 and result.status == COMPLETED, (
        f"run {result.run_id}: flwr run rc={result.returncode}, status {result.status!r} "
        f"{result.details.get('status-details', '')}\n{d.diagnostics()}")


def read_results(checkpoint_dir: Path) -> list[dict[str, Any]]:
    return json.loads((checkpoint_dir / "results.json").read_text())


def logged_rounds(output: str, rounds: int) -> dict[int, float]:
    """round (1-based) → ε from the ServerApp's "round t/T: epsilon ..., delta ..." log lines."""
    pattern = rf"round (\d+)/{rounds}: epsilon ([0-9.]+), delta"
    return {int(t): float(e) for t, e in re.findall(pattern, output)}


def assert_ledger_is_uninterrupted(records: list[dict[str, Any]], config: PrivacyConfig, checkpoint_dir: Path) -> None:
    """ε after every round is exactly dp_accounting's ε of t rounds, in results.json and in the checkpoint."""
    assert [r["round"] for r in records] == list(range(config.rounds + 1))  # 0: the initial model's evaluation
    assert [r["epsilon"] for r in records] == [0.0] + [epsilon(config, t) for t in range(1, config.rounds + 1)]
    ledger = load_checkpoint(checkpoint_dir)["state"]["ledger"]
    assert PrivacyConfig(**ledger["config"]) == config
    assert [r["epsilon"] for r in ledger["records"]] == [epsilon(config, t + 1) for t in range(config.rounds)]
    assert all(set(r) == {"round", "epsilon"} for r in ledger["records"])  # the published ledger: no counts
