"""The built-in tasks: the seed papers' datasets partitioned by user, with the model each paper used.

Each is an ordinary :class:`fed_dp.Task` (model factory, users, loss, evaluation), built by a factory that a run
config names by its short name (``task.ref = "heavy-tail"``) or by reference
(``fed_dp.simulations.builtin_tasks:heavy_tail_task``); every other ``[task]`` key is a keyword argument.

| name | data | model | evaluated on |
|---|---|---|---|
| ``heavy-tail`` | seed 003 §3 synthetic heavy-tail classes (built in) | linear softmax | the training examples, per frequency group (a memorization task: inputs are independent of labels) |
| ``sparse-logreg-1d`` | seed 000 §5.1-style 1-D sparse logistic regression (built in) | 1-D logistic | a held-out draw |
| ``cifar10`` | ``cifar-10-batches-py`` from a local folder (seeds 001, 004) | 5-layer DP CNN | the test batch |
| ``barcode-mnist`` | MNIST idx files from a local folder, seed 003 App. B | 2-conv CNN | a held-out split, per group |
| ``w1`` | BENCHMARKS.md W1: CIFAR-shaped noise, labels independent of inputs, seeded by user id (built in) | W1 CNN | nothing (a throughput workload) |

Users: ``users`` = N; ``partition`` = ``iid`` | ``dirichlet`` (``alpha``) | ``power-law`` (``exponent``) |
``natural-id`` (where the data has ids). Every example belongs to exactly one user. All use the
classification loss (``fed_dp.losses.classification``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.simulations import datasets, models, synthetic
from fed_dp.simulations.partitioning import partition


def _split_users(x: torch.Tensor, y: torch.Tensor, users: int, scheme: str, seed: int, **kw: Any) -> Users:
    parts = [torch.from_numpy(idx.astype("int64", copy=True)) for idx in partition(y.numpy(), users, scheme, seed=seed, **kw)]
    return Users.in_memory([(x[idx], y[idx]) for idx in parts])


def _partition_kwargs(partition_name: str, alpha: float | None, exponent: float | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if alpha is not None:
        kwargs["alpha"] = alpha
    if exponent is not None:
        kwargs["exponent"] = exponent
    return kwargs


def heavy_tail_task(
    *, groups: int = 3, largest: int = 16, dim: int | None = None, users: int | None = 40,
    partition: str = "iid", alpha: float | None = None, exponent: float | None = None, seed: int = 0,
) -> Task:
    """Seed 003 §3: G frequency groups, group k has 2^k classes of L/2^k examples; linear softmax model.

    The defaults are a small instance (48 examples, 7 classes, 40 users) that trains in seconds; the paper's
    size is G = 8, L = 1024 (``simulations/configs/seed003-heavy-tail.toml``). ``users=None``: N = n/2. The
    paper measures how fast each frequency group's training examples are fit, so evaluation is on the
    training examples, per group.
    """
    x, y, class_groups = synthetic.heavy_tail_data(groups=groups, largest=largest, dim=dim, seed=seed)
    n, d = x.shape
    num_classes = int(class_groups.numel())
    users = n // 2 if users is None else users
    return Task(
        name="heavy-tail",
        users=_split_users(x, y, users, partition, seed, **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.linear_softmax(d, num_classes),
        loss=losses.classification,
        evaluate=evaluation.classification((x, y), class_groups=class_groups),
        class_groups=class_groups,
        description=f"heavy-tail (seed 003 §3): G={groups}, L={largest}, n={n}, c={num_classes}, d={d}, "
                    f"N={users} users ({partition})",
    )


def sparse_logreg_task(
    *, num_examples: int = 1000, nonzero_fraction: float = 0.05, users: int | None = None,
    partition: str = "iid", seed: int = 0,
) -> Task:
    """Seed 000 §5.1-style 1-D sparse logistic regression (for the AdaGrad variants); one example per user."""
    x, y = synthetic.sparse_logistic_1d(num_examples=num_examples, nonzero_fraction=nonzero_fraction, seed=seed)
    x_eval, y_eval = synthetic.sparse_logistic_1d(num_examples=num_examples, nonzero_fraction=nonzero_fraction,
                                                  seed=seed + 1)
    users = num_examples if users is None else users
    return Task(
        name="sparse-logreg-1d",
        users=_split_users(x, y, users, partition, seed),
        model=models.logistic_1d,
        loss=losses.classification,
        evaluate=evaluation.classification((x_eval, y_eval)),
        description=f"sparse 1-D logistic regression: n={num_examples}, nonzero fraction {nonzero_fraction}, "
                    f"N={users} users ({partition})",
    )


def cifar10_task(
    *, root: str, users: int = 500, partition: str = "dirichlet", alpha: float | None = 0.5,
    exponent: float | None = None, seed: int = 0,
) -> Task:
    """CIFAR-10 from a local ``cifar-10-batches-py`` folder (seeds 001, 004) with the 5-layer DP CNN."""
    train_x, train_y, test_x, test_y = datasets.load_cifar10(root)
    return Task(
        name="cifar10",
        users=_split_users(train_x, train_y, users, partition, seed,
                           **_partition_kwargs(partition, alpha if partition == "dirichlet" else None, exponent)),
        model=models.cifar_cnn,
        loss=losses.classification,
        evaluate=evaluation.classification((test_x, test_y)),
        description=f"CIFAR-10 ({root}): {len(train_y)} train / {len(test_y)} test, N={users} users ({partition})",
    )


def barcode_mnist_task(
    *, root: str, users: int = 500, partition: str = "iid", alpha: float | None = None,
    exponent: float | None = None, eval_fraction: float = 0.1, seed: int = 0,
    groups: list[list[int]] | None = None,
) -> Task:
    """Barcode-MNIST (seed 003 App. B) built from local MNIST idx files, with the 2-conv CNN.

    ``groups``: [[barcodes, examples per class], ...] from most to least frequent (default:
    ``datasets.BARCODE_MNIST_GROUPS``); smaller groups give a smaller task.
    """
    train_x, train_y, _, _ = datasets.load_mnist(root)
    group_spec = datasets.BARCODE_MNIST_GROUPS if groups is None else tuple(tuple(g) for g in groups)
    x, y, class_groups = datasets.make_barcode_mnist(train_x, train_y, groups=group_spec, seed=seed)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held = int(len(y) * eval_fraction)
    eval_idx, train_idx = order[:held], order[held:]
    num_classes = int(class_groups.numel())
    return Task(
        name="barcode-mnist",
        users=_split_users(x[train_idx], y[train_idx], users, partition, seed,
                           **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.barcode_cnn(num_classes),
        loss=losses.classification,
        evaluate=evaluation.classification((x[eval_idx], y[eval_idx]), class_groups=class_groups),
        class_groups=class_groups,
        description=f"Barcode-MNIST ({root}): {len(train_idx)} train / {held} eval, c={num_classes}, "
                    f"N={users} users ({partition})",
    )


def w1_task(*, users: int = 500, examples: int = 32) -> Task:
    """BENCHMARKS.md W1: ``users`` users of ``examples`` CIFAR-shaped examples each, user i's data from
    ``synthetic.w1_user_data(i)``; the 25,578-parameter W1 CNN. No held-out data: labels are independent
    of the inputs, so accuracy means nothing; the workload measures throughput."""
    if not (isinstance(users, int) and users >= 1):
        raise ValueError(f"w1: users must be an integer >= 1, got {users!r}")
    return Task(
        name="w1",
        users=Users.in_memory([synthetic.w1_user_data(u, examples) for u in range(users)]),
        model=models.w1_cnn,
        loss=losses.classification,
        description=f"W1 throughput workload (BENCHMARKS.md): N={users} users x {examples} synthetic CIFAR-shaped examples",
    )


def label_counts(task: Task, num_classes: int) -> np.ndarray:
    """Examples per class over all users (for reports and tests)."""
    labels = torch.cat([task.users[i].fields[1] for i in range(task.num_users)])
    return np.bincount(labels.numpy(), minlength=num_classes)
