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

import subprocess

import pytest
import torch
from deployment import (REQUIRES_TOOLS, SEED, assert_completed, assert_ledger_is_uninterrupted, expected_privacy,
                        logged_rounds, read_results, run_config, start_nodes, uninterrupted_cohorts)

from fed_dp.accounting import epsilon
from fed_dp.checkpoint import load_checkpoint, read_diagnostics
from fed_dp.clients.task import build_task, initial_model
from fed_dp.run_config import RunConfig

pytestmark = REQUIRES_TOOLS


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
    assert [r["round"] for r in records] == [0, 1, 2, 3]  # 0: the initial model's evaluation
    assert records[-1]["epsilon"] == epsilon(config, 3)
    assert_ledger_is_uninterrupted(records, config, checkpoint_dir)
    logged = logged_rounds(result.output, 3)
    assert sorted(logged) == [1, 2, 3], f"the ServerApp did not log ε every round:\n{result.output[-3000:]}"
    counts = read_diagnostics(checkpoint_dir)
    assert [c["cohort_size"] for c in counts] == [len(c) for c in uninterrupted_cohorts(overrides)]
    assert 0.0 <= records[0]["eval_accuracy"] <= 1.0  # round 0: the initial model, evaluated before round 1
    for t, (record, count) in enumerate(zip(records[1:], counts, strict=True), start=1):
        assert logged[t] == pytest.approx(record["epsilon"], abs=5e-5)
        assert count["dropped"] == [] and count["replied_users"] == count["cohort_size"]
        assert not {"cohort_size", "replied_users", "dropped"} & set(record)
        assert 0.0 <= record["eval_accuracy"] <= 1.0
    initial = initial_model(build_task(RunConfig.from_flat(overrides).task), SEED)[2]
    final = load_checkpoint(checkpoint_dir)["state"]["params"]
    assert final.shape == initial.shape and torch.isfinite(final).all()
    assert not torch.allclose(final, initial.to(final.dtype)), "three rounds of training left the model unchanged"


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
