"""The task of this Flower app: a small regression network on scikit-learn's diabetes data, 40 users.

The same function serves the in-process simulator (`fed-dp simulate --task task:make_task` in this folder)
and both sides of the Flower app (server_app.py, client_app.py)."""

import torch
from sklearn.datasets import load_diabetes
from torch import nn

from fed_dp import Task, Users, evaluation, losses


def make_task(users: int = 40) -> Task:
    """442 patients, 10 features, disease progression after a year (standardized); 92 held out."""
    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    y = torch.tensor((y - y.mean()) / y.std(), dtype=torch.float32)
    train, test = slice(0, 350), slice(350, None)
    return Task(
        model=lambda: nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)),
        users=Users.split((x[train], y[train]), torch.arange(350) % users),
        loss=losses.regression,
        evaluate=evaluation.held_out((x[test], y[test]), losses.regression),
        name="diabetes",
    )
