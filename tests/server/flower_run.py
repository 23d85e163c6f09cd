"""Run the project's Flower app with `flwr run .` (Flower's simulation engine) from tests.

The machinery lives in ``fed_dp.simulations.launch.local_simulation`` (the benchmark uses it too). The tests compare Flower runs
with the in-process engine for the same seed, so, like a researcher reproducing a run, they give the ServerApp
the seed of its sampler and noise in its own environment (``FED_DP_SERVER_SEED``, equal to ``run.seed``): the
run config, which every ClientApp receives, never seeds them.

Each virtual SuperNode's messages go to one of Ray's actors, ``client_cpus`` CPUs each (default
:data:`CLIENT_CPUS`). Which actor runs a node's ClientApp decides nothing of what a run computes, only how many
processes import torch and Flower: one actor instead of two saves about 6.6 of the 35 CPU seconds of a two-node
test on CI's 2 cores, where the whole suite is CPU-bound.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from fed_dp.server.app import SERVER_SEED_VARIABLE
from fed_dp.simulations.launch import local_simulation
from fed_dp.simulations.launch.local_simulation import REPO, flwr_env, stop_local_superlink, wait_for

__all__ = ["CLIENT_CPUS", "REPO", "flwr_env", "run", "start", "stop_local_superlink", "wait_for"]

#: CPUs of each Ray actor: 2 (one actor on a 2-core machine), never more than the machine has (an actor needing
#: more CPUs than Ray's cluster holds would never start).
CLIENT_CPUS = min(2, os.cpu_count() or 1)


def _server_seed(run_config: dict[str, Any]) -> dict[str, str]:
    """``FED_DP_SERVER_SEED`` = the config's ``run.seed`` for the Flower processes (the ServerApp reads it)."""
    return {SERVER_SEED_VARIABLE: str(run_config["run.seed"])} if "run.seed" in run_config else {}


def start(home: Path, run_config: dict[str, Any], supernodes: int, **options: Any) -> subprocess.Popen:
    options.setdefault("client_cpus", CLIENT_CPUS)
    environment = {**_server_seed(run_config), **options.pop("environment", {})}
    return local_simulation.start(home, run_config, supernodes, environment=environment, **options)


def run(home: Path, run_config: dict[str, Any], supernodes: int, **options: Any) -> str:
    """``environment``, if given: more variables for the Flower processes (beside ``FED_DP_SERVER_SEED``)."""
    options.setdefault("client_cpus", CLIENT_CPUS)
    environment = {**_server_seed(run_config), **options.pop("environment", {})}
    return local_simulation.run(home, run_config, supernodes, environment=environment, **options)
