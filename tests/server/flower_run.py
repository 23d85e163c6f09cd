"""Run the project's Flower app with `flwr run .` (Flower's simulation engine) from tests.

The machinery lives in ``server.local_simulation`` (the benchmark uses it too). The tests compare Flower runs
with the in-process engine for the same seed, so, like a researcher reproducing a run, they give the ServerApp
the seed of its sampler and noise in its own environment (``FED_DP_SERVER_SEED``, equal to ``run.seed``): the
run config, which every ClientApp receives, never seeds them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fed_dp.server import local_simulation
from fed_dp.server.app import SERVER_SEED_VARIABLE
from fed_dp.server.local_simulation import REPO, flwr_env, stop_local_superlink, wait_for

__all__ = ["REPO", "flwr_env", "run", "start", "stop_local_superlink", "wait_for"]


@contextlib.contextmanager
def _server_seed(run_config: dict[str, Any]) -> Iterator[None]:
    """``FED_DP_SERVER_SEED`` = the config's ``run.seed`` while the Flower processes start (they copy the
    environment), restored afterwards."""
    before = os.environ.get(SERVER_SEED_VARIABLE)
    if "run.seed" in run_config:
        os.environ[SERVER_SEED_VARIABLE] = str(run_config["run.seed"])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SERVER_SEED_VARIABLE, None)
        else:
            os.environ[SERVER_SEED_VARIABLE] = before


def start(home: Path, run_config: dict[str, Any], supernodes: int, **options: Any) -> subprocess.Popen:
    with _server_seed(run_config):
        return local_simulation.start(home, run_config, supernodes, **options)


def run(home: Path, run_config: dict[str, Any], supernodes: int, **options: Any) -> str:
    with _server_seed(run_config):
        return local_simulation.run(home, run_config, supernodes, **options)
