"""A node's users trained into one contribution: :class:`LocalTrainer` builds the task's model once and trains a
round's users on its device, without a model per user when their update is one gradient step
(``fed_dp.clients.one_step``), else vectorized over users or one at a time (``fed_dp.clients.training_paths.contribution``).
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
from fed_dp.clients.training_paths import Path, contribution, select_path
from fed_dp.config import LocalTraining
from fed_dp.run_config import CLIENT_DEFAULTS
from fed_dp.contribution import Contribution, RoundPlan, UserTrainingError

__all__ = ["LocalTrainer"]

log = logging.getLogger("fed_dp.clients")

#: A failure is the task's, not one user's data, when this many users of a round (or all of them, if fewer, at
#: least two) each fail on their own and none succeeds (:meth:`LocalTrainer._failure`).
FAILURES_TO_BLAME_THE_TASK = 3


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
        training metrics and the path that ran (:func:`fed_dp.clients.training_paths.contribution`); ``seed``: the
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
        examples = []
        for user in users:
            try:
                examples.append((int(user), self._load(int(user), plan.round)))
            except UserTrainingError as failure:
                raise self._load_failure(failure, users) from failure.original
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

    def _load_failure(self, failure: UserTrainingError, users: Sequence[int]) -> UserTrainingError:
        """``failure`` (a user whose examples did not load), marked as the task's (``not_the_users``) when other
        users of the round fail to load too (up to :data:`FAILURES_TO_BLAME_THE_TASK` in all): then no user's data
        load (a missing folder, a loader that cannot work), which is the task's set-up, not one user's data."""
        others = [int(u) for u in users if int(u) != failure.user][:FAILURES_TO_BLAME_THE_TASK - 1]
        for user in others:
            try:
                self.users[user]
            except Exception:
                continue
            return failure  # another user's examples load: this user's data are the problem
        if not others:
            return failure
        tried = ", ".join(str(u) for u in [failure.user, *others])
        return UserTrainingError(failure.round_number, failure.user, failure.user_id, failure.original,
                                 not_the_users=f"the examples of users {tried} all fail to load")

    def _failure(self, examples: Sequence[UserExamples], work: LocalRound, error: Exception) -> UserTrainingError:
        """``error``, raised while training ``examples`` together, as the UserTrainingError of the first user whose
        training alone raises (found by training them one at a time from the same θ: an error path, nothing of it
        is released); the first user when none does alone. It is marked as the task's failure (``not_the_users``)
        when the users tried each fail alone and none trains (at least two, up to
        :data:`FAILURES_TO_BLAME_THE_TASK`), or when every user trains alone and only training them together fails."""
        failed: list[tuple[int, Exception]] = []
        trained = False
        for user, data in examples if len(examples) > 1 else ():
            try:
                contribution([(user, data)], work, vectorized=False)
                trained = True
            except Exception as alone:
                failed.append((user, alone))
            if (trained and failed) or len(failed) == FAILURES_TO_BLAME_THE_TASK:
                break
        if failed:
            user, alone = failed[0]
            why = "" if trained or len(failed) < 2 else \
                f"users {', '.join(str(u) for u, _ in failed)} each fail alone from the same model, and none trains"
            return UserTrainingError(work.round_index + 1, user, self.user_id(user), alone, not_the_users=why)
        user = examples[0][0] if examples else -1
        why = "" if len(examples) < 2 else (f"each of the {len(examples)} users trains alone; only training them "
                                            "together fails (the training path: client.training, client.chunk-size)")
        return UserTrainingError(work.round_index + 1, user, self.user_id(user), error, not_the_users=why)
