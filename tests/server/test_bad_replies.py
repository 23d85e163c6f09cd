"""Under Flower's simulation engine (``run_simulation``), with a ServerApp of our own built on the public
UserLevelDP strategy, as a user writes one: malformed client replies are rejected or re-clipped and the run goes
on; ClientApps without a user query stop the run before any budget is spent."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fed_dp.checkpoint import COMMIT_NAME, load_checkpoint, read_diagnostics
from fed_dp.clients.task import initial_model
from fed_dp.config import PrivacyConfig
from fed_dp.server.flower_strategy import UserLevelDP, model_arrays
from fed_dp.server.membership import ModelMismatchError, NoUsersError
from fed_dp.simulations.tasks.builtin import heavy_tail_task

HERE = Path(__file__).resolve().parent
PRIVACY = PrivacyConfig(num_users=40, expected_cohort=10, rounds=1, noise_multiplier=1e-9, delta=1e-5,
                        accountant="rdp")  # the ClientApps use the run-config defaults: heavy-tail, 40 users


def _server_app(checkpoint_dir: Path, outcome: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = UserLevelDP(PRIVACY, "dp-fedavg", seed=3, checkpoint_dir=str(checkpoint_dir), eval_every=0)
        try:
            outcome["result"] = strategy.start(grid, model_arrays(initial_model(heavy_tail_task(), 3)[0]))
        except Exception as error:  # the ServerApp runs in a thread of run_simulation: keep what it raised
            outcome["error"] = error

    return app


def _simulate(tmp_path, monkeypatch, client_app_name: str) -> dict:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    # Ray's worker processes import the test ClientApps from this folder; one worker (2 of Ray's 2 CPUs) serves the
    # four virtual nodes one after another: what a round computes does not depend on how many workers there are.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    import faulty_client

    outcome: dict = {}
    run_simulation(server_app=_server_app(tmp_path / "ckpt", outcome), client_app=getattr(faulty_client, client_app_name),
                   num_supernodes=4, backend_config={"client_resources": {"num_cpus": 2, "num_gpus": 0.0},
                                                     "init_args": {"num_cpus": 2, "include_dashboard": False}})
    return outcome


def test_huge_nan_and_misshaped_replies_are_handled(tmp_path, monkeypatch):
    outcome = _simulate(tmp_path, monkeypatch, "app")
    assert "error" not in outcome, outcome.get("error")
    assert len(outcome["result"].records) == 1
    (record,) = read_diagnostics(tmp_path / "ckpt")  # the operator's secret diagnostics say what was refused
    dropped = " ".join(record["dropped"])
    assert "NaN" in dropped and "shape" in dropped, record["dropped"]
    assert record["reclipped_replies"] >= 1
    # Users on partition p are p, p+4, ...; the huge node (partition 0) contributed at most count·ζ.
    sampled = torch.arange(40)  # upper bound: every user of partition 0 sampled
    huge_users, honest_users = int((sampled % 4 == 0).sum()), int((sampled % 4 == 3).sum())
    initial = initial_model(heavy_tail_task(), 3)[2]
    moved = (load_checkpoint(tmp_path / "ckpt")["state"]["params"] - initial).norm().item()
    bound = (huge_users + honest_users) * PRIVACY.clip_norm / PRIVACY.expected_cohort
    assert 0 < moved <= bound * (1 + 1e-4), (moved, bound)


def test_clientapps_without_a_user_query_stop_the_run_before_spending_budget(tmp_path, monkeypatch):
    outcome = _simulate(tmp_path, monkeypatch, "no_query_app")
    error = outcome.get("error")
    assert isinstance(error, NoUsersError), outcome
    assert "none of the 4 connected node(s) hosts any user" in str(error) and "@app.query()" in str(error)
    assert not (tmp_path / "ckpt" / COMMIT_NAME).exists()  # no round was released


def test_a_clientapp_with_another_model_is_refused_before_round_1(tmp_path, monkeypatch):
    """Issue 27: a ClientApp whose model differs from the ServerApp's cost two rounds of pure noise before the
    run stopped. Its query reply now names its model, and the server refuses it before any round is sampled,
    naming the node and the first parameter that differs with both shapes."""
    outcome = _simulate(tmp_path, monkeypatch, "other_model_app")
    error = outcome.get("error")
    assert isinstance(error, ModelMismatchError), outcome
    ((name, weight),) = initial_model(heavy_tail_task(), 3)[0].named_parameters()
    rows, columns = weight.shape
    message = str(error)
    assert "node id" in message and "virtual node" in message, message
    assert f"parameter #1 is '{name}' of shape ({rows}, 5) on the node but '{name}' of shape ({rows}, {columns}) " \
           "on the server" in message, message
    assert "no round was sampled and no privacy budget was spent" in message
    assert not (tmp_path / "ckpt" / COMMIT_NAME).exists()  # no round was released: ε spent is 0
    assert read_diagnostics(tmp_path / "ckpt") == []
