"""Tests of simulations.tasks.partitioning: user partitions built with flwr-datasets partitioners."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fed_dp.simulations.tasks.partitioning import SCHEMES, partition, partition_sizes, power_law_sizes

N_EXAMPLES = 2000
N_CLASSES = 10


def make_labels(n: int = N_EXAMPLES, classes: int = N_CLASSES, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, classes, (n,), generator=gen)


def make_natural_ids(n: int, users: int, seed: int = 0) -> np.ndarray:
    """String ids, unevenly sized and scattered over the rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, users, (n,), generator=gen)
    ids[:users] = torch.arange(users)  # every id appears at least once
    ids = ids[torch.randperm(n, generator=gen)]
    return np.array([f"user-{int(i):03d}" for i in ids])


def kwargs_for(scheme: str, n: int, users: int) -> dict:
    if scheme == "natural-id":
        return {"natural_ids": make_natural_ids(n, users)}
    return {}


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
    allidx = np.concatenate(parts)
    assert allidx.shape == (n,), "every example is assigned exactly once"
    assert np.array_equal(np.sort(allidx), np.arange(n))


def label_entropy(labels: np.ndarray, part: np.ndarray, classes: int) -> float:
    counts = np.bincount(labels[part], minlength=classes).astype(float)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------
# every scheme
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partitions_are_disjoint_and_cover_everything(scheme: str) -> None:
    labels = make_labels()
    users = 25
    parts = partition(labels, users, scheme, seed=1, **kwargs_for(scheme, N_EXAMPLES, users))
    assert len(parts) == users
    assert_exact_cover(parts, N_EXAMPLES)
    sizes = partition_sizes(parts)
    assert sizes.dtype == np.int64 and sizes.shape == (users,)
    assert sizes.sum() == N_EXAMPLES and sizes.min() >= 1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_deterministic_per_seed(scheme: str) -> None:
    labels = make_labels()
    users = 20
    extra = kwargs_for(scheme, N_EXAMPLES, users)
    a = partition(labels, users, scheme, seed=3, **extra)
    b = partition(labels, users, scheme, seed=3, **extra)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    c = partition(labels, users, scheme, seed=4, **extra)
    same = all(np.array_equal(np.sort(u), np.sort(v)) for u, v in zip(a, c))
    # natural-id is fixed by the ids; the random schemes change with the seed.
    assert same == (scheme == "natural-id")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_accepts_numpy_list_and_tensor_labels(scheme: str) -> None:
    labels = make_labels(n=200)
    extra = kwargs_for(scheme, 200, 8)
    ref = partition(labels, 8, scheme, **extra)
    for form in (labels.numpy(), labels.tolist()):
        got = partition(form, 8, scheme, **extra)
        assert all(np.array_equal(u, v) for u, v in zip(ref, got))


# ---------------------------------------------------------------------------------------------
# iid
# ---------------------------------------------------------------------------------------------


def test_iid_sizes_balanced_and_contents_shuffled() -> None:
    labels = make_labels(n=1003)
    parts = partition(labels, 10, "iid", seed=0)
    sizes = partition_sizes(parts)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 1003
    # Not contiguous blocks of the original order.
    assert not np.array_equal(parts[0], np.arange(sizes[0]))
    assert np.any(np.diff(parts[0]) < 0)


@pytest.mark.parametrize("n, users", [(1003, 10), (1000, 1000), (7, 3)])
def test_the_contiguous_schemes_cut_the_blocks_flwr_datasets_partitioners_cut(n: int, users: int) -> None:
    """iid and power-law are cut with numpy (reading 14,336 partitions back through flwr-datasets took 14 s of the
    main job's start-up): the blocks are those IidPartitioner and SizePartitioner return for the same order."""
    import datasets
    from flwr_datasets.partitioner import IidPartitioner, SizePartitioner

    from fed_dp.simulations.tasks.partitioning import _random_order

    order = _random_order(n, 5)
    rows = datasets.Dataset.from_dict({"index": order})
    sizes = power_law_sizes(n, users, exponent=1.2)
    for scheme, partitioner, extra in (("iid", IidPartitioner(num_partitions=users), {}),
                                       ("power-law", SizePartitioner(partition_sizes=[int(s) for s in sizes]),
                                        {"exponent": 1.2})):
        partitioner.dataset = rows
        theirs = [np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64) for i in range(users)]
        ours = partition(np.zeros(n, dtype=np.int64), users, scheme, seed=5, **extra)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)), scheme


# ---------------------------------------------------------------------------------------------
# natural-id
# ---------------------------------------------------------------------------------------------


def test_natural_ids_respected_and_sorted() -> None:
    n, users = 1500, 30
    ids = make_natural_ids(n, users, seed=5)
    parts = partition(make_labels(n=n), users, "natural-id", natural_ids=ids)
    assert_exact_cover(parts, n)
    owner = [np.unique(ids[p]) for p in parts]
    assert all(len(o) == 1 for o in owner), "each user's examples share one id"
    owner_ids = [str(o[0]) for o in owner]
    assert owner_ids == sorted(np.unique(ids).tolist()), "user i holds the i-th id in sorted order"
    for user, uid in enumerate(owner_ids):  # all examples of an id go to that one user
        assert np.array_equal(np.sort(parts[user]), np.flatnonzero(ids == uid))


def test_natural_ids_integers() -> None:
    ids = torch.tensor([7, 3, 7, 10, 3, 3, 10, 7])
    parts = partition(torch.zeros(8, dtype=torch.int64), 3, "natural-id", natural_ids=ids)
    assert [np.sort(p).tolist() for p in parts] == [[1, 4, 5], [0, 2, 7], [3, 6]]


def test_natural_id_errors() -> None:
    labels = make_labels(n=100)
    ids = make_natural_ids(100, 5)
    with pytest.raises(ValueError, match="distinct natural ids, which is 5"):
        partition(labels, 4, "natural-id", natural_ids=ids)
    with pytest.raises(ValueError, match="natural_ids"):
        partition(labels, 5, "natural-id")
    with pytest.raises(ValueError, match="natural_ids"):
        partition(labels, 5, "natural-id", natural_ids=ids[:-1])
    with pytest.raises(ValueError, match="natural_ids"):
        partition(labels, 5, "iid", natural_ids=ids)
    with pytest.raises(ValueError, match="min_size"):
        partition(labels, 5, "natural-id", natural_ids=ids, min_size=60)


# ---------------------------------------------------------------------------------------------
# dirichlet
# ---------------------------------------------------------------------------------------------


def test_dirichlet_label_skew_responds_to_alpha() -> None:
    labels = make_labels(n=4000, seed=2)
    lab = labels.numpy()
    users = 20

    def skew(alpha: float) -> tuple[float, float]:
        entropies, max_shares = [], []
        for seed in range(3):
            for p in partition(labels, users, "dirichlet", alpha=alpha, seed=seed):
                entropies.append(label_entropy(lab, p, N_CLASSES))
                max_shares.append(np.bincount(lab[p], minlength=N_CLASSES).max() / len(p))
        return float(np.mean(entropies)), float(np.mean(max_shares))

    h_low, share_low = skew(0.1)
    h_high, share_high = skew(100.0)
    h_max = math.log(N_CLASSES)
    assert h_high > 0.95 * h_max  # nearly IID label mix
    assert share_high < 0.2
    assert h_low < 0.6 * h_high  # strongly skewed at small alpha
    assert share_low > 2 * share_high


def test_dirichlet_respects_min_size() -> None:
    labels = make_labels()
    parts = partition(labels, 20, "dirichlet", alpha=1.0, min_size=40, seed=0)
    assert_exact_cover(parts, N_EXAMPLES)
    assert partition_sizes(parts).min() >= 40


def test_dirichlet_impossible_min_size_is_rejected_up_front() -> None:
    with pytest.raises(ValueError, match=r"min_size=101 is impossible"):
        partition(make_labels(), 20, "dirichlet", min_size=101)


def test_dirichlet_unsatisfiable_draws_give_clear_error() -> None:
    # 100 users, 1000 examples, alpha = 0.1: some user is almost surely left empty.
    with pytest.raises(ValueError, match="increase alpha"):
        partition(make_labels(n=1000), 100, "dirichlet", alpha=0.1, min_size=1)


# ---------------------------------------------------------------------------------------------
# power-law
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.5, 2.5])
def test_power_law_sizes_follow_the_law(exponent: float) -> None:
    n, users, m = 20_000, 20, 1
    parts = partition(make_labels(n=n), users, "power-law", exponent=exponent, min_size=m, seed=2)
    assert_exact_cover(parts, n)
    sizes = partition_sizes(parts)
    assert np.array_equal(sizes, power_law_sizes(n, users, exponent=exponent, min_size=m))
    # s_i − m is R·(i+1)^(−a)/Σ_j (j+1)^(−a) up to rounding (|error| < 1).
    weights = np.array([(i + 1) ** -exponent for i in range(users)])
    quotas = (n - users * m) * weights / weights.sum()
    assert np.all(np.abs((sizes - m) - quotas) < 1)
    assert np.all(np.diff(sizes) <= 0), "non-increasing in user id"
    # Largest / smallest ratio matches N^a within rounding.
    ratio = (sizes[0] - m) / (sizes[-1] - m)
    lo = (quotas[0] - 1) / (quotas[-1] + 1)
    hi = (quotas[0] + 1) / (quotas[-1] - 1)
    assert lo <= ratio <= hi
    # i.e. the law's N^a, up to the relative rounding error of the smallest quota.
    assert ratio == pytest.approx(users**exponent, rel=2.5 / (quotas[-1] - 1))


def test_power_law_is_heavy_tailed() -> None:
    n, users = 10_000, 100
    sizes = partition_sizes(partition(make_labels(n=n), users, "power-law", exponent=1.5))
    # The largest 10 % of users hold most of the data; the median user holds little.
    top = np.sort(sizes)[::-1][: users // 10].sum()
    assert top / n > 0.6
    assert np.median(sizes) < 0.2 * n / users


def test_power_law_min_size_floor_and_random_contents() -> None:
    n, users, m = 1000, 50, 5
    parts = partition(make_labels(n=n), users, "power-law", exponent=3.0, min_size=m, seed=1)
    sizes = partition_sizes(parts)
    assert sizes.min() >= m and sizes.sum() == n and np.all(np.diff(sizes) <= 0)
    assert sizes[-1] == m  # the tail sits at the floor
    # The largest user holds a random subset, not the first rows.
    assert not np.array_equal(np.sort(parts[0]), np.arange(sizes[0]))


def test_power_law_sizes_ties_stay_monotone() -> None:
    sizes = power_law_sizes(103, 10, exponent=0.0)
    assert sizes.tolist() == [11, 11, 11, 10, 10, 10, 10, 10, 10, 10]


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def test_unknown_scheme_lists_choices() -> None:
    with pytest.raises(ValueError, match="iid.*dirichlet.*natural-id.*power-law"):
        partition(make_labels(n=10), 2, "zipf")


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((make_labels(n=10), 11, "iid"), {}, "num_users=11 exceeds"),
        ((make_labels(n=10), 0, "iid"), {}, "num_users"),
        ((make_labels(n=10), 2.0, "iid"), {}, "num_users"),
        ((np.zeros((5, 2), dtype=int), 2, "iid"), {}, "one-dimensional"),
        ((np.zeros(0, dtype=int), 1, "iid"), {}, "at least one"),
        ((np.linspace(0, 1, 10), 2, "dirichlet"), {}, "integers"),
        ((make_labels(n=10), 2, "dirichlet"), {"alpha": 0.0}, "alpha"),
        ((make_labels(n=10), 2, "dirichlet"), {"alpha": float("inf")}, "alpha"),
        ((make_labels(n=10), 2, "power-law"), {"exponent": -1.0}, "exponent"),
        ((make_labels(n=10), 2, "power-law"), {"min_size": 0}, "min_size"),
        ((make_labels(n=10), 4, "power-law"), {"min_size": 3}, "min_size=3 is impossible"),
        ((make_labels(n=10), 4, "iid"), {"min_size": 3}, "min_size=3 is impossible"),
        ((make_labels(n=10), 2, "iid"), {"seed": -1}, "seed"),
    ],
)
def test_bad_input(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(*args, **kwargs)
