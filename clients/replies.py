"""What a node answers the server, as Flower messages: which users it hosts (QUERY) and the clipped sum of its
sampled users' updates (TRAIN), trained by a :class:`~fed_dp.clients.node.LocalTrainer`.

A ClientApp of your own needs two handlers (the project's own ``fed_dp.clients.app`` is exactly this); the query
reply names the model the node trains, so that the server refuses a node whose model differs from its own before
round 1, instead of spending rounds of budget on noise:

    trainer = LocalTrainer(make_task(), LocalTraining(batch_size=16, lr=0.1))

    @app.query()
    def query(msg, context):
        return query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), model=trainer.model)

    @app.train()
    def train(msg, context):
        return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from flwr.app import Message

from fed_dp.clients import protocol
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.training_paths import path_metrics

__all__ = ["hosted_users", "parse_users", "query_reply", "train_reply"]

query_reply = protocol.query_reply


def parse_users(spec: str) -> list[int]:
    """"0-19,40-49,7" → sorted user indices; a clear error for anything else."""
    users: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        try:
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"node-config 'users' must look like '0-19,40-49', got {spec!r}") from None
        if first > last or first < 0:
            raise ValueError(f"node-config 'users': bad range {part!r}")
        users.update(range(first, last + 1))
    return sorted(users)


def hosted_users(node_config: Mapping[str, Any], num_users: int) -> Sequence[int]:
    """The users a node hosts: its node config's ``users`` ranges (deployment), or, under Flower's simulation
    engine (node config ``partition-id`` and ``num-partitions`` = P), any of the N = ``num_users``
    (:class:`~fed_dp.clients.protocol.VirtualNodeUsers`: every virtual node builds the whole task; the server
    assigns user u to the (u mod P)-th of them after asking one, instead of asking all P)."""
    if "users" in node_config:
        users = parse_users(node_config["users"])
        outside = [u for u in users if u >= num_users]
        if outside:
            raise ValueError(f"node-config 'users' names users {outside[:5]} but the task has N = {num_users} "
                             f"(indices 0..{num_users - 1})")
        return users
    if "partition-id" in node_config and "num-partitions" in node_config:  # Flower simulation engine
        return protocol.VirtualNodeUsers(num_users, int(node_config["num-partitions"]))
    raise ValueError("this SuperNode has no 'users' in its --node-config (e.g. --node-config \"users='0-19'\")")


def train_reply(msg: Message, trainer: LocalTrainer, *, hosted: Collection[int] | None = None) -> Message:
    """The reply to a TRAIN message: the requested users trained by ``trainer``, clipped in the broadcast
    geometry, summed. ``hosted``: the users this node hosts (requests for others are refused)."""
    request = protocol.parse_train_request(msg)
    if hosted is not None:
        foreign = sorted(set(request.users) - set(hosted))
        if foreign:
            raise ValueError(f"asked to train users {foreign[:5]} that this node does not host")
    # a user that fails to load or train goes as a zero update (its data move the reply by at most ζ), unless all do
    result, metrics, path = trainer.contribution(request.plan(trainer.flat_params(request.params)), request.users,
                                                 seed=request.seed, failures="zero")
    return protocol.make_train_reply(msg, request, result, {**metrics, **path_metrics(path)})
