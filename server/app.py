"""The project's Flower ServerApp: the run config parsed once (``fed_dp.run_config``), the task loaded by
reference, and the :class:`~fed_dp.server.flower_strategy.UserLevelDP` strategy started on it.

    flwr run .                      # local simulation (docs/how-to/flower-app.md), or a deployment federation

It is an ordinary user of the public API: a ServerApp of your own does the same in a few lines.

Seeds. The run config reaches every ClientApp, so ``run.seed`` seeds only what clients may know: the model's
initialization and their local training. The sampler and the noise are seeded from the server's own
environment, ``FED_DP_SERVER_SEED`` on the SuperLink's machine (a reproducible research run, for whoever holds
that machine), and otherwise from OS entropy (with secure noise): no client can rebuild the cohorts or the noise.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fed_dp.clients.task import build_task, initial_model
from fed_dp.run_config import RunConfig
from fed_dp.validation import check_seed
from fed_dp.server.flower_strategy import UserLevelDP, centralized_evaluation, configure_logging, model_arrays

app = ServerApp()

#: The environment variable of the ServerApp's process that seeds the sampler and the noise (never the run config,
#: which every ClientApp receives).
SERVER_SEED_VARIABLE = "FED_DP_SERVER_SEED"


def server_seed(environ: Mapping[str, str]) -> int | None:
    """The seed of the sampler and the noise from ``FED_DP_SERVER_SEED`` (None when unset or empty: OS entropy)."""
    text = environ.get(SERVER_SEED_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{SERVER_SEED_VARIABLE}={text!r} must be an integer >= 0 (the seed of the sampler and "
                         "the noise of a research run); unset it for OS entropy")
    return check_seed(SERVER_SEED_VARIABLE, int(text))


def make_strategy(run: RunConfig, num_users: int, environ: Mapping[str, str], *,
                  strategy_class: type[UserLevelDP] = UserLevelDP, frozen: Any = None) -> UserLevelDP:
    """The ServerApp's strategy for ``run``: ``run.seed`` seeds the clients' local training only; the sampler and
    the noise get :func:`server_seed` (see the module docstring). ``strategy_class``: a subclass of
    :class:`UserLevelDP` to build instead (an app's own, overriding configure_train or aggregate_train).
    ``frozen``: the run's model, whose frozen parameters every node must hold too (``UserLevelDP``'s ``frozen``)."""
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, UserLevelDP)):
        raise ValueError(f"strategy_class must be UserLevelDP or a subclass of it, got {strategy_class!r}")
    privacy = run.privacy if run.privacy.num_users is not None else run.privacy.replace(num_users=num_users)
    if privacy.num_users != num_users:
        raise ValueError(f"privacy.num-users = {privacy.num_users} but the task has {num_users} users")
    return strategy_class(
        privacy, run.optimizer.build(),
        adaptive_clipping=run.adaptive.build(privacy),
        seed=server_seed(environ), training_seed=run.run.seed, checkpoint_dir=run.server.checkpoint_dir,
        eval_every=run.run.eval_every, max_empty_rounds=run.server.max_empty_rounds,
        min_nodes=run.server.min_nodes, node_wait=run.server.node_wait,
        noise_source=run.server.noise_source, frozen=frozen, local=run.local,
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    configure_logging()
    run = RunConfig.from_flat(context.run_config)
    task = build_task(run.task)
    logging.getLogger("fed_dp.server").info("fed-dp task: %s", task.description or task.name)
    seed = run.run.seed
    model, _, _ = initial_model(task, seed if seed is not None else secrets.randbits(62))
    strategy = make_strategy(run, task.num_users, os.environ, frozen=model)
    strategy.start(grid=grid, initial_arrays=model_arrays(model), timeout=run.server.reply_timeout,
                   evaluate_fn=centralized_evaluation(task, model))
