"""The in-process simulation engine: users train locally, the server runs the shared ``fed_dp`` round.

Each round (DESIGN.md "The one round"):

    plan = begin_round(state)                        # budget check, cohort from the fed_dp sampler
    for every sampled user i:  Δ_i = local SGD from θ_{t−1} on user i's data
                               u_i = clip(Δ_i, ζ)  or  clip(s_t ⊙ Δ_i, ζ) for scale-then-privatize
    state, metrics = finish_round(state, plan, [Σ u_i (and Σ u_i²), count])

The engine acts like one node hosting every user (a data silo): it replies with the sum of the clipped
contributions and their count, exactly what a Flower ClientApp hosting many users sends. Noise, the fixed
denominator, the optimizer and the accounting all happen in ``fed_dp.round``; nothing DP-critical is
re-implemented here.

Local training and clipping live in ``clients.training`` (one user at a time) and ``clients.vectorized``
(many users at once with ``torch.func``), shared with the Flower ClientApp. Users train on ``device``
(CPU or ``cuda``); the server round stays on the CPU, and only θ_{t−1} (and s_t) go to the device and
Σu (and Σu²) come back, one d-vector each per round. The task's data is moved to the device, in the
model's fast memory format, once per run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clients.training import LocalTraining, resolve_device, to_device, use_fast_format
from fed_dp.clients.vectorized import contribution as node_contribution
from fed_dp.clients.vectorized import select_path
from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.flat import ParamLayout
from fed_dp.optimizers import ServerOptimizer
from fed_dp.round import Contribution, ServerState, begin_round, finish_round, init_server
from fed_dp.simulations.task import Task


def _on_cpu(contribution: Contribution) -> Contribution:
    squares = contribution.total_squares
    return replace(contribution, total=contribution.total.cpu(), total_squares=None if squares is None else squares.cpu())


@torch.no_grad()
def evaluate(model: nn.Module, layout: ParamLayout, params: torch.Tensor, task: Task) -> dict[str, float]:
    """Loss and accuracy on the task's held-out data; per frequency group when the task has groups.

    Runs on the model's device (the held-out inputs go there 4,096 at a time) in eval mode (restored
    after); metrics are computed on the CPU."""
    data = task.eval_data
    if len(data) == 0:
        return {}
    named = dict(model.named_parameters())
    for name, value in layout.unflatten(params).items():
        named[name].copy_(value)
    device = params.device if not named else next(iter(named.values())).device
    was_training = model.training
    model.eval()
    try:
        logits = torch.cat([model(data.x[i : i + 4096].to(device)).cpu() for i in range(0, len(data), 4096)])
    finally:
        model.train(was_training)
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
    vectorized: bool | None = None,
    chunk_size: int | None = None,
    adaptive_clipping: AdaptiveClipConfig | None = None,
    device: str | torch.device = "auto",
) -> tuple[ServerState, list[dict[str, Any]]]:
    """Train ``privacy.rounds`` rounds; returns the final server state and one record per round.

    ``seed`` fixes the model initialization, the local training, the user sampler and the noise (a
    research run; real deployments draw sampler and noise seeds from OS entropy). ``on_round`` is called
    with each round's record (progress bars, logging). Records carry ``round_seconds``, the wall time of
    the round before evaluation.

    ``vectorized`` chooses how users train (clients.vectorized.select_path): None (default, auto) =
    vectorized over users with torch.func on CUDA when the model allows it, one user at a time on the CPU
    (measured faster on the 2-core CPUs here: grouped convolutions under vmap are slow there); False = one
    user at a time; True = vectorized or ValueError (e.g. BatchNorm). Every record carries ``vectorized``
    = 1.0 or 0.0, the path that ran. ``chunk_size`` bounds the users of one vmapped call (None: automatic
    from d). Both paths compute the same contributions (tests/clients/test_vectorized.py). ``device``:
    where users train, ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda[:N]"``.
    """
    if privacy.num_users != task.num_users:
        raise ValueError(
            f"privacy.num_users = {privacy.num_users} but the task has {task.num_users} users; the sampler "
            "must draw from the users that exist"
        )
    if not (isinstance(eval_every, int) and eval_every >= 1):
        raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
    device = resolve_device(device)
    torch.manual_seed(seed)  # model initialization only; everything else uses explicit generators
    model = task.make_model()
    select_path(model, vectorized, device)  # vectorized=True with a BatchNorm model fails before any round
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    initial = layout.flatten(dict(model.named_parameters())).detach()  # θ_0 on the CPU, for the server
    model.to(device)
    memory_format = use_fast_format(model, [(0, task.users[0])] if task.users else [])
    users = [to_device(data, device, memory_format) for data in task.users]
    records: list[dict[str, Any]] = []
    with simulation():
        state = init_server(privacy, optimizer, initial, seed=seed, adaptive_clipping=adaptive_clipping)
        for t in range(privacy.rounds):
            started = time.perf_counter()
            plan = begin_round(state)
            scale = None if plan.scale is None else plan.scale.to(device)
            contribution, train_metrics, path = node_contribution(
                [(u, users[u]) for u in plan.cohort.tolist()], params=plan.params.to(device), round_index=plan.round,
                clip_norm=plan.clip_norm, scale=scale, send_squares=plan.send_squares, model=model,
                layout=layout, training=training, seed=seed, source="simulation",
                vectorized=vectorized, chunk_size=chunk_size,
            )
            state, metrics = finish_round(state, plan, [_on_cpu(contribution)])
            record = {**metrics, **train_metrics, "vectorized": float(path == "vectorized"),
                      "round_seconds": time.perf_counter() - started}  # sampling, local training, server round
            if (t + 1) % eval_every == 0 or t + 1 == privacy.rounds:
                record.update(evaluate(model, layout, state.params, task))
            records.append(record)
            if on_round is not None:
                on_round(record)
    return state, records
