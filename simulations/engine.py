"""The in-process simulation engine: users train locally, the server runs the shared ``fed_dp`` round.

Each round (DESIGN.md "The one round"):

    plan = begin_round(state)                        # budget check, cohort from the fed_dp sampler
    for every sampled user i:  Δ_i = local SGD from θ_{t−1} on user i's data
                               u_i = clip(Δ_i, ζ)  or  clip(s_t ⊙ Δ_i, ζ) for scale-then-privatize
    state, metrics = finish_round(state, plan, [Σ u_i (and Σ u_i²), count])

The engine acts like one node hosting every user (a data silo): it replies with the sum of the clipped
contributions and their count, exactly what a Flower ClientApp hosting many users sends. Noise, the fixed
denominator, the optimizer and the accounting all happen in ``fed_dp.round``; nothing DP-critical is
re-implemented here. This is the simple, sequential path (correct first); the fast-engine issue vectorizes
local training without changing what is computed.

Local training uses a generator seeded from (seed, round, user id), so a run is reproducible and another
engine can reproduce the same local updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clipping import clip_scaled, clip_update
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.flat import ParamLayout
from fed_dp.optimizers import ServerOptimizer
from fed_dp.round import Contribution, RoundPlan, ServerState, begin_round, finish_round, init_server
from simulations.task import Task, UserData


@dataclass(frozen=True, kw_only=True)
class LocalTraining:
    """Local SGD of one user: ``epochs`` passes over its data in shuffled minibatches of ``batch_size``."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"local epochs must be an integer >= 1, got {self.epochs!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"local batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"local lr must be a finite number > 0, got {self.lr!r}")


def user_generator(seed: int, round_index: int, user_id: int) -> torch.Generator:
    """The generator of user ``user_id``'s local training in round ``round_index`` (stable mixing)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + user_id * 0x94D049BB133111EB)
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


def local_delta(
    model: nn.Module,
    layout: ParamLayout,
    params: torch.Tensor,
    data: UserData,
    training: LocalTraining,
    generator: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """Δ_i = θ_i − θ_{t−1} after local SGD from ``params``; also the mean training loss seen."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            named[name].copy_(value)
    losses = []
    n = len(data)
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, training.batch_size):
            batch = order[start : start + training.batch_size]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.x[batch]), data.y[batch])
            loss.backward()
            loss = loss.detach()
            with torch.no_grad():
                for p in model.parameters():
                    p -= training.lr * p.grad
            losses.append(loss.item())
    trained = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    return trained - params, (sum(losses) / len(losses)) if losses else math.nan


def cohort_contribution(
    plan: RoundPlan,
    task: Task,
    model: nn.Module,
    layout: ParamLayout,
    training: LocalTraining,
    seed: int,
) -> tuple[Contribution, dict[str, float]]:
    """Train every sampled user, clip each update in the plan's geometry, return their sum and count."""
    total = torch.zeros_like(plan.params)
    squares = torch.zeros_like(plan.params) if plan.send_squares else None
    losses, norms, clipped = [], [], 0
    for user_id in plan.cohort.tolist():
        delta, loss = local_delta(
            model, layout, plan.params, task.users[user_id], training, user_generator(seed, plan.round, user_id)
        )
        result = (
            clip_update(delta, plan.clip_norm)
            if plan.scale is None
            else clip_scaled(delta, plan.scale, plan.clip_norm)
        )
        total += result.update
        if squares is not None:
            squares += result.update.square()
        losses.append(loss)
        norms.append(result.norm)
        clipped += result.clipped
    count = plan.cohort.numel()
    metrics = {
        "train_loss": sum(losses) / count if count else math.nan,
        "mean_update_norm": sum(norms) / count if count else math.nan,
        "fraction_clipped": clipped / count if count else math.nan,
    }
    return Contribution(total, count, squares, source="simulation"), metrics


@torch.no_grad()
def evaluate(model: nn.Module, layout: ParamLayout, params: torch.Tensor, task: Task) -> dict[str, float]:
    """Loss and accuracy on the task's held-out data; per frequency group when the task has groups."""
    data = task.eval_data
    if len(data) == 0:
        return {}
    named = dict(model.named_parameters())
    for name, value in layout.unflatten(params).items():
        named[name].copy_(value)
    logits = torch.cat([model(data.x[i : i + 4096]) for i in range(0, len(data), 4096)])
    correct = (logits.argmax(dim=1) == data.y).double()
    metrics = {"eval_loss": float(F.cross_entropy(logits, data.y)), "eval_accuracy": float(correct.mean())}
    if task.class_groups is not None:
        example_groups = task.class_groups[data.y]
        for group in range(int(task.class_groups.max()) + 1):
            mask = example_groups == group
            if bool(mask.any()):
                metrics[f"group{group}_accuracy"] = float(correct[mask].mean())
                metrics[f"group{group}_loss"] = float(F.cross_entropy(logits[mask], data.y[mask]))
    return metrics


def run(
    task: Task,
    privacy: PrivacyConfig,
    optimizer: ServerOptimizer,
    training: LocalTraining,
    *,
    seed: int,
    eval_every: int = 1,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[ServerState, list[dict[str, Any]]]:
    """Train ``privacy.rounds`` rounds; returns the final server state and one record per round.

    ``seed`` fixes the model initialization, the local training, the user sampler and the noise (a
    research run; real deployments draw sampler and noise seeds from OS entropy). ``on_round`` is called
    with each round's record (progress bars, logging).
    """
    if privacy.num_users != task.num_users:
        raise ValueError(
            f"privacy.num_users = {privacy.num_users} but the task has {task.num_users} users; the sampler "
            "must draw from the users that exist"
        )
    if not (isinstance(eval_every, int) and eval_every >= 1):
        raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
    torch.manual_seed(seed)  # model initialization only; everything else uses explicit generators
    model = task.make_model()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    records: list[dict[str, Any]] = []
    with simulation():
        state = init_server(privacy, optimizer, layout.flatten(dict(model.named_parameters())), seed=seed)
        for t in range(privacy.rounds):
            plan = begin_round(state)
            contribution, train_metrics = cohort_contribution(plan, task, model, layout, training, seed)
            state, metrics = finish_round(state, plan, [contribution])
            record = {**metrics, **train_metrics}
            if (t + 1) % eval_every == 0 or t + 1 == privacy.rounds:
                record.update(evaluate(model, layout, state.params, task))
            records.append(record)
            if on_round is not None:
                on_round(record)
    return state, records
