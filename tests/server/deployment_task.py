"""The task of the deployment tests (test_deployment.py, test_faults.py): the built-in ``heavy-tail`` task at its
defaults (seed 003 §3 data, linear softmax, evaluated per frequency group) with its 40 users drawn by a seeded
permutation instead of Flower Datasets' partitioner.

Why: flwr starts a fresh ClientApp process for every message, and each one builds the task. ``heavy-tail``'s
split imports flwr-datasets, which imports ``datasets``, pandas, seaborn and ``scipy.stats`` (about 2.4 s of every
message on 2 cores); these tests are about the deployment (TLS, SuperNodes, faults, the ledger), not about
partitioning, which tests/simulations/test_partitioning.py covers. The SuperLink's and SuperNodes' processes
import this module by its reference ``deployment_task:heavy_tail_task`` (the ``new_deployment`` fixture puts this
folder on their ``PYTHONPATH``).
"""

from __future__ import annotations

import torch

from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.simulations.tasks import models, synthetic

#: ``task.ref`` of the deployment tests.
REFERENCE = "deployment_task:heavy_tail_task"


def heavy_tail_task(*, users: int = 40, seed: int = 0) -> Task:
    """``builtin_tasks.heavy_tail_task(users=users, seed=seed)`` at its defaults (G = 3, L = 16: 48 examples of 7
    classes), except that user ``i`` holds the ``i``-th of ``users`` near-equal slices of a ``seed``-ed permutation
    of the examples (``torch.randperm``, then ``tensor_split``)."""
    x, y, class_groups = synthetic.heavy_tail_data(groups=3, largest=16, seed=seed)
    dim, num_classes = x.shape[1], int(class_groups.numel())
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return Task(name="heavy-tail", users=Users.in_memory([(x[part], y[part]) for part in order.tensor_split(users)]),
                model=lambda: models.linear_softmax(dim, num_classes), loss=losses.classification,
                evaluate=evaluation.classification((x, y), class_groups=class_groups), class_groups=class_groups,
                description=f"heavy-tail (seed 003 §3) at its defaults, N={users} users (a seeded permutation)")
