"""The DP query of one round (docs/explanation/mechanism.md): noisy sum over the FIXED denominator B.

    Δ̃_t = (Σ_{i∈S_t} u_i + w_t) / B ,    g̃_t = −Δ̃_t

B is the expected cohort, a constant of the configuration. Dividing by the realized |S_t|, or weighting
users by their example counts, would make one user's influence unbounded and void the accounting.
Dropped users contribute zero to Σ_t; the round still releases with the same noise. Scale-then-privatize
(§3.6) divides additionally by the broadcast scale s_t after the noise is added.
"""

from __future__ import annotations

import torch

from fed_dp.noise import Privatizer
from fed_dp.validation import check_int


def _check_cohort(expected_cohort: int) -> None:
    expected_cohort = check_int("expected_cohort (B)", expected_cohort, minimum=1)


def private_average(
    total: torch.Tensor,
    privatizer: Privatizer,
    expected_cohort: int,
    *,
    noise_std: float | None = None,
) -> torch.Tensor:
    """Δ̃_t = (Σ_t + w_t)/B. ``total`` is the unweighted sum of the clipped contributions received.

    The per-coordinate noise std of the result is σζ·‖row t of C⁻¹‖/B (σζ/B for independent noise).
    """
    _check_cohort(expected_cohort)
    return privatizer.privatize(total, noise_std) / expected_cohort


def unscale(average: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Scale-then-privatize: map the noisy average from the scaled space back, Δ̃_t / s_t (§3.6)."""
    if scale.shape != average.shape:
        raise ValueError(f"scale has shape {tuple(scale.shape)}, average has {tuple(average.shape)}")
    if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
        raise ValueError("scale must be positive and finite in every coordinate")
    return average / scale.to(average.device, average.dtype)


def average_noise_variance(
    privatizer: Privatizer, expected_cohort: int, t: int | None = None, scale: torch.Tensor | None = None
) -> float | torch.Tensor:
    """Φ_t, the per-coordinate noise variance of Δ̃_t (and of g̃_t): Var(w_t)/B², divided by s_t² for STP.

    Var(w_t) = (σζ)²·‖row t of C⁻¹‖² comes from the privatizer (default t: its last step). This is what
    DP-AdamBC subtracts (docs/explanation/server-optimizers.md): (σζ/B)² for independent noise.
    """
    _check_cohort(expected_cohort)
    variance = privatizer.noise_variance(t) / expected_cohort**2
    if scale is None:
        return variance
    if not bool((scale > 0).all()):
        raise ValueError("scale must be positive in every coordinate")
    return variance / scale.square()
