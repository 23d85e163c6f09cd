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

Local training and clipping live in ``clients.training``, shared with the Flower ClientApp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from clients.training import LocalTraining, users_contribution
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.flat import ParamLayout
from fed_dp.optimizers import ServerOptimizer
from fed_dp.round import ServerState, begin_round, finish_round, init_server
from simulations.task import Task


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
            contribution, train_metrics = users_contribution(
                [(u, task.users[u]) for u in plan.cohort.tolist()], params=plan.params, round_index=plan.round,
                clip_norm=plan.clip_norm, scale=plan.scale, send_squares=plan.send_squares, model=model,
                layout=layout, training=training, seed=seed, source="simulation",
            )
            state, metrics = finish_round(state, plan, [contribution])
            record = {**metrics, **train_metrics}
            if (t + 1) % eval_every == 0 or t + 1 == privacy.rounds:
                record.update(evaluate(model, layout, state.params, task))
            records.append(record)
            if on_round is not None:
                on_round(record)
    return state, records
