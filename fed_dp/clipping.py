"""L2 clipping of whole user updates (ALGORITHMS §1) and in the scaled geometry of §3.6.

    u_i = clip(Δ_i, ζ) = Δ_i · min(1, ζ / ‖Δ_i‖₂)          (norm over all tensors: one flat vector)

Scale-then-privatize (seed 000 Alg. 8; ALGORITHMS §3.6) clips in the preconditioned space:

    u_i = clip(s_t ⊙ Δ_i, ζ)

The clip is the sensitivity bound of the whole mechanism, so a non-finite update is an error here, never
silently zeroed: the server's validation decides what to do with such a reply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClipResult:
    """A clipped update with its statistics.

    ``norm`` is ‖input‖₂ before clipping; ``clipped`` tells whether the input was scaled down
    (‖input‖₂ > ζ), the bit that adaptive clipping counts (as its complement 1[‖Δ‖ ≤ ζ]).
    """

    update: torch.Tensor
    norm: float
    clipped: bool


def _check_vector(update: torch.Tensor, what: str) -> None:
    if not isinstance(update, torch.Tensor) or update.ndim != 1:
        raise ValueError(f"{what} must be a flat 1-D tensor (see fed_dp.flat.ParamLayout)")
    if not update.dtype.is_floating_point:
        raise ValueError(f"{what} must be floating point, got {update.dtype}")
    if not bool(torch.isfinite(update).all()):
        raise ValueError(f"{what} contains NaN or Inf values; it cannot be clipped")


def _check_clip_norm(clip_norm: float) -> None:
    if not (isinstance(clip_norm, (int, float)) and clip_norm > 0 and clip_norm != float("inf")):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")


def clip_factor(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """min(1, ζ/‖u‖) element-wise on a tensor of norms (1 for a zero norm)."""
    return torch.clamp(clip_norm / norms, max=1.0)


def clip_update(update: torch.Tensor, clip_norm: float) -> ClipResult:
    """clip(u, ζ) = u · min(1, ζ/‖u‖₂) for one flat update. Returns a new tensor."""
    _check_clip_norm(clip_norm)
    _check_vector(update, "update")
    norm = torch.linalg.vector_norm(update)
    return ClipResult(
        update=update * clip_factor(norm, clip_norm),
        norm=float(norm),
        clipped=bool(norm > clip_norm),
    )


def clip_rows(updates: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row of an (n, d) matrix of user updates; returns (clipped rows, norms before).

    One tensor operation for a whole cohort (the vectorized path of the simulation engine); row i of
    the result equals ``clip_update(updates[i], ζ).update``.
    """
    _check_clip_norm(clip_norm)
    if updates.ndim != 2:
        raise ValueError(f"updates must be an (n, d) matrix, got shape {tuple(updates.shape)}")
    if not bool(torch.isfinite(updates).all()):
        raise ValueError("updates contain NaN or Inf values; they cannot be clipped")
    norms = torch.linalg.vector_norm(updates, dim=1)
    return updates * clip_factor(norms, clip_norm).unsqueeze(1), norms


def clip_scaled(delta: torch.Tensor, scale: torch.Tensor, clip_norm: float) -> ClipResult:
    """Scale-then-privatize clip: clip(s ⊙ Δ, ζ), the scaled vector that the user sends.

    ``scale`` is the server's broadcast s_t = 1/(sqrt(ν̂_{t−1}) + ε_s) (ALGORITHMS §3.6); it must be
    positive and finite, with Δ's shape. The norm and the clip bit are those of s ⊙ Δ.
    """
    _check_vector(scale, "scale")
    if scale.shape != delta.shape:
        raise ValueError(f"scale has shape {tuple(scale.shape)}, update has {tuple(delta.shape)}")
    if not bool((scale > 0).all()):
        raise ValueError("scale must be positive in every coordinate")
    _check_vector(delta, "update")
    return clip_update(scale * delta, clip_norm)
