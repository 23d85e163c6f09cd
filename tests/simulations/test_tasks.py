"""Task registry: every task builds from its data (local files in the real formats) into disjoint users."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch

from fed_dp.simulations.tasks import build_task, label_counts
from fed_dp.simulations.synthetic import heavy_tail_class_sizes


def _write_cifar(root, rows_per_batch: int = 20, seed: int = 0) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (rows_per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, rows_per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


def _write_mnist(root, per_digit: int = 30, seed: int = 0) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for prefix, n_per in (("train", per_digit), ("t10k", 2)):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n_per)
        images = rng.integers(0, 256, (labels.size, 28, 28), dtype=np.uint8)
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, labels.size, 28, 28) + images.tobytes())
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, labels.size) + labels.tobytes())


def _assert_users_partition(task, total: int) -> None:
    assert task.num_users == len(task.users) and all(len(u) >= 1 for u in task.users)
    assert sum(len(u) for u in task.users) == total


def test_heavy_tail_task_keeps_exact_class_sizes_and_groups():
    task = build_task("heavy-tail", groups=3, largest=8, users=12, seed=1)
    sizes = heavy_tail_class_sizes(groups=3, largest=8)
    assert np.array_equal(label_counts(task), sizes.numpy())
    _assert_users_partition(task, int(sizes.sum()))
    assert task.class_groups.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert len(task.eval_data) == int(sizes.sum())  # a memorization task: evaluated on its examples


def test_cifar10_task_from_local_batches(tmp_path):
    _write_cifar(tmp_path)
    task = build_task("cifar10", root=str(tmp_path), users=10, partition="iid", seed=0)
    _assert_users_partition(task, 100)
    assert len(task.eval_data) == 20 and task.users[0].x.shape[1:] == (3, 32, 32)
    assert task.make_model()(task.users[0].x).shape[1] == 10


def test_barcode_mnist_task_from_local_idx_files(tmp_path):
    _write_mnist(tmp_path / "mnist")
    task = build_task("barcode-mnist", root=str(tmp_path / "mnist"), users=8, groups=[[1, 12], [2, 3]],
                      eval_fraction=0.25, seed=0)
    # 10 plain digits × 12 examples + 20 barcoded classes × 3 examples = 180; a quarter held out
    assert task.num_classes == 30 and task.class_groups.bincount().tolist() == [10, 20]
    _assert_users_partition(task, 180 - 45)
    assert len(task.eval_data) == 45
    assert task.make_model()(task.users[0].x).shape[1] == 30


def test_missing_data_folder_says_what_to_put_where(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        build_task("cifar10", root=str(tmp_path / "nowhere"), users=2)


def test_unknown_task_or_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown task"):
        build_task("imagenet")
    with pytest.raises(ValueError, match="heavy-tail"):
        build_task("heavy-tail", colour=3)


def test_sparse_task_has_held_out_data_of_the_same_law():
    task = build_task("sparse-logreg-1d", num_examples=200, users=50, seed=3)
    _assert_users_partition(task, 200)
    from fed_dp.simulations.synthetic import sparse_logistic_1d

    x_eval, y_eval = sparse_logistic_1d(num_examples=200, seed=4)  # held out: the next seed, same law
    assert torch.equal(task.eval_data.x, x_eval) and torch.equal(task.eval_data.y, y_eval)
    x_train, _ = sparse_logistic_1d(num_examples=200, seed=3)
    assert sorted(torch.cat([u.x for u in task.users]).flatten().tolist()) == sorted(x_train.flatten().tolist())


def test_w1_task_is_benchmarks_md_w1():
    """500 users × 32 CIFAR-shaped examples, user i's drawn from torch.Generator().manual_seed(i) (inputs,
    then labels), the 25,578-parameter CNN, no held-out data; the same users whatever N is."""
    task = build_task("w1")
    assert task.num_users == 500 and all(len(u) == 32 for u in task.users)
    assert sum(p.numel() for p in task.make_model().parameters()) == 25_578
    assert len(task.eval_data) == 0
    for user in (0, 7, 499):
        generator = torch.Generator().manual_seed(user)
        x = torch.randn(32, 3, 32, 32, generator=generator)
        y = torch.randint(10, (32,), generator=generator)
        assert torch.equal(task.users[user].x, x) and torch.equal(task.users[user].y, y)
    small = build_task("w1", users=8, examples=4)
    assert torch.equal(small.users[7].x, task.users[7].x[:4])
    assert not torch.equal(task.users[0].x, task.users[1].x)
    with pytest.raises(ValueError, match="users"):
        build_task("w1", users=0)
