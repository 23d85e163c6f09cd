"""Malformed client replies under Flower's simulation engine: the run goes on, bad replies are rejected or
re-clipped, and the model moves by at most ζ/B per user of the bad nodes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from flwr.simulation import run_simulation

from fed_dp.server import config as server_config
from fed_dp.checkpoint import load_checkpoint
from fed_dp.server.app import _initial_params, app as server_app
from fed_dp.server.config import task_params
from fed_dp.simulations.tasks import build_task

HERE = Path(__file__).resolve().parent


def test_huge_nan_and_misshaped_replies_are_handled(tmp_path, monkeypatch):
    overrides = {
        "run.seed": 3, "privacy.rounds": 1, "privacy.noise-multiplier": 1e-9, "optimizer.name": "dp-fedavg",
        "server.checkpoint-dir": str(tmp_path / "ckpt"), "server.evaluate": False,
    }  # server-side keys only: the clients run in Ray workers with the unpatched DEFAULTS (40 users)
    for key, value in overrides.items():  # run_simulation passes no run config: the ServerApp uses DEFAULTS
        monkeypatch.setitem(server_config.DEFAULTS, key, value)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    # Ray's worker processes import the faulty ClientApp from this folder.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    import faulty_client

    run_simulation(server_app=server_app, client_app=faulty_client.app, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})

    records = json.loads((tmp_path / "ckpt" / "results.json").read_text())
    assert len(records) == 1, "the run completed its round"
    record = records[0]
    dropped = " ".join(record["dropped"])
    assert "NaN" in dropped and "shape" in dropped, record["dropped"]
    assert record["reclipped_replies"] >= 1
    # Users on partition p are p, p+4, ...; the huge node (partition 0) contributed at most count·ζ.
    config = {**server_config.DEFAULTS}
    sampled = torch.arange(40)  # upper bound: every user of partition 0 sampled
    huge_users = int((sampled % 4 == 0).sum())
    honest_users = int((sampled % 4 == 3).sum())
    task = build_task(**task_params(config))
    initial = _initial_params(task, 3)[2]
    moved = (load_checkpoint(tmp_path / "ckpt")["state"]["params"] - initial).norm().item()
    bound = (huge_users + honest_users) * 1.0 / config["privacy.expected-cohort"]
    assert moved <= bound * (1 + 1e-4), (moved, bound)
    assert moved > 0
