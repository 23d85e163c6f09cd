"""The project's Flower ClientApp: a node hosts one or many users and answers for each sampled one.

    QUERY  → the user indices this node hosts (node config ``users``, e.g. "0-19,40-49") and its node config's
             ``name``, if it has one (the server knows a restarted node by it, else by its users); under
             Flower's simulation engine, that it is one of P virtual nodes, each able to train any user
    TRAIN  → the requested users trained from θ_{t−1} with the task's loss, clipped in the broadcast geometry,
             summed (``fed_dp.clients.node.train_reply``)

The task comes from the run config by reference (``task.ref``), so every Flower process — simulation workers,
SuperNodes — imports it itself. A ClientApp of your own does the same in a few lines (``fed_dp.clients.node``).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fed_dp.clients.node import LocalTrainer, hosted_users, query_reply, train_reply
from fed_dp.clients.task import build_task
from fed_dp.run_config import RunConfig

app = ClientApp()
_TRAINERS: dict[str, LocalTrainer] = {}  # per process (the simulation engine reuses processes; deployment may not)


def _trainer(context: Context) -> LocalTrainer:
    run = RunConfig.from_flat(context.run_config)
    root = str(context.node_config.get("data-root", "")) or None
    key = repr((run.task, root, run.local, run.client))
    if key not in _TRAINERS:
        _TRAINERS.clear()
        _TRAINERS[key] = LocalTrainer(build_task(run.task, node_root=root), run.local, device=run.client.device,
                                      training=run.client.training, chunk_size=run.client.chunk_size)
    return _TRAINERS[key]


@app.query()
def query(msg: Message, context: Context) -> Message:
    trainer = _trainer(context)
    name = str(context.node_config.get("name", "")) or None
    return query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), name=name)


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainer = _trainer(context)
    return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))
