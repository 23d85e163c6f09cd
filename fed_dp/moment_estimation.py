"""Independent moment estimation: privatize [Σu ; α·Σu²] as ONE Gaussian query (docs/explanation/server-optimizers.md).

Each user sends its clipped update u_i and its coordinate-wise square u_i². The server adds Gaussian noise
to the concatenation [Σu ; α·Σu²] with L2 sensitivity Δ, so that the query has the same noise-to-
sensitivity ratio as the first moment alone, and the accounting stays that of the run's sampler with
multiplier σ (seed 000 Alg. 6; reconstruction). In the config's units (σ: noise std σζ on Σu when Σu is
released alone, whose sensitivity is Δ₁ = ζ for add/remove and 2ζ for replace-one):

    std on Σu = σ·ζ·Δ/Δ₁ ,   std on Σu² = (std on Σu)/α

i.e. σ·Δ for add/remove (the σΔ of docs/explanation/server-optimizers.md) and (σ/2)·Δ for replace-one.

Sensitivity of one user's [u ; α·u²] with ‖u‖₂ ≤ ζ (so ‖u²‖₂ ≤ ‖u‖₂² ≤ ζ²):

* add/remove one user:  Δ = ζ·sqrt(1 + α²ζ²)
* replace one user:     Δ = 2ζ when α²ζ² ≤ τ_d, the "for free" regime in which the second moment costs
  nothing beyond the first moment's own 2ζ (seed 000 §5.1): τ_1 = 2.7725… in one dimension and τ_d = 1/2
  for d ≥ 2 (checked numerically in the tests); otherwise the triangle bound 2ζ·sqrt(1 + α²ζ²).
"""

from __future__ import annotations

import math

import torch

from fed_dp.config import PrivacyConfig
from fed_dp.noise import NoNoise, Privatizer, make_strategy
from fed_dp.sampling import NeighboringRelation, neighboring_relation
from fed_dp.validation import check_int
from fed_dp.validation import check_positive as _check_positive

#: α²ζ² up to which the second moment is free under replace-one adjacency, in one dimension: the largest a
#: with max_{u,u'∈[−1,1]} (u−u')²·(1 + a(u+u')²) = 4, solved numerically (tests re-derive it by search).
FREE_THRESHOLD_1D = 2.7725
#: The same threshold for d ≥ 2: the worst pair u = ζ(c, −s), u' = ζ(−s, c) gives ζ²(2 + 2a + 1/(2a)), = 4ζ² at a = 1/2.
FREE_THRESHOLD_MULTI_D = 0.5


def free_threshold(dim: int) -> float:
    """τ_d: the largest α²ζ² for which the second-moment release is free under replace-one adjacency."""
    dim = check_int("dim", dim, minimum=1)
    return FREE_THRESHOLD_1D if dim == 1 else FREE_THRESHOLD_MULTI_D


def joint_sensitivity(clip_norm: float, alpha: float, relation: NeighboringRelation, dim: int) -> float:
    """Δ, the L2 sensitivity of [Σu ; α·Σu²] for one user under ``relation`` (formulas in the module doc)."""
    _check_positive("clip_norm", clip_norm)
    _check_positive("alpha", alpha)
    spread = math.sqrt(1 + (alpha * clip_norm) ** 2)
    if relation == NeighboringRelation.ADD_OR_REMOVE_ONE:
        return clip_norm * spread
    if relation == NeighboringRelation.REPLACE_ONE:
        if (alpha * clip_norm) ** 2 <= free_threshold(dim):
            return 2 * clip_norm
        return 2 * clip_norm * spread
    raise ValueError(f"unsupported neighbouring relation {relation!r}")


def first_moment_sensitivity(clip_norm: float, relation: NeighboringRelation) -> float:
    """Δ₁, the sensitivity of Σu alone: ζ under add/remove, 2ζ under replace-one."""
    return clip_norm if relation == NeighboringRelation.ADD_OR_REMOVE_ONE else 2 * clip_norm


def noise_stds(
    noise_multiplier: float, clip_norm: float, alpha: float, relation: NeighboringRelation, dim: int
) -> tuple[float, float]:
    """(σζ·Δ/Δ₁, σζ·Δ/(Δ₁α)): noise stds on Σu and on Σu² of the one joint Gaussian query.

    σ is the config's noise multiplier (std σζ on Σu released alone). Add/remove: (σΔ, σΔ/α). Replace-one
    in the free regime: (σζ, σζ/α), the noise of the first moment alone.
    """
    _check_positive("noise_multiplier", noise_multiplier)
    delta = joint_sensitivity(clip_norm, alpha, relation, dim)
    first = noise_multiplier * clip_norm * delta / first_moment_sensitivity(clip_norm, relation)
    return first, first / alpha


def stack_query(total: torch.Tensor, total_squares: torch.Tensor, alpha: float) -> torch.Tensor:
    """[Σu ; α·Σu²], the vector the privatizer noises with std σ·Δ (dimension 2d)."""
    _check_positive("alpha", alpha)
    if total.shape != total_squares.shape or total.ndim != 1:
        raise ValueError(
            f"Σu and Σu² must be flat vectors of one shape, got {tuple(total.shape)} and {tuple(total_squares.shape)}"
        )
    return torch.cat([total, alpha * total_squares])


def split_query(noisy: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``stack_query`` after noise: (Σu + n₁, Σu² + n₂/α)."""
    _check_positive("alpha", alpha)
    if noisy.ndim != 1 or noisy.numel() % 2:
        raise ValueError(f"expected a flat vector of even length 2d, got shape {tuple(noisy.shape)}")
    first, second = noisy.chunk(2)
    return first, second / alpha


def joint_privatizer(
    config: PrivacyConfig,
    dim: int,
    alpha: float,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "torch",
) -> Privatizer | NoNoise:
    """The privatizer of the joint query: dimension 2d, noise std σ·Δ with Δ for the config's adjacency.

    Privatize ``stack_query(Σu, Σu², α)`` with it, then ``split_query``; the accounting is the config's
    usual one Gaussian with multiplier σ per round.
    """
    if config.non_private:  # the explicit non-private baseline: the joint query without noise
        return NoNoise(2 * dim, device=device, dtype=dtype)
    std, _ = noise_stds(config.noise_multiplier, config.clip_norm, alpha, neighboring_relation(config), dim)
    return Privatizer(make_strategy(config), noise_std=std, dim=2 * dim, seed=seed, device=device, dtype=dtype,
                      source=source)
