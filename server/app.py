"""The project's Flower ServerApp: the run config parsed once (``fed_dp.run_config``), the task loaded by
reference, and the :class:`~fed_dp.server.flower_strategy.UserLevelDP` strategy started on it.

    flwr run .                      # local simulation (docs/how-to/flower-app.md), or a deployment federation

It is an ordinary user of the public API: a ServerApp of your own does the same in a few lines.

Seeds. The run config reaches every ClientApp, so ``run.seed`` seeds only what clients may know: the model's
initialization and their local training. The sampler and the noise are seeded from the server's own
environment, ``FED_DP_SERVER_SEED`` on the SuperLink's machine (a reproducible research run, for whoever holds
that machine), and otherwise from OS entropy (with secure noise): no client can rebuild the cohorts or the noise
(``UserLevelDP.from_run_config``).
"""

from __future__ import annotations

import logging
import secrets

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fed_dp.clients.task import build_task
from fed_dp.run_config import RunConfig
from fed_dp.server.flower_strategy import (SERVER_SEED_VARIABLE, UserLevelDP, centralized_evaluation,
                                           configure_logging, model_arrays, server_seed)

__all__ = ["SERVER_SEED_VARIABLE", "app", "server_seed"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    configure_logging()
    run = RunConfig.from_flat(context.run_config)
    task = build_task(run.task)
    logging.getLogger("fed_dp.server").info("fed-dp task: %s", task.description or task.name)
    seed = run.run.seed
    model = task.build_model(seed=seed if seed is not None else secrets.randbits(62))
    strategy = UserLevelDP.from_run_config(run, task.num_users, frozen=model)
    strategy.start(grid=grid, initial_arrays=model_arrays(model), timeout=run.server.reply_timeout,
                   evaluate_fn=centralized_evaluation(task, model))
