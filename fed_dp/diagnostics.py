"""Per-round diagnostics that the seed papers plot (ALGORITHMS §3, last paragraph).

* the fraction of coordinates with ν̂_t − Φ̂_t < 0 (seed 000 Fig. 4): bias correction is then floored;
* min / quartiles / median / max of ν̂_t and of ν̂_t − Φ̂_t (seed 001 Table 1);
* ‖Σ_t‖ / (|S_t|·ζ), how aligned the users' clipped updates are (seed 000 Fig. 5).

The first two are post-processing of released quantities. The last one reads the *un-noised* sum and the
realized cohort size: it is NOT private, and engines may only record it in simulations.
"""

from __future__ import annotations

import torch

from fed_dp.clipping import l2_norm

_QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
_NAMES = ("min", "q25", "median", "q75", "max")


def _summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    flat = values.detach().reshape(-1).double()
    if flat.numel() > 1_000_000:  # torch.quantile's limit: use the exact k-th values instead
        sorted_values = flat.sort().values
        picks = [sorted_values[round(q * (flat.numel() - 1))] for q in _QUANTILES]
    else:
        picks = list(torch.quantile(flat, torch.tensor(_QUANTILES, dtype=torch.float64)))
    return {f"{prefix}_{name}": float(v) for name, v in zip(_NAMES, picks)}


def second_moment_summary(nu_hat: torch.Tensor, phi_hat: torch.Tensor | float | None) -> dict[str, float]:
    """Quantiles of ν̂ and, when Φ̂ is known, of ν̂ − Φ̂ and the fraction of negative coordinates."""
    metrics = _summary("nu_hat", nu_hat)
    if phi_hat is not None:
        corrected = nu_hat - phi_hat
        metrics.update(_summary("nu_hat_minus_phi", corrected))
        metrics["fraction_nu_hat_below_phi"] = float((corrected < 0).double().mean())
    return metrics


def alignment_ratio(total: torch.Tensor, cohort_size: int, clip_norm: float) -> float:
    """‖Σ_t‖ / (|S_t|·ζ) ∈ [0, 1]: 1 when all clipped updates point the same way at full norm.

    NOT private (un-noised sum, realized cohort size): simulations only. The norm is ``fed_dp.clipping.l2_norm``
    (float32 reductions under-estimate it at large d), so the ratio of an enforced sum never exceeds 1.
    """
    if cohort_size <= 0:
        return float("nan")
    return float(l2_norm(total)) / (cohort_size * clip_norm)
