"""What a node does for the server: host users, and train the sampled ones into one clipped reply.

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

:class:`LocalTrainer` builds the task's model once and trains a round's users on its device, without a model
per user when their update is one gradient step (``fed_dp.clients.one_step``), else vectorized over users or one
at a time (``fed_dp.clients.vectorized.contribution``); the in-process engine uses the same
class, so a simulation and a Flower run compute the same contributions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Message

from fed_dp.clients import protocol
from fed_dp.clients.task import Examples, Task, Users
from fed_dp.clients.training import LocalRound, UserExamples, keep_freed_memory, resolve_device, use_fast_format
from fed_dp.clients.vectorized import Path, contribution, path_metrics, select_path
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout
from fed_dp.run_config import CLIENT_DEFAULTS
from fed_dp.contribution import Contribution, RoundPlan, UserTrainingError

__all__ = ["LocalTrainer", "hosted_users", "parse_users", "query_reply", "train_reply"]

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


class LocalTrainer:
    """Trains a node's sampled users of ``task`` with ``local`` training on ``device``.

    ``training``: ``"auto"`` (users whose update is one full-batch step on ``clients.one_step``, the others
    vectorized over users on CUDA, one at a time on the CPU), ``"vectorized"`` or
    ``"sequential"``; ``chunk_size`` bounds the users of one vectorized call. The model is built once; every
    round loads the broadcast θ into it. In-memory users are moved to the device once.
    """

    def __init__(self, task: Task, local: LocalTraining | None = None, *,
                 device: str | torch.device = CLIENT_DEFAULTS.device, training: str = CLIENT_DEFAULTS.training,
                 chunk_size: int | None = CLIENT_DEFAULTS.chunk_size) -> None:
        if not isinstance(task, Task):
            raise ValueError(f"LocalTrainer needs a fed_dp.Task, got {type(task).__name__}")
        paths = {"auto": None, "vectorized": True, "sequential": False}
        if training not in paths:
            raise ValueError(f"training must be one of {', '.join(paths)}, got {training!r}")
        self.task = task
        self.local = local if local is not None else LocalTraining()
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # one small user after another: stop the heap from being trimmed at every step
        self.vectorized = paths[training]
        self.chunk_size = chunk_size
        self.model = task.build_model().to(self.device)  # its initial weights are replaced by each broadcast θ
        select_path(self.model, self.vectorized, self.device)  # "vectorized" with BatchNorm fails here, not later
        self.layout = ParamLayout.from_state_dict({k: v.detach() for k, v in self.model.named_parameters()})
        first = [(0, task.users[0])] if task.users.in_memory_examples is not None else []
        self.memory_format = use_fast_format(self.model, first)
        self.users: Users = task.users.to(self.device, self.memory_format)

    def flat_params(self, named: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """θ by parameter name (as broadcast) → this model's flat θ on the device; a clear error when the
        server's model and this node's model differ."""
        expected = {spec.name: spec.shape for spec in self.layout.specs}
        got = {name: tuple(t.shape) for name, t in named.items()}
        if got != expected:
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            shapes = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
            raise ValueError(f"the server's model does not match this node's model ({type(self.model).__name__}): "
                             f"missing {missing}, unexpected {extra}, other shapes {shapes}; both sides must build "
                             "the same model, and the Strategy's initial arrays must be its named parameters")
        return self.layout.flatten(dict(named)).to(self.device)

    def contribution(self, plan: RoundPlan, users: Sequence[int], *, seed: int,
                     source: str = "") -> tuple[Contribution, dict[str, float], Path]:
        """Σ of the clipped updates of ``users`` (indices: this node's share of the plan's cohort) trained from the
        plan's flat θ, clipped to its ζ (in its geometry s_t), their count (and Σu² when the plan asks), the
        training metrics and the path that ran (:func:`fed_dp.clients.vectorized.contribution`); ``seed``: the
        run's local-training seed, from which each user's derives.

        A user whose examples fail to load, or whose training raises, stops the call with
        :class:`~fed_dp.contribution.UserTrainingError` naming the round (``plan.round + 1``) and that user."""
        examples = [(int(u), self._load(int(u), plan.round)) for u in users]
        work = LocalRound(params=plan.params.to(self.device), round_index=plan.round, clip_norm=plan.clip_norm,
                          scale=None if plan.scale is None else plan.scale.to(self.device),
                          send_squares=plan.send_squares, model=self.model, layout=self.layout, training=self.local,
                          loss=self.task.loss, seed=seed, source=source)
        try:
            return contribution(examples, work, vectorized=self.vectorized, chunk_size=self.chunk_size)
        except Exception as error:
            raise self._failure(examples, work, error) from error

    def _load(self, user: int, round_index: int) -> Examples:
        """The examples of ``user``; UserTrainingError naming the round and the user when they fail to load."""
        try:
            return self.users[user]
        except Exception as error:
            raise UserTrainingError(round_index + 1, user, self.user_id(user), error) from error

    def user_id(self, user: int) -> Any:
        """The id of the user at sampler index ``user`` (the index itself when the task has no ids)."""
        ids = self.task.users.ids
        return ids[user] if 0 <= user < len(ids) else user

    def _failure(self, examples: Sequence[UserExamples], work: LocalRound, error: Exception) -> UserTrainingError:
        """``error``, raised while training ``examples`` together, as the UserTrainingError of the first user whose
        training alone raises (found by training them one at a time from the same θ: an error path, nothing of it
        is released); the first user when none does alone."""
        for user, data in examples if len(examples) > 1 else ():
            try:
                contribution([(user, data)], work, vectorized=False)
            except Exception as alone:
                return UserTrainingError(work.round_index + 1, user, self.user_id(user), alone)
        user = examples[0][0] if examples else -1
        return UserTrainingError(work.round_index + 1, user, self.user_id(user), error)


def train_reply(msg: Message, trainer: LocalTrainer, *, hosted: Collection[int] | None = None) -> Message:
    """The reply to a TRAIN message: the requested users trained by ``trainer``, clipped in the broadcast
    geometry, summed. ``hosted``: the users this node hosts (requests for others are refused)."""
    request = protocol.parse_train_request(msg)
    if hosted is not None:
        foreign = sorted(set(request.users) - set(hosted))
        if foreign:
            raise ValueError(f"asked to train users {foreign[:5]} that this node does not host")
    result, metrics, path = trainer.contribution(request.plan(trainer.flat_params(request.params)), request.users,
                                                 seed=request.seed)
    return protocol.make_train_reply(msg, request, result, {**metrics, **path_metrics(path)})
