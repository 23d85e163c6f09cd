"""The project's Flower ClientApp: a node hosts one or many users and answers for each sampled one.

    QUERY  → the user indices this node hosts (node config ``users``, e.g. "0-19,40-49") and its node config's
             ``name``, if it has one (the server knows a restarted node by it, else by its users); under
             Flower's simulation engine, that it is one of P virtual nodes, each able to train any user
    TRAIN  → the requested users trained from θ_{t−1} with the task's loss, clipped in the broadcast geometry,
             summed (``fed_dp.clients.replies.train_reply``)

The task comes from the run config by reference (``task.ref``), so every Flower process — simulation workers,
SuperNodes — imports it itself. A ClientApp of your own does the same in a few lines (``fed_dp.clients.replies``).

With ``node-service`` in the node config, both handlers forward the message to that node's long-lived service
(``fed_dp.clients.node_service``), which keeps the task loaded across messages; both answer with the same
handlers (``fed_dp.clients.handlers``), which import torch and the trainer only when they run.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fed_dp.clients.handlers import HANDLERS
from fed_dp.clients.node_service import NODE_CONFIG_KEY, forward, message_kind

app = ClientApp()


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
