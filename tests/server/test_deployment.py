"""The fed-dp Flower apps in a real deployment: SuperLink and SuperNodes as processes on 127.0.0.1, over TLS.

Each test starts its own SuperLink and SuperNodes (see deployment.py), submits ``flwr run . <federation>``
from the repository root and reads what the ServerApp wrote: ``results.json``, the checkpoint and the operator's
secret diagnostics (``secret/diagnostics.jsonl``: counts that published records do not carry) in an
absolute ``server.checkpoint-dir``, and its log lines in the ``flwr run --stream`` output. The expected ε
comes from ``fed_dp.accounting.epsilon`` with a PrivacyConfig built here and checked against the one the
ServerApp parses from pyproject.toml's run config. Every process is stopped (process group) after each test.

These tests take minutes (on two cores: each message to a SuperNode starts a ``flwr-clientapp`` process that
imports torch); they need ``openssl`` (certificates) and the Flower executables of the environment.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from deployment import COMPLETED, REPO, Deployment, RunResult, make_certificates

from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.checkpoint import load_checkpoint, read_diagnostics
from fed_dp.clients.task import build_task, initial_model
from fed_dp.config import PrivacyConfig
from fed_dp.round import begin_round, finish_round, init_server
from fed_dp.run_config import RunConfig

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to create the TLS certificates"),
    pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen is needed for SuperNode keys"),
    pytest.mark.skipif(shutil.which("flower-superlink") is None or shutil.which("flwr") is None,
                       reason="the Flower executables (flower-superlink, flower-supernode, flwr) are not on PATH"),
]

USERS = ("0-13", "14-26", "27-39")  # task.users = 40, one disjoint range per SuperNode
SEED = 1


def run_config(checkpoint_dir: Path, rounds: int, **extra: Any) -> dict[str, Any]:
    """The run-config overrides of these tests (everything else: pyproject.toml's defaults)."""
    return {"run.seed": SEED, "privacy.rounds": rounds, "privacy.accountant": "rdp",
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


def assert_completed(result: RunResult, d: Deployment) -> None:
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
    assert [r["round"] for r in records] == list(range(config.rounds))
    assert [r["epsilon"] for r in records] == [epsilon(config, t + 1) for t in range(config.rounds)]
    ledger = load_checkpoint(checkpoint_dir)["state"]["ledger"]
    assert PrivacyConfig(**ledger["config"]) == config
    assert [r["epsilon"] for r in ledger["records"]] == [epsilon(config, t + 1) for t in range(config.rounds)]
    assert all(set(r) == {"round", "epsilon"} for r in ledger["records"])  # the published ledger: no counts


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """CA, server certificate and three SuperNode key pairs from server/make_certificates.sh."""
    return make_certificates(tmp_path_factory.mktemp("certificates"), nodes=3)


@pytest.fixture
def new_deployment(tmp_path, certificates):
    """deployment(auth=...) → a TLS Deployment under tmp_path; stopped, and checked for leftovers, afterwards."""
    started: list[Deployment] = []

    def make(auth: bool = False) -> Deployment:
        d = Deployment(tmp_path / f"deployment{len(started)}", certificates, auth=auth)
        started.append(d)
        return d

    try:
        yield make
    finally:
        for d in started:
            d.stop()
    for d in started:
        assert not d.leftovers(), f"processes left behind: {d.leftovers()}"


def test_tls_deployment_three_supernodes_trains_and_reports_epsilon(tmp_path, new_deployment):
    """Three SuperNodes over TLS, 3 rounds: completed, ε per round = dp_accounting's (results, checkpoint, log)."""
    d = new_deployment()
    start_nodes(d)
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=3)
    config = expected_privacy(overrides)

    result = d.run(overrides, timeout=240)

    assert_completed(result, d)
    records = read_results(checkpoint_dir)
    assert len(records) == 3
    assert records[-1]["epsilon"] == epsilon(config, 3)
    assert_ledger_is_uninterrupted(records, config, checkpoint_dir)
    logged = logged_rounds(result.output, 3)
    assert sorted(logged) == [1, 2, 3], f"the ServerApp did not log ε every round:\n{result.output[-3000:]}"
    counts = read_diagnostics(checkpoint_dir)
    assert [c["cohort_size"] for c in counts] == [len(c) for c in uninterrupted_cohorts(overrides)]
    for t, (record, count) in enumerate(zip(records, counts, strict=True), start=1):
        assert logged[t] == pytest.approx(record["epsilon"], abs=5e-5)
        assert count["dropped"] == [] and count["replied_users"] == count["cohort_size"]
        assert not {"cohort_size", "replied_users", "dropped"} & set(record)
        assert 0.0 <= record["eval_accuracy"] <= 1.0
    initial = initial_model(build_task(RunConfig.from_flat({}).task), SEED)[2]
    final = load_checkpoint(checkpoint_dir)["state"]["params"]
    assert final.shape == initial.shape and torch.isfinite(final).all()
    assert not torch.allclose(final, initial.to(final.dtype)), "three rounds of training left the model unchanged"


def test_killing_a_supernode_mid_run_still_completes_with_an_unchanged_ledger(tmp_path, new_deployment):
    """SIGTERM (not SIGKILL) to one SuperNode's process group once round 1's checkpoint is written.

    SIGTERM makes the SuperNode deregister, so the SuperLink answers the ServerApp's messages to it with an
    error reply within seconds. After a SIGKILL the SuperLink notices only after two missed heartbeats (about
    40 s), so round 2 waits out server.reply-timeout (30 s): the same records, but about 25 s longer (measured
    102 s against 78 s). Either way the ServerApp counts the node's sampled users as dropped and releases.
    """
    d = new_deployment()
    node_ids = start_nodes(d)
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=4)
    config = expected_privacy(overrides)
    victim_id, victim = max(node_ids.items(), key=lambda item: item[1].name)  # the last SuperNode (users 27-39)
    victim_users = set(range(27, 40))
    cohorts = uninterrupted_cohorts(overrides)

    submitted = d.submit(overrides)
    deadline = time.monotonic() + 180
    while (checkpoint := load_checkpoint_when_written(checkpoint_dir)) is None or checkpoint["state"]["round"] < 1:
        assert submitted.running() and time.monotonic() < deadline, f"no round-1 checkpoint\n{d.diagnostics()}"
        time.sleep(0.2)
    victim.stop(signal.SIGTERM)
    result = d.finish(submitted, timeout=240)

    assert_completed(result, d)
    records = read_results(checkpoint_dir)
    assert len(records) == 4
    assert_ledger_is_uninterrupted(records, config, checkpoint_dir)
    counts = read_diagnostics(checkpoint_dir)
    assert [c["cohort_size"] for c in counts] == [len(c) for c in cohorts], "a lost node changed the sampling"
    assert counts[0]["dropped"] == [] and counts[0]["replied_users"] == counts[0]["cohort_size"]
    for t, (record, cohort) in enumerate(zip(counts, cohorts, strict=True)):
        sampled = len(cohort & victim_users)
        lost = record["cohort_size"] - record["replied_users"]
        # round 2's message may in principle have been answered before the signal; rounds 3 and 4 cannot be
        assert lost in ((0, sampled) if t == 1 else (0,) if t == 0 else (sampled,)), (t, sampled, record)
        if lost:
            assert any(p.startswith(f"node {victim_id}: ") and p.endswith(f"({sampled} sampled user(s) dropped)")
                       for p in record["dropped"]), record  # the node named, whoever sent the error reply
        # every entry names the stopped node, or is Flower's own error reply that names no node
        assert all(p.startswith((f"node {victim_id}: ", "SuperLink: ")) for p in record["dropped"]), record["dropped"]
    assert sum(len(c & victim_users) for c in cohorts[2:]) > 0, "the stopped node was never sampled after the kill"
    assert sorted(logged_rounds(result.output, 4)) == [1, 2, 3, 4]


def load_checkpoint_when_written(folder: Path) -> dict[str, Any] | None:
    """The checkpoint, or None while there is none (it is replaced atomically, never read half-written)."""
    return load_checkpoint(folder)


def test_supernode_authentication_rejects_unregistered_nodes(tmp_path, new_deployment, certificates):
    """--enable-supernode-auth: registered keys connect and train; an unregistered key cannot activate."""
    d = new_deployment(auth=True)
    d.start_superlink()
    for i in (0, 1):
        registered = d.register(certificates / f"node{i}.pub")
        assert registered.returncode == 0, registered.stdout + registered.stderr
    nodes = [d.start_supernode({"users": users}, private_key=certificates / f"node{i}")
             for i, users in enumerate(("0-19", "20-39"))]
    intruder = d.start_supernode({"users": "0-39"}, private_key=certificates / "node2")  # key never registered
    d.wait_for_nodes(nodes)
    try:
        intruder.popen.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the unregistered SuperNode is still running after 60 s:\n{intruder.output()}")
    assert intruder.popen.returncode != 0 and "Failed to activate" in intruder.output(), intruder.output()
    checkpoint_dir = tmp_path / "checkpoints"

    overrides = run_config(checkpoint_dir, rounds=1, **{"server.min-nodes": 2, "run.eval-every": 0})
    result = d.run(overrides, timeout=180)

    assert_completed(result, d)
    assert len(read_results(checkpoint_dir)) == 1
    (record,) = read_diagnostics(checkpoint_dir)
    assert record["dropped"] == [] and record["replied_users"] == record["cohort_size"]
