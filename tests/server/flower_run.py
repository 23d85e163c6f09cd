"""Run the project's Flower app with `flwr run .` (Flower's simulation engine) from tests.

The machinery lives in ``server.local_simulation`` (the benchmark uses it too); this module keeps the
names the tests import.
"""

from __future__ import annotations

from fed_dp.server.local_simulation import REPO, flwr_env, run, start, stop_local_superlink, wait_for

__all__ = ["REPO", "flwr_env", "run", "start", "stop_local_superlink", "wait_for"]
