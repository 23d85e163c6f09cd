"""What a simulation trains on: users' data, a model, held-out data, and optional class groups.

A :class:`Task` is plain data: ``users[i]`` holds user i's examples (user ids are 0 .. N−1, the ids the
``fed_dp`` samplers draw). Tasks are built by the builders in ``simulations.tasks`` from local files or
synthetic generators, and partitioned into users by ``simulations.partitioning``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class UserData:
    """One user's examples: inputs ``x`` (n, ...) and integer labels ``y`` (n,)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} examples but y has {self.y.shape[0]}")

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class Task:
    """A federated learning task partitioned by user.

    name: short name (e.g. ``heavy-tail``).
    users: per-user data; index = user id.
    eval_data: held-out examples for centralized evaluation (may be empty).
    make_model: builds a fresh model (seeded by the caller with ``torch.manual_seed`` or a generator).
    num_classes: number of labels.
    class_groups: optional (num_classes,) int tensor: the frequency group of every class (seed 003's
        heavy-tail groups); results are then also reported per group.
    description: one line for logs and results.
    """

    name: str
    users: list[UserData]
    eval_data: UserData
    make_model: Callable[[], nn.Module]
    num_classes: int
    class_groups: torch.Tensor | None = None
    description: str = ""
    info: dict = field(default_factory=dict)

    @property
    def num_users(self) -> int:
        return len(self.users)
