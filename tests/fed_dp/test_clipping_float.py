"""The clip bound holds in floating point (issue 29): no released vector above its bound, at any size.

Every check measures the released vector with a reference norm written here, independent of the code under
test: float64 squares (exact for float32 entries), float64 dot products of 4,096 entries combined with
``math.fsum`` (relative error < 10⁻¹²). The inputs are random and adversarial: a norm 10⁻⁶ above ζ (below the
float32 reductions' error from d ≈ 10⁵ on), constant vectors (every product rounds the same way), one huge
coordinate among many tiny ones. These tests use only names that predate the issue (``clip_update``,
``clip_rows``, ``clip_scaled``, ``aggregate``) and fail on the code before it: float32 norms under-estimate,
the float32 product u·(ζ/‖u‖) lands above ζ, bfloat16 was clipped in bfloat16, the server allowed 10⁻⁵ slack.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fed_dp.clipping import clip_rows, clip_scaled, clip_update
from fed_dp.contribution import Contribution, RoundPlan
from fed_dp.round import aggregate

ZETA = 1.5
ABOVE = 1 + 1e-6  # a norm 10⁻⁶ (relative) above its bound
#: the largest margin the argument needs below ζ for float32 (clipping.clip_factors): the clip must not
#: be more conservative than this.
TIGHT = 2e-7


def _reference_norm(vector: torch.Tensor) -> float:
    """‖v‖₂ in float64: exact squares, dot products of 4,096 entries, fsum of those (error < 10⁻¹²)."""
    values = vector.detach().cpu().numpy()
    full = values.size // 4096 * 4096
    sums = []
    for start in range(0, full, 1 << 22):  # 32 MiB of float64 at a time
        block = values[start : min(start + (1 << 22), full)].astype(np.float64).reshape(-1, 4096)
        sums.extend(np.einsum("ij,ij->i", block, block).tolist())
    return math.sqrt(math.fsum(sums) + math.fsum((values[full:].astype(np.float64) ** 2).tolist()))


def _vector(kind: str, dim: int, seed: int) -> tuple[torch.Tensor, float]:
    """A float32 vector of the given kind, scaled so that its reference norm is ABOVE·ζ, and that norm."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(dim, generator=g)
    elif kind == "constant":
        x = torch.full((dim,), 0.37)
    else:  # "spike": one coordinate carries 99% of ‖x‖², the others are each below its float32 half-ulp
        x = torch.rand(dim, generator=g) + 0.5
        x *= math.sqrt(0.01 / float(x.double().square().sum()))
        x[dim // 3] = math.sqrt(0.99)
    scaled = x.mul_(ABOVE * ZETA / _reference_norm(x))  # one float32 rounding per entry (≤ 6·10⁻⁸)
    norm = _reference_norm(scaled)
    assert norm > ZETA * (1 + 5e-7)  # still above after its own rounding
    return scaled, norm


def _check_released(released: torch.Tensor, bound: float) -> None:
    norm = _reference_norm(released)
    assert norm <= bound, f"released norm {norm!r} > bound {bound!r} (relative {norm / bound - 1:+.2e})"
    assert norm >= bound * (1 - TIGHT), f"clip too conservative: relative margin {1 - norm / bound:.2e}"


CASES = [(kind, dim) for dim in (1_000, 100_003, 3_000_000) for kind in ("random", "constant", "spike")]
CASES += [("random", 30_000_000), ("constant", 30_000_000)]


@pytest.mark.parametrize("kind, dim", CASES)
def test_a_clipped_update_is_within_zeta_in_float64(kind, dim):
    update, norm = _vector(kind, dim, seed=dim)
    result = clip_update(update, ZETA)
    assert result.clipped and result.update.dtype == torch.float32
    assert result.norm >= norm  # the reported norm never under-estimates
    _check_released(result.update, ZETA)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "constant", "spike"])
def test_a_clipped_update_of_10_to_the_8_entries_is_within_zeta(kind):
    update, norm = _vector(kind, 100_000_000, seed=8)
    result = clip_update(update, ZETA)
    assert result.clipped and result.norm >= norm
    _check_released(result.update, ZETA)


def test_every_row_of_a_cohort_is_within_zeta():
    made = [_vector(kind, 20_000, seed=i) for i in range(24) for kind in ("random", "constant")]
    rows = torch.stack([row for row, _ in made])
    clipped, norms = clip_rows(rows, ZETA)
    for i, (_, norm) in enumerate(made):
        assert float(norms[i]) >= norm
        _check_released(clipped[i], ZETA)


def test_the_scaled_clip_is_within_zeta():
    g = torch.Generator().manual_seed(5)
    scale = torch.rand(200_000, generator=g) + 0.5
    target, _ = _vector("random", 200_000, seed=5)
    delta = (target.double() / scale.double()).float()
    product = scale * delta
    delta = (delta.double() * (ABOVE * ZETA / _reference_norm(product))).float()
    result = clip_scaled(delta, scale, ZETA)
    assert result.clipped
    _check_released(result.update, ZETA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_updates_are_clipped_in_float32(dtype):
    update = _vector("random", 50_000, seed=3)[0].to(dtype)
    update = update * torch.tensor(2.0, dtype=dtype)  # well above ζ in its own precision
    result = clip_update(update, ZETA)
    assert result.update.dtype == torch.float32
    _check_released(result.update, ZETA)


def _plan(clip_norm: float, users: int, dim: int) -> RoundPlan:
    return RoundPlan(round=0, cohort=torch.arange(users), params=torch.zeros(dim), clip_norm=clip_norm,
                     scale=None, send_squares=False)


@pytest.mark.parametrize("kind, dim", [("random", 1_000), ("constant", 100_003), ("random", 3_000_000)])
def test_the_server_scales_a_sum_just_above_its_bound(kind, dim):
    count = 3
    total = (_vector(kind, dim, seed=11)[0].double() * count).float()  # reference norm ≈ ABOVE·count·ζ
    assert _reference_norm(total) > count * ZETA * (1 + 5e-7)
    summed, _, counted, metrics = aggregate(_plan(ZETA, count, dim), [Contribution(total, count)], dim,
                                            "cpu", torch.float32)
    assert counted == count and metrics["reclipped_replies"] == 1
    _check_released(summed, count * ZETA)


@pytest.mark.parametrize("dim", [1_000, 100_003])
def test_honest_nodes_are_never_reclipped(dim):
    """Nodes of one user whose clipped update sits at ζ, of the adversarial kinds, and a node of 20 users
    whose updates are clipped and summed as the clients do: none of them is scaled by the server."""
    contributions = [Contribution(clip_update(_vector(kind, dim, seed=dim + 1)[0], ZETA).update, 1)
                     for kind in ("random", "constant", "spike")]
    g = torch.Generator().manual_seed(dim)
    node = torch.zeros(dim)
    for _ in range(20):
        node += clip_update(torch.randn(dim, generator=g) * 3.0, ZETA).update
    contributions.append(Contribution(node, 20))
    users = sum(c.count for c in contributions)
    summed, _, _, metrics = aggregate(_plan(ZETA, users, dim), contributions, dim, "cpu", torch.float32)
    assert metrics["reclipped_replies"] == 0
    expected = sum(c.total.double() for c in contributions).float()
    assert torch.equal(summed, expected)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("dim", [3_000_000, 100_000_000])
@pytest.mark.parametrize("kind", ["random", "constant", "spike"])
def test_a_clipped_update_on_cuda_is_within_zeta(kind, dim):
    """The same bound with the norm and the product computed on the GPU (its reductions add in another order)."""
    update, norm = _vector(kind, dim, seed=dim)
    result = clip_update(update.cuda(), ZETA)
    assert result.clipped and result.norm >= norm and result.update.device.type == "cuda"
    _check_released(result.update, ZETA)


@CUDA
def test_every_row_of_a_cohort_on_cuda_is_within_zeta():
    made = [_vector(kind, 20_000, seed=i) for i in range(24) for kind in ("random", "constant", "spike")]
    clipped, norms = clip_rows(torch.stack([row for row, _ in made]).cuda(), ZETA)
    for i, (_, norm) in enumerate(made):
        assert float(norms[i]) >= norm
        _check_released(clipped[i], ZETA)
