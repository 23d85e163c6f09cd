"""Tests of simulations.tasks.synthetic: the heavy-tail task (seed 003 §3) and sparse 1-D logistic data."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fed_dp.simulations.tasks.synthetic import (
    SPARSE_LOGISTIC_TRUE_WEIGHT,
    heavy_tail_class_sizes,
    heavy_tail_data,
    sparse_logistic_1d,
)


def expected_sizes(groups: int, largest: int) -> list[int]:
    """Class sizes written out from the law: group k has 2^k classes of L / 2^k examples."""
    sizes = []
    for k in range(groups):
        sizes += [largest // 2**k] * 2**k
    return sizes


# ---------------------------------------------------------------------------------------------
# heavy_tail_data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("groups", "largest"), [(1, 3), (3, 4), (5, 32), (6, 64)])
def test_heavy_tail_class_sizes_are_exact(groups: int, largest: int) -> None:
    x, y, class_groups = heavy_tail_data(groups=groups, largest=largest, seed=3)
    num_classes = 2**groups - 1
    n = groups * largest
    assert y.dtype == torch.int64 and y.shape == (n,)
    assert int(y.min()) == 0 and int(y.max()) == num_classes - 1
    counts = torch.bincount(y, minlength=num_classes)
    assert counts.tolist() == expected_sizes(groups, largest)
    assert counts.shape == (num_classes,)
    assert heavy_tail_class_sizes(groups=groups, largest=largest).tolist() == expected_sizes(groups, largest)
    # Every group holds exactly L examples.
    per_group = torch.zeros(groups, dtype=torch.int64).index_add_(0, class_groups, counts)
    assert per_group.tolist() == [largest] * groups


def test_heavy_tail_class_groups() -> None:
    _, _, class_groups = heavy_tail_data(groups=5, largest=16, dim=2)
    assert class_groups.dtype == torch.int64
    assert class_groups.tolist() == [int(math.floor(math.log2(j + 1))) for j in range(31)]
    assert torch.bincount(class_groups).tolist() == [1, 2, 4, 8, 16]


def test_heavy_tail_inputs_uniform_in_unit_cube_with_default_dim() -> None:
    groups, largest = 4, 32
    x, y, _ = heavy_tail_data(groups=groups, largest=largest, seed=1)
    n = groups * largest
    assert x.dtype == torch.float32
    assert x.shape == (n, largest + n)  # d = L + n (seed 003 §3: d = 2^m + n)
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    # Uniform[0, 1]: mean 1/2, variance 1/12 (n·d = 20480 draws, 6-sigma bounds).
    m = x.numel()
    assert abs(float(x.double().mean()) - 0.5) < 6 * math.sqrt(1 / 12 / m)
    assert abs(float(x.double().var()) - 1 / 12) < 0.005
    x2, _, _ = heavy_tail_data(groups=groups, largest=largest, dim=7, seed=1)
    assert x2.shape == (n, 7)


def test_heavy_tail_seed_instance_dimensions() -> None:
    """Default G = 8, L = 1024 is the seed's reported instance n = 8192, d = 9216, c = 255."""
    x, y, class_groups = heavy_tail_data(dim=1)  # dim=1: avoid the 300 MB default input
    assert y.shape == (8192,) and x.shape == (8192, 1)
    assert class_groups.shape == (255,)
    counts = torch.bincount(y, minlength=255)
    assert int(counts.min()) == 8 and int(counts.max()) == 1024
    # "8 classes with 128 samples each" and "128 classes with 8 samples each" (Fig. 2).
    assert counts[class_groups == 3].tolist() == [128] * 8
    assert counts[class_groups == 7].tolist() == [8] * 128
    assert 1024 + y.numel() == 9216  # the default d for these settings


def test_heavy_tail_deterministic_per_seed() -> None:
    a = heavy_tail_data(groups=4, largest=16, seed=5)
    b = heavy_tail_data(groups=4, largest=16, seed=5)
    c = heavy_tail_data(groups=4, largest=16, seed=6)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[1], c[1])
    assert torch.equal(a[2], c[2])
    assert torch.equal(torch.bincount(a[1]), torch.bincount(c[1]))


def test_heavy_tail_uses_no_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    heavy_tail_data(groups=3, largest=8, seed=0)
    assert torch.equal(before, torch.get_rng_state())


def test_heavy_tail_labels_independent_of_inputs() -> None:
    groups, largest = 4, 64
    n = groups * largest
    x, y, class_groups = heavy_tail_data(groups=groups, largest=largest, seed=11)
    d = x.shape[1]
    xd = x.double()
    # The mean input of every class is 1/2 within 6 standard errors of a mean of n_k·d uniforms.
    for k in range(class_groups.numel()):
        rows = xd[y == k]
        se = math.sqrt(1 / 12 / rows.numel())
        assert abs(float(rows.mean()) - 0.5) < 6 * se, k
    # Per coordinate, the most frequent class's mean vector is no further from 1/2 than chance.
    rows0 = xd[y == 0]
    z = (rows0.mean(0) - 0.5) / math.sqrt(1 / 12 / rows0.shape[0])
    assert float(z.pow(2).mean()) == pytest.approx(1.0, abs=6 * math.sqrt(2 / d))
    # Labels are in a random order, not sorted by class.
    assert not torch.equal(y, torch.sort(y).values)
    # First and second halves of the rows hold similar amounts of the largest class.
    first = int((y[: n // 2] == 0).sum())
    assert abs(first - largest / 2) < 6 * math.sqrt(largest / 4)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"groups": 0}, "groups"),
        ({"groups": 2.0}, "groups"),
        ({"groups": True}, "groups"),
        ({"largest": 0}, "largest"),
        ({"groups": 4, "largest": 12}, "largest"),  # 12 not divisible by 2^3
        ({"groups": 2, "largest": 4, "dim": 0}, "dim"),
        ({"groups": 2, "largest": 4, "dim": 2.5}, "dim"),
        ({"groups": 2, "largest": 4, "seed": -1}, "seed"),
        ({"groups": 2, "largest": 4, "seed": "a"}, "seed"),
    ],
)
def test_heavy_tail_validation(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        heavy_tail_data(**kwargs)


# ---------------------------------------------------------------------------------------------
# sparse_logistic_1d
# ---------------------------------------------------------------------------------------------


def test_sparse_logistic_shapes_and_types() -> None:
    x, y = sparse_logistic_1d()
    assert x.shape == (1000, 1) and x.dtype == torch.float32
    assert y.shape == (1000,) and y.dtype == torch.int64
    assert set(y.unique().tolist()) <= {0, 1}


@pytest.mark.parametrize("fraction", [0.05, 0.3])
def test_sparse_logistic_nonzero_fraction(fraction: float) -> None:
    n = 20_000
    x, _ = sparse_logistic_1d(num_examples=n, nonzero_fraction=fraction, seed=2)
    nonzero = int((x != 0).sum())
    sd = math.sqrt(n * fraction * (1 - fraction))
    assert abs(nonzero - n * fraction) < 5 * sd


def test_sparse_logistic_extreme_fractions() -> None:
    x0, _ = sparse_logistic_1d(num_examples=500, nonzero_fraction=0.0)
    assert torch.count_nonzero(x0) == 0
    x1, _ = sparse_logistic_1d(num_examples=500, nonzero_fraction=1.0)
    assert torch.count_nonzero(x1) == 500


@pytest.mark.parametrize("w", [-3.0, 0.0, 0.7, 5.0])
def test_sparse_logistic_zero_inputs_have_exactly_zero_gradient(w: float) -> None:
    x, y = sparse_logistic_1d(num_examples=2000, nonzero_fraction=0.1, seed=4)
    weight = torch.tensor([w], requires_grad=True)
    losses = F.binary_cross_entropy_with_logits(x[:, 0] * weight, y.float(), reduction="none")
    zero = x[:, 0] == 0
    assert 0 < int(zero.sum()) < 2000
    (grad_zero,) = torch.autograd.grad(losses[zero].sum(), weight, retain_graph=True)
    assert grad_zero.item() == 0.0
    # Per-example gradients (σ(w x) − y)·x: exactly 0 on x = 0, non-zero on almost every other sample.
    per_example = (torch.sigmoid(w * x[:, 0]) - y.float()) * x[:, 0]
    assert torch.all(per_example[zero] == 0)
    assert float((per_example[~zero] != 0).float().mean()) > 0.99
    assert torch.allclose(losses[zero], torch.full_like(losses[zero], math.log(2)))


def test_sparse_logistic_labels_follow_ground_truth() -> None:
    """Non-sparsified data: the 1-D logistic MLE (Newton's method) recovers w* = 1."""
    x, y = sparse_logistic_1d(num_examples=20_000, nonzero_fraction=1.0, seed=9)
    xs, ys = x[:, 0].double(), y.double()
    w = 0.0
    for _ in range(25):
        p = torch.sigmoid(w * xs)
        grad = float(((p - ys) * xs).sum())
        hess = float((p * (1 - p) * xs * xs).sum())
        w -= grad / hess
    # Fisher information at w* = 1 is n·E[σ'(z) z²] ≈ 20000·0.13, so SE(ŵ) ≈ 0.014.
    assert w == pytest.approx(SPARSE_LOGISTIC_TRUE_WEIGHT, abs=0.1)
    # Empirical loss at the truth ≈ the Bayes loss E[H(σ(z))] ≈ 0.599 (seed 000 §5.1: 0.5976).
    loss = F.binary_cross_entropy_with_logits(xs, ys).item()
    assert loss == pytest.approx(0.599, abs=0.015)


def test_sparse_logistic_deterministic_and_consistent_across_fractions() -> None:
    a = sparse_logistic_1d(num_examples=300, seed=1)
    b = sparse_logistic_1d(num_examples=300, seed=1)
    c = sparse_logistic_1d(num_examples=300, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    dense = sparse_logistic_1d(num_examples=300, nonzero_fraction=1.0, seed=1)
    kept = a[0][:, 0] != 0
    assert torch.equal(a[0][kept], dense[0][kept])
    assert torch.equal(a[1], dense[1])


def test_sparse_logistic_uses_no_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    sparse_logistic_1d(num_examples=100)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_examples": 0}, "num_examples"),
        ({"num_examples": 10.0}, "num_examples"),
        ({"nonzero_fraction": -0.1}, "nonzero_fraction"),
        ({"nonzero_fraction": 1.5}, "nonzero_fraction"),
        ({"nonzero_fraction": float("nan")}, "nonzero_fraction"),
        ({"nonzero_fraction": "0.1"}, "nonzero_fraction"),
        ({"seed": -2}, "seed"),
    ],
)
def test_sparse_logistic_validation(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        sparse_logistic_1d(**kwargs)


# ---------------------------------------------------------------------------------------------
# stackoverflow_like_user
# ---------------------------------------------------------------------------------------------


def test_stackoverflow_like_users_are_deterministic_per_id_and_heavy_tailed() -> None:
    from fed_dp.simulations.tasks.synthetic import stackoverflow_like_user, truncated_zipf

    (first,) = stackoverflow_like_user(7)
    assert torch.equal(first, stackoverflow_like_user(7)[0])  # the id alone decides
    assert not torch.equal(first, stackoverflow_like_user(7, seed=1)[0])
    counts = []
    for user in range(3000):
        (tokens,) = stackoverflow_like_user(user, vocabulary=50)
        assert tokens.dtype == torch.int64 and tokens.shape[1] == 20 and 1 <= tokens.shape[0] <= 64
        assert 0 <= int(tokens.min()) and int(tokens.max()) < 50
        counts.append(tokens.shape[0])
    counts_t = torch.tensor(counts, dtype=torch.float64)
    weights = 1.0 / torch.arange(1, 65, dtype=torch.float64)  # P(k) ∝ 1/k on 1..64
    expected_mean = float((torch.arange(1, 65) * weights).sum() / weights.sum())  # 13.5
    assert abs(float(counts_t.mean()) - expected_mean) < 1.0
    assert abs(float((counts_t == 1).double().mean()) - float(weights[0] / weights.sum())) < 0.03  # P(1) = 21%
    assert int(counts_t.max()) == 64
    cdf = truncated_zipf(4, 2.0)
    torch.testing.assert_close(cdf, torch.tensor([1, 1.25, 1.25 + 1 / 9, 1.25 + 1 / 9 + 1 / 16],
                                                 dtype=torch.float64) / (1.25 + 1 / 9 + 1 / 16))
