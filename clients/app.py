"""The project's Flower ClientApp: a node hosts one or many users and answers for each sampled one.

    QUERY  → the user indices this node hosts (node config ``users``, e.g. "0-19,40-49") and its node config's
             ``name``, if it has one (the server knows a restarted node by it, else by its users); under
             Flower's simulation engine, that it is one of P virtual nodes, each able to train any user
    TRAIN  → the requested users trained from θ_{t−1} with the task's loss, clipped in the broadcast geometry,
             summed (``fed_dp.clients.node.train_reply``)

The task comes from the run config by reference (``task.ref``), so every Flower process — simulation workers,
SuperNodes — imports it itself. A ClientApp of your own does the same in a few lines (``fed_dp.clients.node``).

With ``node-service`` in the node config, both handlers forward the message to that node's long-lived service
(``fed_dp.clients.node_service``), which answers with :data:`HANDLERS` and keeps the task loaded across messages;
this module imports torch and the trainer only where it answers in its own process.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fed_dp.clients.node_service import NODE_CONFIG_KEY, forward, message_kind

app = ClientApp()
_TRAINERS: dict[str, Any] = {}  # per process (the simulation engine and a node service reuse processes)


def _trainer(context: Context):
    from fed_dp.clients.node import LocalTrainer
    from fed_dp.clients.task import build_task
    from fed_dp.run_config import RunConfig

    run = RunConfig.from_flat(context.run_config)
    root = str(context.node_config.get("data-root", "")) or None
    key = repr((run.task, root, run.local, run.client))
    if key not in _TRAINERS:
        _TRAINERS.clear()
        _TRAINERS[key] = LocalTrainer(build_task(run.task, node_root=root), run.local, device=run.client.device,
                                      training=run.client.training, chunk_size=run.client.chunk_size)
    return _TRAINERS[key]


def answer_query(msg: Message, context: Context) -> Message:
    from fed_dp.clients.node import hosted_users, query_reply

    trainer = _trainer(context)
    name = str(context.node_config.get("name", "")) or None
    return query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), name=name)


def answer_train(msg: Message, context: Context) -> Message:
    from fed_dp.clients.node import hosted_users, train_reply

    trainer = _trainer(context)
    return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))


#: Message kind → the handler that answers it in this process (also what a node service answers with).
HANDLERS = {"query": answer_query, "train": answer_train}


def _answer(msg: Message, context: Context) -> Message:
    """Forwarded to the node service when the node config names one, else answered here."""
    service = str(context.node_config.get(NODE_CONFIG_KEY, ""))
    return forward(service, msg, context) if service else HANDLERS[message_kind(msg)](msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _answer(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _answer(msg, context)
