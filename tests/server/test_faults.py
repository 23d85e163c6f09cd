"""The fault-injection suite: a real SuperLink and SuperNodes on 127.0.0.1 (TLS), processes killed and restarted.

Faults and what must hold:
    one node stopped (SIGTERM)           the run completes; its sampled users are dropped; the ledger and the
                                         cohorts are those of an uninterrupted run; its departure logged once
    one node killed (SIGKILL), restarted its users are served again (the restarted node has a new node id)
    every node killed                    the run fails (status finished:failed, fed-dp submit exits 1) after
                                         at most server.max-empty-rounds released rounds; the ledger is intact
    the SuperLink killed and restarted   with its database the nodes reconnect; the run submitted again resumes
                                         from the checkpoint: ledger, ε and final model of an uninterrupted run
    nodes that reply with an oversized   the oversized update is re-clipped and counted; the NaN and the misshaped
    update, a NaN, a wrong shape         ones are refused, their users dropped, each named in the operator's
                                         diagnostics; the run completes with the ledger of an uninterrupted run

The same replies are also covered with Flower's simulation engine (test_bad_replies.py) and, through the
Strategy, in test_flower_strategy.py. The two tests not marked ``faults`` run in CI; the rest (a few minutes
each on 2 cores) with ``pytest -m faults tests/server/test_faults.py``.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from deployment import (REPO, REQUIRES_TOOLS, USERS, Deployment, Process, assert_completed, assert_ledger_is_uninterrupted,
                        expected_privacy, logged_rounds, read_results, run_config, start_nodes, uninterrupted_cohorts)

from fed_dp.accounting import epsilon
from fed_dp.checkpoint import load_checkpoint, read_diagnostics
from fed_dp.clients.task import build_task
from fed_dp.run_config import RunConfig
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.launch.submit import run_id_of

pytestmark = REQUIRES_TOOLS
LAST_USERS = set(range(27, 40))  # the users of the last SuperNode of deployment.USERS


def wait_for_round(d: Deployment, submitted: Process, checkpoint_dir: Path, rounds: int, timeout: float = 240) -> None:
    """Until the checkpoint has ``rounds`` rounds committed."""
    deadline = time.monotonic() + timeout
    while (checkpoint := load_checkpoint(checkpoint_dir)) is None or checkpoint["state"]["round"] < rounds:
        assert submitted.running() and time.monotonic() < deadline, f"no round-{rounds} checkpoint\n{d.diagnostics()}"
        time.sleep(0.2)


def last_node(node_ids: dict[int, Process]) -> tuple[int, Process]:
    return max(node_ids.items(), key=lambda item: item[1].name)  # supernode2: users 27-39


def assert_same_sampling(counts: list[dict[str, Any]], cohorts: list[set[int]]) -> None:
    assert [c["cohort_size"] for c in counts] == [len(c) for c in cohorts], "a fault changed the sampling"


def test_a_killed_and_restarted_node_is_served_again(tmp_path, new_deployment):
    """SIGKILL to the last SuperNode once round 1 is committed, then the same SuperNode started again at once.
    It connects with a new node id while the SuperLink still lists the old one; the ServerApp recognises it by
    its users, logs that it is back, and from round 3 on every sampled user of it replies again."""
    d = new_deployment()
    victim_id, victim = last_node(start_nodes(d))
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=5)
    config, cohorts = expected_privacy(overrides), uninterrupted_cohorts(overrides)

    submitted = d.submit(overrides)
    wait_for_round(d, submitted, checkpoint_dir, 1)
    victim.stop(signal.SIGKILL)
    (new_id,) = d.wait_for_nodes([d.start_supernode({"users": "27-39"})])
    result = d.finish(submitted, timeout=400)

    assert_completed(result, d)
    assert_ledger_is_uninterrupted(read_results(checkpoint_dir), config, checkpoint_dir)
    counts = read_diagnostics(checkpoint_dir)
    assert_same_sampling(counts, cohorts)
    for t in (0, 2, 3, 4):  # round 2 may have been in flight to the killed process
        assert counts[t]["replied_users"] == counts[t]["cohort_size"], (t, counts[t])
    assert sum(len(c & LAST_USERS) for c in cohorts[2:]) > 0, "the restarted node was never sampled afterwards"
    back = re.findall(r"node 'users 27-39' is back as node id (\d+) \(was node id (\d+)\)", result.output)
    assert back == [(str(new_id), str(victim_id))], result.output[-4000:]
    assert sorted(logged_rounds(result.output, 5)) == [1, 2, 3, 4, 5]


def test_every_node_killed_fails_the_run_within_the_allowed_empty_rounds(tmp_path, new_deployment):
    """SIGKILL to every SuperNode once round 1 is committed. The SuperLink lists them as connected until their
    heartbeats expire, so rounds may still be sent to them and come back empty; the run must stop (no reply
    counted for server.max-empty-rounds rounds, or fewer than server.min-nodes connected for server.node-wait)
    with status finished:failed, ``fed-dp submit`` exiting 1, at most 1 + 1 rounds in a ledger that stays intact
    and resumable."""
    d = new_deployment()
    nodes = start_nodes(d)
    checkpoint_dir = tmp_path / "checkpoints"
    # reply-timeout also bounds the first user query, which waits for every node's first ClientApp process (Flower,
    # torch, the task: over 10 s for 3 nodes on 2 cores with flwr 1.42, where 10 s used to do)
    overrides = run_config(checkpoint_dir, rounds=10, **{"server.reply-timeout": 30.0, "server.node-wait": 5.0,
                                                         "server.max-empty-rounds": 1})
    config = expected_privacy(overrides)

    submitted = d.submit(overrides, fed_dp=True)
    wait_for_round(d, submitted, checkpoint_dir, 1)
    for node in nodes.values():
        node.stop(signal.SIGKILL)
    result = d.finish(submitted, timeout=300)

    assert result.returncode == 1 and result.status == "finished:failed", (result.returncode, result.status,
                                                                          result.output[-4000:])
    assert "NoRepliesError" in result.output or "NotEnoughNodesError" in result.output, result.output[-4000:]
    assert f"run {result.run_id}: finished:failed" in result.output  # fed-dp submit's last word
    # issue 40 item 7: the run's status (Flower's "ServerApp failed with exception: ...") says how to resume it
    status = result.details.get("status-details", "")
    assert re.search(rf"The run can be resumed: round\(s\) 1-[12] are committed in {re.escape(str(checkpoint_dir))}"
                     rf".*server\.checkpoint-dir='{re.escape(str(checkpoint_dir))}'", status), status
    records = read_results(checkpoint_dir)
    ledger = load_checkpoint(checkpoint_dir)["state"]["ledger"]["records"]
    assert records[0]["round"] == 0  # the initial model's evaluation; then one record per released round
    released = records[1:]
    assert 1 <= len(ledger) <= 2 and len(released) == len(ledger)
    assert [r["epsilon"] for r in released] == [r["epsilon"] for r in ledger]
    assert [r["epsilon"] for r in released] == [epsilon(config, t) for t in range(1, len(released) + 1)]


@pytest.mark.faults
def test_a_stopped_node_loses_only_its_users_and_is_logged_once(tmp_path, new_deployment):
    """SIGTERM to the last SuperNode once round 1 is committed: it deregisters, the ServerApp logs its departure
    once and counts its sampled users as dropped; the run completes with the ledger of an uninterrupted run."""
    d = new_deployment()
    victim_id, victim = last_node(start_nodes(d))
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=4, **{"server.min-nodes": 2})
    config, cohorts = expected_privacy(overrides), uninterrupted_cohorts(overrides)

    submitted = d.submit(overrides)
    wait_for_round(d, submitted, checkpoint_dir, 1)
    victim.stop(signal.SIGTERM)
    result = d.finish(submitted, timeout=300)

    assert_completed(result, d)
    assert_ledger_is_uninterrupted(read_results(checkpoint_dir), config, checkpoint_dir)
    counts = read_diagnostics(checkpoint_dir)
    assert_same_sampling(counts, cohorts)
    assert counts[0]["dropped"] == [] and counts[0]["replied_users"] == counts[0]["cohort_size"]
    for t, (record, cohort) in enumerate(zip(counts, cohorts, strict=True)):
        sampled = len(cohort & LAST_USERS)
        lost = record["cohort_size"] - record["replied_users"]
        # round 2's message may have been answered before the signal; rounds 3 and 4 cannot be
        assert lost in ((0, sampled) if t == 1 else (0,) if t == 0 else (sampled,)), (t, sampled, record)
        assert all(p.startswith((f"node 'users 27-39' (id {victim_id}): ", "SuperLink: ", "sampled users on no "))
                   for p in record["dropped"]), record["dropped"]
    assert sum(len(c & LAST_USERS) for c in cohorts[2:]) > 0, "the stopped node was never sampled after the kill"
    left = re.findall(r"node 'users 27-39' \(node id (\d+)\) left", result.output)
    assert left == [str(victim_id)], result.output[-4000:]


@pytest.mark.faults
def test_a_superlink_restart_resumes_from_the_checkpoint_like_an_uninterrupted_run(tmp_path, new_deployment):
    """SIGKILL to the SuperLink and everything it started (the ServerApp too) once round 2 is committed, as a
    crash of its machine would. Restarted on its database, the SuperNodes reconnect by themselves and
    ``flwr stop`` marks the interrupted run stopped. The run submitted again with the same checkpoint folder
    resumes: the ledger and ε equal an uninterrupted run's, and the final model equals the in-process
    engine's for the same seeds."""
    d = new_deployment()
    start_nodes(d)
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=5)
    config = expected_privacy(overrides)

    first = d.submit(overrides)
    wait_for_round(d, first, checkpoint_dir, 2)
    d.superlink.stop(signal.SIGKILL)
    first.stop()  # its log stream has lost the SuperLink
    d.start_superlink()
    time.sleep(10)  # without its database the SuperLink would answer 401 and the SuperNodes would exit by now
    for node in d.supernodes:  # gRPC reconnects them silently; the resumed run below shows that every node replies
        assert node.running(), node.output()[-2000:]
    interrupted = run_id_of(first.output())
    assert d.run_details(interrupted)["status"] == "running"  # its ServerApp died with the SuperLink
    stopped = d.flwr("stop", str(interrupted), d.federation)  # the README's step 3
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert d.run_details(interrupted)["status"] == "finished:stopped"
    result = d.finish(d.submit(overrides, fed_dp=True), timeout=400)

    assert_completed(result, d)
    assert "resumed from" in result.output and f"run {result.run_id}: finished:completed" in result.output
    records = read_results(checkpoint_dir)
    assert_ledger_is_uninterrupted(records, config, checkpoint_dir)
    assert all(c["replied_users"] == c["cohort_size"] for c in read_diagnostics(checkpoint_dir))
    run = RunConfig.from_flat({**overrides})
    engine = train(build_task(run.task), config, run.optimizer.build(), run.local, seed=run.run.seed, device="cpu")
    torch.testing.assert_close(load_checkpoint(checkpoint_dir)["state"]["params"], engine.params, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.faults
def test_oversized_nan_and_misshaped_replies_from_real_supernodes(tmp_path, new_deployment):
    """A Flower app of its own whose ClientApp (faulty_client.py) corrupts the replies of the node config's
    ``fault``: users 0-13 send an update of norm 10⁶, users 14-26 a NaN, users 27-39 a vector of the wrong
    shape. The first is re-clipped and counted; the others are refused and their users dropped, with the
    reason in the operator's diagnostics; sampling, ledger and ε are those of an uninterrupted run."""
    app = tmp_path / "faulty-app"
    app.mkdir()
    pyproject = (REPO / "pyproject.toml").read_text()
    for old, new in (('clientapp = "fed_dp.clients.app:app"', 'clientapp = "faulty_client:app"'),
                     ('fab-include = ["README.md"]', 'fab-include = ["README.md", "faulty_client.py"]')):
        assert old in pyproject, old
        pyproject = pyproject.replace(old, new)
    (app / "pyproject.toml").write_text(pyproject)
    shutil.copy(Path(__file__).with_name("faulty_client.py"), app)
    (app / "README.md").write_text("fed-dp's ServerApp with a ClientApp that corrupts its replies (test_faults.py)\n")
    d = new_deployment()
    d.start_superlink()
    d.wait_for_nodes([d.start_supernode({"users": users, "fault": fault})
                      for users, fault in zip(USERS, ("huge", "nan", "shape"), strict=True)])
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=3, **{"server.max-empty-rounds": 3})
    config, cohorts = expected_privacy(overrides), uninterrupted_cohorts(overrides)

    result = d.finish(d.submit(overrides, app=app), timeout=300)

    assert_completed(result, d)
    assert_ledger_is_uninterrupted(read_results(checkpoint_dir), config, checkpoint_dir)
    counts = read_diagnostics(checkpoint_dir)
    assert_same_sampling(counts, cohorts)
    for record, cohort in zip(counts, cohorts, strict=True):
        huge = len(cohort & set(range(14)))
        assert record["replied_users"] == huge and record["reclipped_replies"] == (1 if huge else 0), record
        dropped = " | ".join(record["dropped"])
        if cohort & set(range(14, 27)):
            assert "node 'users 14-26'" in dropped and "contains NaN or Inf" in dropped, dropped
        if cohort & set(range(27, 40)):
            assert "node 'users 27-39'" in dropped and "has shape" in dropped, dropped
    assert sum(len(c & set(range(14, 40))) for c in cohorts) > 0, "no corrupted node was ever asked"


@pytest.mark.faults
def test_an_authenticated_node_restarted_under_its_old_id_is_served_again(tmp_path, new_deployment, certificates):
    """--enable-supernode-auth: a SuperNode's id belongs to its key, so a killed node comes back under the same
    id, once the SuperLink has marked the old instance offline (until then it refuses to activate it). After the
    ServerApp has logged its departure, it must ask that id again, log the return once, and serve its users."""
    d = new_deployment(auth=True)
    d.start_superlink()
    for i in range(len(USERS)):
        registered = d.register(certificates / f"node{i}.pub")
        assert registered.returncode == 0, registered.stdout + registered.stderr
    node_ids = d.wait_for_nodes([d.start_supernode({"users": users}, private_key=certificates / f"node{i}")
                                 for i, users in enumerate(USERS)])
    victim_id, victim = last_node(node_ids)
    checkpoint_dir = tmp_path / "checkpoints"
    overrides = run_config(checkpoint_dir, rounds=6, **{"server.min-nodes": 2})
    config, cohorts = expected_privacy(overrides), uninterrupted_cohorts(overrides)

    submitted = d.submit(overrides)
    wait_for_round(d, submitted, checkpoint_dir, 1)
    victim.stop(signal.SIGKILL)
    # Once the SuperLink stops listing it (heartbeats expired) the ServerApp notices before a round; restarted
    # earlier, the node would be refused, or come back between two rounds unnoticed (then nothing is logged).
    submitted.wait_for_output(r"node 'users 27-39' \(node id \d+\) left", timeout=180)
    deadline = time.monotonic() + 180
    while True:  # refused ("Failed to activate") while the SuperLink still lists the killed instance
        restarted = d.start_supernode({"users": "27-39"}, private_key=certificates / f"node{len(USERS) - 1}")
        try:
            (new_id,) = d.wait_for_nodes([restarted], timeout=30)
            break
        except (RuntimeError, TimeoutError):
            restarted.stop()
            assert time.monotonic() < deadline, f"the SuperNode could not come back\n{d.diagnostics()}"
            time.sleep(5)
    result = d.finish(submitted, timeout=400)

    assert new_id == victim_id
    assert_completed(result, d)
    assert_ledger_is_uninterrupted(read_results(checkpoint_dir), config, checkpoint_dir)
    back = re.findall(r"node 'users 27-39' is back as node id (\d+) \(it had left\)", result.output)
    assert back == [str(victim_id)], result.output[-4000:]
    counts = read_diagnostics(checkpoint_dir)
    assert_same_sampling(counts, cohorts)
    assert counts[-1]["replied_users"] == counts[-1]["cohort_size"], counts[-1]  # served again by the end
