"""Not a test module of its own: the task with frozen parameters of test_frozen_nodes.py and of the `flwr run` test
(tests/server/test_flower_simulation.py), whose Flower processes import it by reference (``frozen_task:frozen_task``,
this folder on their PYTHONPATH). Synthetic sequences, no flwr-datasets import (each ClientApp process builds it)."""

from __future__ import annotations

import torch
from torch import nn

from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users

REFERENCE = "frozen_task:frozen_task"


class FrozenBody(nn.Module):
    """embed (trainable) → body, norm (frozen, initialized from the seeded RNG) → head (trainable)."""

    def __init__(self, train_body: bool = False) -> None:
        super().__init__()
        self.embed, self.body, self.norm, self.head = nn.Embedding(10, 16), nn.Linear(16, 16), nn.LayerNorm(16), \
            nn.Linear(16, 3)
        self.body.requires_grad_(train_body)
        self.norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(self.embed(tokens).mean(1)))))


def frozen_task(*, users: int = 24, seed: int = 0, train_body: bool = False) -> Task:
    """``users`` users of 4 token sequences each (label: the most common of tokens 0-2 in the sequence)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 10, (users * 4 + 32, 5), generator=g)
    labels = torch.stack([(tokens == k).sum(1) for k in range(3)], 1).argmax(1)
    per_user = [(tokens[4 * i: 4 * i + 4], labels[4 * i: 4 * i + 4]) for i in range(users)]
    return Task(model=lambda: FrozenBody(train_body), users=Users.in_memory(per_user), loss=losses.classification,
                evaluate=evaluation.classification((tokens[-32:], labels[-32:])), name="frozen-body")
