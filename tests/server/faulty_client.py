"""ClientApps for tests under Flower's simulation engine (imported by Ray's workers from this folder) and on
real SuperNodes.

``app`` wraps the project's honest ClientApp and corrupts its replies, by partition id: 0 → update scaled to
norm 10⁶, 1 → a NaN in the update, 2 → an update of the wrong shape; others honest. A node config entry
``fault`` ("huge", "nan", "shape") chooses instead: test_faults.py ships this file as the ClientApp of a Flower
app of its own to real SuperNodes. ``no_query_app`` is a
ClientApp written as for Flower's own strategies: it trains but has no ``@app.query()`` handler. ``other_model_app``
trains another model than the ServerApp's (as a user's app whose two sides drifted apart).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fed_dp.clients import protocol
from fed_dp.clients.app import query as honest_query
from fed_dp.clients.app import train as honest_train

FAULTS = {0: "huge", 1: "nan", 2: "shape"}
app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return honest_query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = honest_train(msg, context)
    arrays = reply.content[protocol.UPDATE].to_torch_state_dict()
    total = arrays["total"]
    fault = context.node_config.get("fault") or FAULTS.get(int(context.node_config.get("partition-id", -1)))
    if fault == "huge":
        arrays["total"] = torch.ones_like(total) * 1e6 / total.numel() ** 0.5
    elif fault == "nan":
        arrays["total"] = total.clone()
        arrays["total"][0] = float("nan")
    elif fault == "shape":
        arrays["total"] = torch.zeros(total.numel() + 3)
    return Message(content=RecordDict({protocol.UPDATE: ArrayRecord(torch_state_dict=arrays),
                                       protocol.REPLY: reply.content[protocol.REPLY]}), reply_to=msg)


no_query_app = ClientApp()


@no_query_app.train()
def train_only(msg: Message, context: Context) -> Message:
    return honest_train(msg, context)



other_model_app = ClientApp()


def _other_trainer():
    """A node whose task builds another model than the ServerApp's: heavy-tail with 5 input features."""
    from fed_dp.clients.node import LocalTrainer
    from fed_dp.simulations.tasks.builtin import heavy_tail_task

    return LocalTrainer(heavy_tail_task(dim=5))


@other_model_app.query()
def query_other_model(msg: Message, context: Context) -> Message:
    from fed_dp.clients.replies import hosted_users

    trainer = _other_trainer()
    return protocol.query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), model=trainer.model)


@other_model_app.train()
def train_other_model(msg: Message, context: Context) -> Message:
    from fed_dp.clients.replies import hosted_users, train_reply

    trainer = _other_trainer()
    return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))
