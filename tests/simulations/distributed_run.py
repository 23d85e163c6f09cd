"""Run by test_distributed.py under torchrun (gloo): one small simulation spread over the processes; rank 0 saves
its final model and records with torch.save. Also importable, for the same run in one process."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import fed_dp
from fed_dp import LocalTraining, PrivacyConfig, Task, Users, losses
from fed_dp.simulations.engine.distributed import leave_torchrun


def make_task(users: int = 24, poisoned_user: int | None = None) -> Task:
    """Two separable Gaussian classes, 4 examples per user; ``poisoned_user``'s features are NaN."""
    generator = torch.Generator().manual_seed(5)
    y = torch.arange(users * 4) % 2
    x = torch.randn(users * 4, 6, generator=generator) + 2.0 * y[:, None]
    if poisoned_user is not None:
        x[torch.arange(users * 4) // 4 == poisoned_user] = float("nan")
    return Task(model=lambda: nn.Linear(6, 2), users=Users.split((x, y), torch.arange(users * 4) // 4),
                loss=losses.classification, name="two-gaussians")


def run(poisoned_user: int | None = None, optimizer: str = "dp-adambc") -> fed_dp.TrainResult:
    """Poisson sampling of 8 of 24 users for 4 rounds; with a poisoned user, every user in every round."""
    sampler = "poisson" if poisoned_user is None else "all"
    privacy = PrivacyConfig(expected_cohort=8 if sampler == "poisson" else 24, rounds=4, noise_multiplier=1.0,
                            delta=1e-5, sampler=sampler)
    return fed_dp.train(make_task(poisoned_user=poisoned_user), privacy, optimizer,
                        LocalTraining(epochs=1, batch_size=2, lr=0.1), seed=3, device="cpu", training="sequential")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--poisoned-user", type=int)
    parser.add_argument("--optimizer", default="dp-adambc")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        result = run(args.poisoned_user, args.optimizer)
        torch.save({"rank": dist.get_rank(), "params": result.params, "records": result.records,
                    "state": result.state is not None}, f"{args.out}.{dist.get_rank()}")
    finally:
        dist.destroy_process_group()
    leave_torchrun()
