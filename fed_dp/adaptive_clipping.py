"""Adaptive clipping to a target quantile of user-update norms (Andrew et al. 2021;
docs/explanation/mechanism.md, Adaptive clipping).

Each sampled user also reports the bit 1[‖Δ_i‖ ≤ ζ_t], computed by the clip from ``fed_dp.clipping.l2_norm``
(an upper bound within 2.2·10⁻¹¹ of ‖Δ_i‖; float32 reductions would under-estimate large norms and count
clipped users as unclipped). The server releases the centered bit sum
Σ(b_i − ½) + N(0, σ_b²) (sensitivity ½ under add/remove of one user, so its noise multiplier is 2σ_b),
forms b̃_t = (Σ(b_i − ½) + noise)/B + ½ and moves the clip norm geometrically:

    ζ_{t+1} = ζ_t · exp(−η_ζ · (b̃_t − γ))

To keep the privacy cost of the pair (update, bits) equal to ONE Gaussian with multiplier σ, the update
is noised with the larger multiplier

    σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)

(Gaussian compositions add in inverse variance: σ_Δ⁻² + (2σ_b)⁻² = σ⁻²). The accounting is unchanged.
Under replace-one adjacency (sampling without replacement) both sensitivities double, so the same split
holds relative to that adjacency.
Independent noise only: BandMF and BLT need the same noise scale every round, so they are rejected.

σ_b left unset defaults to max(B/20, 2.5σ) (:func:`default_bit_noise_std`): Andrew et al.'s B/20 where it is large
enough, and otherwise 2.5σ, with which the update's noise grows by 2% (σ_Δ = σ/sqrt(1 − (σ/2σ_b)²) = 1.02σ); B/20
alone is refused whenever σ > B/10 (a target ε of 3 with 80 users gives σ = 2.65 > 8/10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fed_dp.config import PrivacyConfig
from fed_dp.validation import check_int

# torch and the noise sources (fed_dp.randomness) are imported by the clipper that uses them: the run configuration
# reads AdaptiveClipConfig's defaults without loading torch, so that a mistyped key is reported at once.


#: σ_b's default is at least this many σ (:func:`default_bit_noise_std`).
BIT_NOISE_PER_SIGMA = 2.5


def default_bit_noise_std(noise_multiplier: float, expected_cohort: int) -> float:
    """max(B/20, 2.5σ): Andrew et al.'s σ_b ≈ B/20 where it is large enough for the split, else 2.5σ, which leaves the
    update's noise multiplier at σ_Δ = σ/sqrt(1 − 0.2²) ≈ 1.02σ."""
    return max(expected_cohort / 20, BIT_NOISE_PER_SIGMA * noise_multiplier)


@dataclass(frozen=True, kw_only=True)
class AdaptiveClipConfig:
    """target_quantile γ ∈ (0, 1); learning_rate η_ζ > 0; bit_noise_std σ_b > 0 (noise std on the
    centered bit sum), or None for :func:`default_bit_noise_std` once σ is known (:meth:`for_privacy`);
    initial_clip_norm ζ_0 > 0."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    bit_noise_std: float | None = None
    initial_clip_norm: float

    def __post_init__(self) -> None:
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")
        for name in ("learning_rate", "bit_noise_std", "initial_clip_norm"):
            value = getattr(self, name)
            if name == "bit_noise_std" and value is None:
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def for_privacy(self, privacy: PrivacyConfig) -> "AdaptiveClipConfig":
        """This config with σ_b decided: as given, or :func:`default_bit_noise_std` of the (resolved) σ and B."""
        if self.bit_noise_std is not None:
            return self
        privacy.require_resolved("adaptive clipping's default bit_noise_std")
        return replace(self, bit_noise_std=default_bit_noise_std(privacy.noise_multiplier, privacy.expected_cohort))


def update_noise_multiplier(noise_multiplier: float, bit_noise_std: float) -> float:
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2); requires 2σ_b > σ (else the bits alone would exceed the budget)."""
    if not 2 * bit_noise_std > noise_multiplier:
        raise ValueError(
            f"adaptive.bit-noise-std (Python: bit_noise_std) σ_b = {bit_noise_std:g} is too small for the noise "
            f"multiplier σ = {noise_multiplier:.4g}: the clip-bit query alone (multiplier 2σ_b = {2 * bit_noise_std:g}) "
            f"would cost more than the whole budget. Set it to {BIT_NOISE_PER_SIGMA * noise_multiplier:.3g} (2.5σ: the "
            "update's noise then grows by 2%) or more, or leave it unset for max(B/20, 2.5σ)"
        )
    return (noise_multiplier**-2 - (2 * bit_noise_std) ** -2) ** -0.5


def check_compatible(privacy: PrivacyConfig, adaptive: AdaptiveClipConfig) -> float:
    """Validate the pair and return σ_Δ (with σ_b as given, or its default: :meth:`AdaptiveClipConfig.for_privacy`).
    BandMF and BLT are refused (their noise scale must not change), and so is the non-private baseline
    (noise_multiplier = 0: there is no noise to split with the clip bits)."""
    if privacy.noise_multiplier == 0:
        raise ValueError("adaptive clipping needs noise_multiplier > 0 (it splits the noise between the update and "
                         "the clip bits); the non-private baseline (noise_multiplier = 0) takes a fixed clip_norm")
    if privacy.noise != "independent":
        raise ValueError(
            f"adaptive clipping changes the noise scale every round, which breaks BandMF's correlated "
            f"noise (and BLT's; noise is {privacy.noise!r}); use noise 'independent' or a fixed clip_norm"
        )
    return update_noise_multiplier(privacy.noise_multiplier, adaptive.for_privacy(privacy).bit_noise_std)


def next_clip_norm(clip_norm: float, unclipped_fraction: float, config: AdaptiveClipConfig) -> float:
    """ζ_{t+1} = ζ_t·exp(−η_ζ(b̃_t − γ))."""
    return clip_norm * math.exp(-config.learning_rate * (unclipped_fraction - config.target_quantile))


class AdaptiveClipper:
    """Explicit state of adaptive clipping: the current ζ_t (public: it is broadcast) and the noise source of
    the bit noise (secret, like the update noise's; ``source`` as for ``fed_dp.noise.Privatizer``)."""

    def __init__(self, config: AdaptiveClipConfig, expected_cohort: int, seed: int | None = None,
                 source: str = "torch") -> None:
        expected_cohort = check_int("expected_cohort", expected_cohort, minimum=1)
        if config.bit_noise_std is None:
            raise ValueError("the clipper needs σ_b decided: build it from config.for_privacy(privacy)")
        self.config = config
        self.expected_cohort = expected_cohort
        self.clip_norm = float(config.initial_clip_norm)
        from fed_dp.randomness import make_noise_source

        self._source = make_noise_source(source, seed)

    @property
    def seed(self) -> int | None:
        """The seed of a ``"torch"`` noise source (None for the secure source)."""
        return getattr(self._source, "seed", None)

    def noisy_centered_sum(self, bit_sum: int, count: int) -> float:
        """Σ(b_i − ½) + N(0, σ_b²), formed exactly on the grid Λ_b = 2^(⌊log₂ σ_b⌋ − 36) (``fed_dp.randomness.
        add_on_grid``): the centered sum is a multiple of ½, hence of Λ_b, and the noise is the float64 draw rounded to
        Λ_b, so the result is that sum plus a grid integer that does not depend on it. A float32 draw times σ_b added
        in float64 would leave the true count readable from the result (a neighbour's count minus the result is then
        not σ_b times any float32)."""
        if not 0 <= bit_sum <= count:
            raise ValueError(f"bit_sum must be in [0, count = {count}], got {bit_sum}")
        import torch

        from fed_dp.randomness import add_on_grid, grid_step

        std = self.config.bit_noise_std
        centered = torch.tensor([bit_sum - count / 2], dtype=torch.float64)
        return float(add_on_grid(centered, std * self._source.normal(1, torch.float64), grid_step(std))[0])

    def noisy_unclipped_fraction(self, bit_sum: int, count: int) -> float:
        """b̃_t = (Σ(b_i − ½) + N(0, σ_b²))/B + ½ from the bit sum and the number of replies (post-processing of
        :meth:`noisy_centered_sum`)."""
        return self.noisy_centered_sum(bit_sum, count) / self.expected_cohort + 0.5

    def step(self, bit_sum: int, count: int) -> float:
        """Release this round's noisy fraction and move ζ; returns the new clip norm ζ_{t+1}."""
        fraction = self.noisy_unclipped_fraction(bit_sum, count)
        self.clip_norm = next_clip_norm(self.clip_norm, fraction, self.config)
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "source": self._source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self._source.load_state_dict(state["source"])
