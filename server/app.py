"""The Flower ServerApp of fed-dp: parse the run config once, build the fed_dp server state, run rounds.

    flwr run .                      # local simulation (see the README), or a deployment federation
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fed_dp.flat import ParamLayout
from fed_dp.optimizers import make_optimizer
from fed_dp.round import init_server
from fed_dp.server import strategy
from fed_dp.server.config import parse_app_config, task_params
from fed_dp.simulations.tasks import build_task

app = ServerApp()
log = logging.getLogger("fed_dp.server")


def _initial_params(task, seed: int):
    import torch

    torch.manual_seed(seed)  # model initialization only (as the simulation engine does)
    model = task.make_model()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    return model, layout, layout.flatten({k: v.detach() for k, v in model.named_parameters()})


def _configure_logging() -> None:
    """fed-dp's own messages at INFO; never the root logger (httpx would then log every request, including
    the log uploads of the ServerApp itself, which never ends)."""
    logger = logging.getLogger("fed_dp")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    _configure_logging()
    config = parse_app_config(dict(context.run_config))
    experiment = config.experiment
    task = build_task(**task_params(dict(context.run_config)))
    model, layout, params = _initial_params(task, config.seed)
    optimizer = make_optimizer(config.optimizer_name, **experiment.optimizers[config.optimizer_name])
    if not optimizer.private:
        raise ValueError(f"optimizer {config.optimizer_name!r} is not private; it exists only in simulations")
    state = init_server(experiment.privacy, optimizer, params,
                        seed=config.seed if config.seeded_explicitly else None, adaptive_clipping=experiment.adaptive)
    log.info("fed-dp: %s; N = %d, B = %d, T = %d, sigma = %.4f, clip = %g, sampler = %s, noise = %s, optimizer = %s%s",
             task.description, experiment.privacy.num_users, experiment.privacy.expected_cohort,
             experiment.privacy.rounds, experiment.privacy.noise_multiplier, experiment.privacy.clip_norm,
             experiment.privacy.sampler, experiment.privacy.noise, config.optimizer_name,
             f"; explicit seed {config.seed} (reproducible research run)" if config.seeded_explicitly
             else "; sampler and noise seeded from OS entropy")
    nodes = strategy.wait_for_nodes(grid, config.server.min_nodes, config.server.node_wait)
    owner = strategy.discover_users(grid, nodes, experiment.privacy.num_users, config.server.reply_timeout)
    log.info("%d SuperNode(s) host %d of the %d users", len(nodes), len(owner), experiment.privacy.num_users)
    evaluate = None
    if config.server.evaluate:
        from fed_dp.simulations.engine import evaluate as evaluate_model

        evaluate = lambda p: evaluate_model(model, layout, p, task)  # noqa: E731
    state, records = strategy.run(grid, state, seed=config.seed, checkpoint_dir=config.server.checkpoint_dir,
                                  reply_timeout=config.server.reply_timeout, owner=owner, evaluate=evaluate)
    final = records[-1] if records else {}
    log.info("fed-dp finished: %d rounds, user-level epsilon %s at delta %g%s", state.round,
             final.get("epsilon"), experiment.privacy.delta,
             f", eval accuracy {final['eval_accuracy']:.4f}" if "eval_accuracy" in final else "")
