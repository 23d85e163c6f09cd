"""The project's Flower ServerApp: the run config parsed once (``fed_dp.run_config``), the task loaded by
reference, and the :class:`~fed_dp.server.flower_strategy.UserLevelDP` strategy started on it.

    flwr run .                      # local simulation (see the README), or a deployment federation

It is an ordinary user of the public API: a ServerApp of your own does the same in a few lines.
"""

from __future__ import annotations

import logging
import secrets

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fed_dp.clients.task import build_task, initial_model
from fed_dp.run_config import RunConfig
from fed_dp.server.flower_strategy import UserLevelDP, centralized_evaluation, configure_logging, model_arrays

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    configure_logging()
    run = RunConfig.from_flat(context.run_config)
    task = build_task(run.task)
    logging.getLogger("fed_dp.server").info("fed-dp task: %s", task.description or task.name)
    seed = run.run.seed
    model, _, _ = initial_model(task, seed if seed is not None else secrets.randbits(62))
    privacy = run.privacy if run.privacy.num_users is not None else run.privacy.replace(num_users=task.num_users)
    if privacy.num_users != task.num_users:
        raise ValueError(f"privacy.num-users = {privacy.num_users} but the task has {task.num_users} users")
    strategy = UserLevelDP(
        privacy, run.optimizer.build(),
        adaptive_clipping=run.adaptive.build(privacy) if run.adaptive is not None else None,
        seed=seed, checkpoint_dir=run.server.checkpoint_dir, evaluate_every=run.run.eval_every,
        max_empty_rounds=run.server.max_empty_rounds, min_nodes=run.server.min_nodes, node_wait=run.server.node_wait,
        noise_source=run.server.chosen_noise_source,
    )
    strategy.start(grid=grid, initial_arrays=model_arrays(model), timeout=run.server.reply_timeout,
                   evaluate_fn=centralized_evaluation(task))
