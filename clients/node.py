"""A node's users trained into one contribution: :class:`LocalTrainer` builds the task's model once and trains a
round's users on its device, without a model per user when their update is one gradient step
(``fed_dp.clients.one_step``), else vectorized over users or one at a time (``fed_dp.clients.vectorized.contribution``).
The in-process engine, the torchrun ranks, the audit and a Flower ClientApp (``fed_dp.clients.replies``) all train
with this class, so a simulation and a Flower run compute the same contributions. Nothing here imports Flower.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from fed_dp.clients.task import Examples, Task, Users, seeded_model, trainable_layout
from fed_dp.clients.training import LocalRound, UserExamples, keep_freed_memory, resolve_device, use_fast_format
from fed_dp.clients.vectorized import Path, contribution, select_path
from fed_dp.config import LocalTraining
from fed_dp.run_config import CLIENT_DEFAULTS
from fed_dp.contribution import Contribution, RoundPlan, UserTrainingError

__all__ = ["LocalTrainer"]

log = logging.getLogger("fed_dp.clients")


class LocalTrainer:
    """Trains a node's sampled users of ``task`` with ``local`` training on ``device``.

    ``training``: ``"auto"`` (users whose update is one full-batch step on ``clients.one_step``, the others
    vectorized over users on CUDA, one at a time on the CPU), ``"vectorized"`` or
    ``"sequential"``; ``chunk_size`` bounds the users of one vectorized call. The model is built once (with the
    torch RNG seeded to ``seed`` when given: ``fed_dp.clients.task.seeded_model``); every round loads the broadcast
    θ of its trainable parameters into it, and its frozen parameters (``requires_grad=False``) stay as built, so
    a node builds them as the server does: pretrained weights from a local folder, or the same ``seed``
    (``run.seed`` in a Flower run). In-memory users are moved to the device once.
    """

    def __init__(self, task: Task, local: LocalTraining | None = None, *,
                 device: str | torch.device = CLIENT_DEFAULTS.device, training: str = CLIENT_DEFAULTS.training,
                 chunk_size: int | None = CLIENT_DEFAULTS.chunk_size, seed: int | None = None) -> None:
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
        # its trainable weights are replaced by each broadcast θ; its frozen ones stay as built (from ``seed``)
        self.model = seeded_model(task, seed).to(self.device)
        select_path(self.model, self.vectorized, self.device)  # "vectorized" with active dropout fails here, not later
        self.layout, _ = trainable_layout(self.model)
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

    def contribution(self, plan: RoundPlan, users: Sequence[int], *, seed: int, source: str = "",
                     failures: str = "stop") -> tuple[Contribution, dict[str, float], Path]:
        """Σ of the clipped updates of ``users`` (indices: this node's share of the plan's cohort) trained from the
        plan's flat θ, clipped to its ζ (in its geometry s_t), their count (and Σu² when the plan asks), the
        training metrics and the path that ran (:func:`fed_dp.clients.vectorized.contribution`); ``seed``: the
        run's local-training seed, from which each user's derives.

        A user whose examples fail to load, or whose training raises (a NaN or Inf loss or update included):
        ``failures="stop"`` (the in-process engine: a research run stops to show it) stops the call with
        :class:`~fed_dp.contribution.UserTrainingError` naming the round (``plan.round + 1``) and that user;
        ``failures="zero"`` (a deployed node) sends such users as zero updates and the others' sum, so that one
        user's data moves the node's reply by at most its own clipped update, ζ (dropping the whole reply would move
        it by every user's); unless every user failed, which raises as "stop" does (the server drops the reply: the
        same as zero for each). The metrics then count them (``failed_users``) and this node's log names them."""
        if failures not in ("stop", "zero"):
            raise ValueError(f"failures must be 'stop' or 'zero', got {failures!r}")
        work = LocalRound(params=plan.params.to(self.device), round_index=plan.round, clip_norm=plan.clip_norm,
                          scale=None if plan.scale is None else plan.scale.to(self.device),
                          send_squares=plan.send_squares, model=self.model, layout=self.layout, training=self.local,
                          loss=self.task.loss, seed=seed, source=source)
        if failures == "zero":
            return self._without_failed(users, work, plan.round)
        examples = [(int(u), self._load(int(u), plan.round)) for u in users]
        try:
            return contribution(examples, work, vectorized=self.vectorized, chunk_size=self.chunk_size)
        except Exception as error:
            raise self._failure(examples, work, error) from error

    def _without_failed(self, users: Sequence[int], work: LocalRound,
                        round_index: int) -> tuple[Contribution, dict[str, float], Path]:
        """:meth:`contribution` with ``failures="zero"``: train the users together; if that raises, find every user
        whose loading or training alone raises, and train the others without them (an error path: the users are
        trained one at a time once to find them)."""
        failed: list[UserTrainingError] = []
        examples = []
        for user in users:
            try:
                examples.append((int(user), self._load(int(user), round_index)))
            except UserTrainingError as error:
                failed.append(error)
        if not failed:
            try:
                return contribution(examples, work, vectorized=self.vectorized, chunk_size=self.chunk_size)
            except Exception:
                pass
        kept = []
        for user, data in examples:
            try:
                contribution([(user, data)], work, vectorized=False)
                kept.append((user, data))
            except Exception as error:
                failed.append(UserTrainingError(round_index + 1, user, self.user_id(user), error))
        if not kept:
            raise failed[0]
        try:
            result, metrics, path = contribution(kept, work, vectorized=self.vectorized, chunk_size=self.chunk_size)
        except Exception as error:  # users that train alone but not together: the node's error
            raise self._failure(kept, work, error) from error
        for error in failed:
            log.warning("%s; the user is sent as a zero update", error)
        extra = len(failed)
        result = replace(result, count=result.count + extra,
                         unclipped=None if result.unclipped is None else result.unclipped + extra)
        return result, {**metrics, "failed_users": float(extra)}, path

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
