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

from clients.training import LocalTraining
from clients.vectorized import contribution as node_contribution
from clients.vectorized import select_path
from fed_dp.adaptive_clipping import AdaptiveClipConfig
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
    vectorized: bool | None = False,
    chunk_size: int | None = None,
    adaptive_clipping: AdaptiveClipConfig | None = None,
) -> tuple[ServerState, list[dict[str, Any]]]:
    """Train ``privacy.rounds`` rounds; returns the final server state and one record per round.

    ``seed`` fixes the model initialization, the local training, the user sampler and the noise (a
    research run; real deployments draw sampler and noise seeds from OS entropy). ``on_round`` is called
    with each round's record (progress bars, logging).

    ``vectorized`` chooses how users train (clients.vectorized.select_path): False (default) = one user at
    a time, measured faster on 2-core CPUs for W1 (grouped convolutions under vmap are slow there); None =
    vectorized over users with torch.func when the model allows it; True = vectorized or ValueError (e.g.
    BatchNorm). Every record carries ``vectorized`` = 1.0 or 0.0, the path that ran. ``chunk_size``
    bounds the users of one vmapped call (None: automatic from d). Both paths compute the same
    contributions (tests/clients/test_vectorized.py).
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
    select_path(model, vectorized)  # vectorized=True with a BatchNorm model fails before any round
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    records: list[dict[str, Any]] = []
    with simulation():
        state = init_server(privacy, optimizer, layout.flatten(dict(model.named_parameters())), seed=seed,
                            adaptive_clipping=adaptive_clipping)
        for t in range(privacy.rounds):
            plan = begin_round(state)
            contribution, train_metrics, path = node_contribution(
                [(u, task.users[u]) for u in plan.cohort.tolist()], params=plan.params, round_index=plan.round,
                clip_norm=plan.clip_norm, scale=plan.scale, send_squares=plan.send_squares, model=model,
                layout=layout, training=training, seed=seed, source="simulation",
                vectorized=vectorized, chunk_size=chunk_size,
            )
            state, metrics = finish_round(state, plan, [contribution])
            record = {**metrics, **train_metrics, "vectorized": float(path == "vectorized")}
            if (t + 1) % eval_every == 0 or t + 1 == privacy.rounds:
                record.update(evaluate(model, layout, state.params, task))
            records.append(record)
            if on_round is not None:
                on_round(record)
    return state, records
