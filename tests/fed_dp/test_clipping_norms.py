"""The norm primitive and the clip factors of fed_dp.clipping (issue 29): l2_norm/row_norms never under-estimate
and are within their stated error; clip_factors' products are within the bound in float32 and float64.

References are computed here: ``math.fsum`` of the float64 squares (the exactly rounded sum of exact squares for
float32 input), so "never below the exact norm" is checked against the exact value up to one rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from fed_dp.clipping import (
    CHUNK, clip_factor, clip_factors, clip_update, clip_vector, l2_norm, norm_relative_error, row_norms,
)

U = 2.0**-53


def _exact_norm(vector: torch.Tensor) -> float:
    """sqrt of the correctly rounded sum of the exact float64 squares: within 1.5 ulps of ‖v‖₂."""
    return math.sqrt(math.fsum((vector.double() ** 2).tolist()))


def _vectors(dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(dim)
    spike = torch.full((dim,), 2.0**-14)  # each square 2⁻²⁸: lost against 1 in any float32 running sum
    spike[0] = 1.0
    return {"random": torch.randn(dim, generator=g), "constant": torch.full((dim,), 0.1), "spike": spike,
            "wide range": torch.randn(dim, generator=g) * torch.logspace(-30, 30, dim)}


@pytest.mark.parametrize("dim", [1, 7, 1_000, CHUNK, CHUNK + 1, 200_003])
def test_l2_norm_is_an_upper_bound_within_its_relative_error(dim):
    eta = norm_relative_error(dim)
    for name, vector in _vectors(dim).items():
        exact, bound = _exact_norm(vector), l2_norm(vector)
        assert bound.dtype == torch.float64 and bound.ndim == 0
        assert exact * (1 - 2 * U) <= float(bound) <= exact * (1 + eta) * (1 + 2 * U), name


def test_l2_norm_of_half_precision_and_of_float64():
    vector = _vectors(1_000)["random"]
    assert float(l2_norm(vector.to(torch.bfloat16))) >= _exact_norm(vector.to(torch.bfloat16))
    wide = vector.double() * 1e-160  # float64 squares that underflow: the bound stays above
    assert float(l2_norm(wide)) >= math.sqrt(math.fsum(v * v for v in (vector.double() * 1e-10).tolist())) * 1e-150
    assert float(l2_norm(torch.zeros(10))) == 0.0 and float(l2_norm(torch.zeros(0))) == 0.0


def test_norm_relative_error_follows_the_summation_depth():
    """η = K² − 1 with K ≥ (1 − u)^−2.5 (1 − γ_h)^−½ rounded up 3 ulps: (h + 5)u to (h + 20)u for h additions
    per square."""
    assert (999 + 5) * U < norm_relative_error(1_000) < (999 + 20) * U
    assert (CHUNK - 1 + 5) * U < norm_relative_error(CHUNK) < (CHUNK - 1 + 20) * U
    depth = CHUNK - 1 + math.ceil(10**8 / CHUNK) - 1  # chunk sums, then one sum of the chunk sums
    assert (depth + 5) * U < norm_relative_error(10**8) < (depth + 20) * U
    assert norm_relative_error(2**48) < 2.2e-11
    with pytest.raises(ValueError, match="dim"):
        norm_relative_error(2**48 + 1)


@pytest.mark.parametrize("dim", [300, CHUNK + 5])
def test_row_norms_equal_l2_norm_of_each_row(dim):
    g = torch.Generator().manual_seed(dim)
    rows = torch.randn(5, dim, generator=g) * torch.tensor([1e-3, 1, 0, 1e3, 7]).unsqueeze(1)
    norms = row_norms(rows)
    assert norms.dtype == torch.float64 and norms.shape == (5,)
    assert torch.equal(norms, torch.stack([l2_norm(row) for row in rows]))
    assert row_norms(torch.zeros(0, dim)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_factors_keep_every_product_within_the_bound(dtype):
    """Vectors whose norm bounds sit just above, at and below ζ, over 9 decades: l2_norm(f·x) ≤ ζ whether the
    product is computed in dtype or in float64 and rounded to dtype, and f is exactly representable."""
    g = torch.Generator().manual_seed(0)
    dim, zeta = 2_000, 0.75
    for scale in torch.logspace(-3, 6, 40, dtype=torch.float64).tolist():
        for direction in (torch.randn(dim, generator=g, dtype=torch.float64), torch.ones(dim, dtype=torch.float64)):
            x = (direction * (scale * zeta / direction.norm())).to(dtype)
            bound = l2_norm(x)
            factor = clip_factors(bound, zeta, dim=dim, dtype=dtype)
            assert factor.dtype == torch.float64 and 0 <= float(factor) <= 1
            assert float(factor.to(dtype)) == float(factor)
            for product in (x * factor.to(dtype), (x.double() * factor).to(dtype)):
                assert float(l2_norm(product)) <= zeta
            assert (float(factor) == 1) == (float(bound) * (1 + norm_relative_error(dim, dtype)) <= zeta)


def test_clip_factors_are_tight():
    """The margin is that of the argument: f·N̄ ≥ ζ(1 − η − 2⁻²⁴ − 2⁻²³ − …) for float32 and far less for
    float64, so a clipped vector keeps (almost) all of ζ."""
    norms = torch.tensor([1.0 + 1e-6, 3.0, 1e6], dtype=torch.float64)
    for dtype, margin in ((torch.float32, 2.0**-24 + 2.0**-23 + 1e-10), (torch.float64, 1e-10)):
        factors = clip_factors(norms, 1.0, dim=1000, dtype=dtype)
        assert bool(((factors * norms) >= 1 - margin).all()) and bool(((factors * norms) < 1).all())


def test_clip_factors_edge_cases_and_refusals():
    norms = torch.tensor([0.0, 0.5, math.inf], dtype=torch.float64)
    assert clip_factors(norms, 1.0).tolist() == [1.0, 1.0, 0.0]
    assert clip_factors(norms, 0.0).tolist() == [1.0, 0.0, 0.0]  # a zero bound keeps only the zero vector
    assert torch.equal(clip_factor(norms, 1.0), clip_factors(norms, 1.0))
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="clip_norm"):
            clip_factors(norms, bad)
    with pytest.raises(ValueError, match="float32 or wider"):
        clip_factors(norms, 1.0, dtype=torch.bfloat16)


def test_clip_vector_enforces_a_bound_of_zero_and_keeps_what_fits():
    vector = torch.tensor([3.0, 4.0])
    assert clip_vector(vector, 5.0 * (1 + 1e-9)) == (vector, False)
    zeroed, scaled = clip_vector(vector, 0.0)
    assert scaled and torch.equal(zeroed, torch.zeros(2))
    within, scaled = clip_vector(vector, 5.0)  # ‖v‖ = 5 exactly, but the bound must hold with η: scaled
    assert scaled and float(l2_norm(within)) <= 5.0


def test_clip_update_returns_a_new_tensor_even_when_within_the_bound():
    update = torch.tensor([0.3, -0.4])
    result = clip_update(update, 1.0)
    assert torch.equal(result.update, update) and result.update is not update and not result.clipped
