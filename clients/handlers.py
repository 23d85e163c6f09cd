"""What a node answers, by message kind: QUERY (the users it hosts) and TRAIN (the requested users trained,
clipped and summed), each from the task the run config names, kept loaded across messages in one process.

The project's ClientApp (``fed_dp.clients.app``) answers with :data:`HANDLERS` in its own process, and a node
service (``fed_dp.clients.node_service``) answers with the same handlers, so the replies are the same either
way. Torch and the trainer are imported only when a handler runs.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message

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
        # seeded as the ServerApp seeds its initial model (run.seed): frozen parameters that are initialized rather
        # than loaded come out the same on every node and on the server (checked by the user query)
        _TRAINERS[key] = LocalTrainer(build_task(run.task, node_root=root), run.local, device=run.client.device,
                                      training=run.client.training, chunk_size=run.client.chunk_size,
                                      seed=run.run.seed)
    return _TRAINERS[key]


def answer_query(msg: Message, context: Context) -> Message:
    from fed_dp.clients.replies import hosted_users, query_reply

    trainer = _trainer(context)
    name = str(context.node_config.get("name", "")) or None
    return query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), name=name,
                       model=trainer.model)


def answer_train(msg: Message, context: Context) -> Message:
    from fed_dp.clients.replies import hosted_users, train_reply

    trainer = _trainer(context)
    return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))


#: Message kind → the handler that answers it (in the ClientApp's process, or in a node service).
HANDLERS = {"query": answer_query, "train": answer_train}
