"""Banded matrix-factorization (BandMF) strategy matrices C.

The correlated-noise mechanism releases ``C x + z`` and post-processes it with the workload ``A``; the
noise the model sees is ``A C⁻¹ z`` (seed 000 §2.1, §4.5; Choquette-Choo et al. 2023, "Amplified banded
matrix factorization"; McKenna 2024, "Scaling up the banded matrix factorization mechanism").

Conventions (docs/explanation/mechanism.md, Noise):

* ``C`` is T×T lower-triangular with ``b`` bands: ``C[t, j] = 0`` when ``t − j ≥ b`` or ``j > t``;
* its diagonal is positive;
* it is **column-normalized**: every column has unit L2 norm, so one participation has sensitivity 1.

A strategy is stored in band form, ``band[t, r] = C[t, t − r]`` (shape T×b), never as a dense T×T matrix.
The loss of a strategy for a workload ``A`` is ``sens(C)² · (1/T)·‖A C⁻¹‖_F²`` with ``sens`` the largest
column norm. Workloads: the prefix-sum matrix (lower-triangular ones) and the SGD-with-momentum matrix
``A[t, j] = (1 − μ^{t−j+1})/(1 − μ)``.

The recommended strategy is banded Toeplitz (McKenna 2024): ``C̃[t, t − r] = c_r`` for ``r < b``, optimized
over ``c`` with L-BFGS on an O(T·b) objective (``toeplitz_loss``), cached on disk per (T, b, workload),
and column-normalized afterwards (``toeplitz_strategy``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fed_dp.atomic import write_json_atomically
from fed_dp.validation import check_int_range, check_momentum

__all__ = [
    "BandedStrategy",
    "identity_strategy",
    "banded_from_dense",
    "toeplitz_strategy",
    "prefix_sum_workload",
    "momentum_workload",
    "strategy_loss",
    "banded_error",
    "toeplitz_inverse_coefs",
    "toeplitz_loss",
    "sqrt_prefix_sum_coefs",
    "optimize_toeplitz",
    "default_cache_dir",
]

_DTYPE = torch.float64
_NORM_TOL = 1e-9
_CACHE_ENV = "FED_DP_CACHE_DIR"
_CACHE_FORMAT = "fed-dp/toeplitz-strategy"
_CACHE_VERSION = 1


# --------------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------------


def _check_rounds_bands(rounds: Any, bands: Any) -> tuple[int, int]:
    rounds = check_int_range("rounds", rounds, 1)
    bands = check_int_range("bands", bands, 1, rounds)
    return rounds, bands


def _as_float64_matrix(name: str, matrix: Any) -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty square 2-D matrix, got shape {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {matrix.dtype}")
    matrix = matrix.detach().to(device="cpu", dtype=_DTYPE)
    if not torch.isfinite(matrix).all():
        raise ValueError(f"{name} must contain only finite values")
    return matrix


def _check_lower_triangular(name: str, matrix: torch.Tensor) -> None:
    above = torch.triu(matrix, diagonal=1).nonzero()
    if len(above):
        t, j = (int(v) for v in above[0])
        raise ValueError(
            f"{name} must be lower-triangular, but {name}[{t}, {j}] = {matrix[t, j].item()!r} is above the diagonal"
        )


# --------------------------------------------------------------------------------------------------
# Band-form helpers
# --------------------------------------------------------------------------------------------------


def _band_column_sq_norms(band: torch.Tensor) -> torch.Tensor:
    """‖C[:, j]‖² for the band form: column j holds C[j + r, j] = band[j + r, r] for j + r < T."""
    rounds, bands = band.shape
    sq_norms = torch.zeros(rounds, dtype=band.dtype)
    for r in range(bands):
        sq_norms[: rounds - r] += band[r:, r] ** 2
    return sq_norms


def _normalize_band(band: torch.Tensor) -> torch.Tensor:
    """Column-normalize a band form: C·D⁻¹ with D = diag(column norms), i.e. band[t, r] /= ‖C[:, t − r]‖."""
    rounds, bands = band.shape
    norms = _band_column_sq_norms(band).sqrt()
    normalized = band.clone()
    for r in range(bands):
        normalized[r:, r] = band[r:, r] / norms[: rounds - r]
    return normalized


def _band_from_toeplitz(coefs: torch.Tensor, rounds: int) -> torch.Tensor:
    """band[t, r] = c_r for t ≥ r, zero where t − r < 0 (the un-normalized Toeplitz C̃)."""
    band = torch.zeros(rounds, len(coefs), dtype=_DTYPE)
    for r, c_r in enumerate(coefs.tolist()):
        band[r:, r] = c_r
    return band


# --------------------------------------------------------------------------------------------------
# The strategy object
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BandedStrategy:
    """A column-normalized, lower-triangular, b-banded strategy matrix C in band form.

    ``band[t, r] = C[t, t − r]`` (float64, shape T×b, zero where t − r < 0). C has a positive diagonal and
    unit-norm columns, so a single participation has sensitivity 1 and, under b-min-separation with at most
    k participations, sens² = k (docs/explanation/mechanism.md, Noise; seed 000 §2.1/§4.5; Choquette-Choo et al. 2023,
    "Amplified banded matrix factorization"; McKenna 2024, "Scaling up the banded matrix factorization
    mechanism"). Build one with ``identity_strategy``, ``banded_from_dense``, ``toeplitz_strategy`` or
    ``optimize_toeplitz``; the constructor only validates and keeps its own copy of ``band``.
    """

    band: torch.Tensor

    def __post_init__(self) -> None:
        band = self.band
        if not isinstance(band, torch.Tensor):
            raise ValueError(f"band must be a torch.Tensor, got {type(band).__name__}")
        if band.ndim != 2:
            raise ValueError(f"band must be 2-D with shape (rounds, bands), got shape {tuple(band.shape)}")
        if band.dtype != _DTYPE:
            raise ValueError(f"band must have dtype torch.float64, got {band.dtype}")
        rounds, bands = band.shape
        if bands < 1:
            raise ValueError(f"bands must satisfy 1 ≤ bands, got band with {bands} columns")
        if bands > rounds:
            raise ValueError(f"bands must satisfy bands ≤ rounds, got bands={bands} > rounds={rounds}")
        band = band.detach().to("cpu").clone()
        if not torch.isfinite(band).all():
            raise ValueError("band must contain only finite values")
        nonpositive = (band[:, 0] <= 0).nonzero()
        if len(nonpositive):
            t = int(nonpositive[0])
            raise ValueError(f"diagonal of C must be positive, but C[{t}, {t}] = band[{t}, 0] = {band[t, 0].item()!r}")
        for r in range(1, bands):
            outside = band[: min(r, rounds), r].nonzero()
            if len(outside):
                t = int(outside[0])
                raise ValueError(
                    f"band[{t}, {r}] = {band[t, r].item()!r} must be zero: it would be C[{t}, {t - r}], "
                    f"which lies outside the matrix (t − r < 0)"
                )
        norms = _band_column_sq_norms(band).sqrt()
        deviation = (norms - 1.0).abs()
        worst = int(deviation.argmax())
        if deviation[worst] > _NORM_TOL:
            raise ValueError(
                f"columns of C must have unit L2 norm (within {_NORM_TOL:g}), but column {worst} has norm "
                f"{norms[worst].item()!r}; use banded_from_dense or toeplitz_strategy to column-normalize"
            )
        object.__setattr__(self, "band", band)

    @property
    def rounds(self) -> int:
        """T, the number of rounds (rows of C)."""
        return int(self.band.shape[0])

    @property
    def bands(self) -> int:
        """b, the number of bands (C[t, j] = 0 when t − j ≥ b)."""
        return int(self.band.shape[1])

    def dense(self) -> torch.Tensor:
        """The dense T×T float64 matrix C with C[t, t − r] = band[t, r]. For tests and small T."""
        rounds, bands = self.band.shape
        matrix = torch.zeros(rounds, rounds, dtype=_DTYPE)
        rows = torch.arange(rounds)
        for r in range(bands):
            matrix[rows[r:], rows[r:] - r] = self.band[r:, r]
        return matrix

    @functools.cached_property
    def _inverse_row_sq_norms(self) -> torch.Tensor:
        scaled = self._scaled_toeplitz()
        if scaled is not None:
            coefs, scales = scaled
            h = _toeplitz_inverse_forward(coefs.numpy(), self.rounds)
            return torch.from_numpy(np.cumsum(h**2)) / scales.square()
        rounds, bands = self.band.shape
        lags = bands - 1
        # Ring buffer of the last b − 1 rows of C⁻¹: row y_s lives in slot s mod (b − 1).
        ring = torch.zeros(max(lags, 1), rounds, dtype=_DTYPE)
        lag_steps = torch.arange(1, bands)
        sq_norms = torch.empty(rounds, dtype=_DTYPE)
        for t in range(rounds):
            y = torch.zeros(rounds, dtype=_DTYPE)
            y[t] = 1.0
            if lags:
                weights = torch.zeros(lags, dtype=_DTYPE)
                weights[(t - lag_steps) % lags] = self.band[t, 1:]  # C[t, t − r] for y_{t − r}
                y -= weights @ ring
            y /= self.band[t, 0]
            if lags:
                ring[t % lags] = y
            sq_norms[t] = y @ y
        return sq_norms

    def _scaled_toeplitz(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(c̃, s) with C = C̃·diag(s), C̃ banded Toeplitz with coefficients c̃, if C has that form (to 1e-12
        relative), else None. ``toeplitz_strategy`` builds exactly this form (s = 1/D): c̃_r = C[r, 0] is column
        0 and s_j = C[j, j]/c̃_0, so C[t, t − r] must equal c̃_r·s_{t−r}."""
        rounds, bands = self.band.shape
        coefs = torch.stack([self.band[r, r] for r in range(bands)])
        scales = self.band[:, 0] / coefs[0]
        expected = torch.zeros_like(self.band)
        for r in range(bands):
            expected[r:, r] = coefs[r] * scales[: rounds - r]
        if torch.allclose(self.band, expected, rtol=1e-12, atol=0.0):
            return coefs, scales
        return None

    def inverse_row_sq_norms(self) -> torch.Tensor:
        """(T,) float64: ‖row t of C⁻¹‖², the noise-variance multiplier of round t.

        For a column-normalized banded Toeplitz C = C̃·diag(s) (what ``toeplitz_strategy`` and
        ``optimize_toeplitz`` build), C⁻¹ = diag(1/s)·C̃⁻¹ with C̃⁻¹ Toeplitz of coefficients h
        (``toeplitz_inverse_coefs``), so ‖row t‖² = Σ_{n≤t} h_n² / s_t²: O(T·b). Any other banded C: rows of
        Y = C⁻¹ follow the banded forward recurrence applied to the identity (docs/explanation/mechanism.md, Noise),
        y_t = (e_t − Σ_{r=1}^{b−1} C[t, t−r]·y_{t−r}) / C[t, t], vectorized over the T columns: O(T²·b) time,
        O(T·b) memory, no dense inverse. Cached after the first call; a fresh copy is returned.
        """
        return self._inverse_row_sq_norms.clone()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (python floats; round-trips float64 exactly through ``json``)."""
        return {"rounds": self.rounds, "bands": self.bands, "band": self.band.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BandedStrategy":
        """Inverse of ``to_dict``; validates the shape against the recorded rounds and bands."""
        if not isinstance(data, dict) or not {"rounds", "bands", "band"} <= data.keys():
            raise ValueError("strategy dict must have the keys 'rounds', 'bands' and 'band'")
        band = torch.tensor(data["band"], dtype=_DTYPE)
        if tuple(band.shape) != (data["rounds"], data["bands"]):
            raise ValueError(
                f"band has shape {tuple(band.shape)} but the dict says rounds={data['rounds']!r}, "
                f"bands={data['bands']!r}"
            )
        return cls(band)


# --------------------------------------------------------------------------------------------------
# Constructors
# --------------------------------------------------------------------------------------------------


def identity_strategy(rounds: int) -> BandedStrategy:
    """C = I (b = 1): independent noise, the trivial BandMF strategy (docs/explanation/mechanism.md, Noise; seed 000 §2.1)."""
    rounds = check_int_range("rounds", rounds, 1)
    return BandedStrategy(torch.ones(rounds, 1, dtype=_DTYPE))


def banded_from_dense(C: torch.Tensor, bands: int) -> BandedStrategy:
    """Band form of a dense lower-triangular b-banded C with positive diagonal, column-normalized.

    Returns C·D⁻¹ with D = diag(‖C[:, j]‖), whose columns have unit norm (sensitivity 1), as in seed 000
    §2.1/§4.5 and Choquette-Choo et al. 2023 ("Amplified banded matrix factorization"). Raises ValueError
    naming the first entry above the diagonal or outside the b bands (C[t, j] ≠ 0 with t − j ≥ b), or the
    first non-positive diagonal entry.
    """
    C = _as_float64_matrix("C", C)
    rounds = C.shape[0]
    bands = check_int_range("bands", bands, 1, rounds)
    _check_lower_triangular("C", C)
    outside = torch.tril(C, diagonal=-bands).nonzero()
    if len(outside):
        t, j = (int(v) for v in outside[0])
        raise ValueError(
            f"C must be zero outside its {bands} bands (C[t, j] = 0 when t − j ≥ {bands}), "
            f"but C[{t}, {j}] = {C[t, j].item()!r}"
        )
    diagonal = C.diagonal()
    nonpositive = (diagonal <= 0).nonzero()
    if len(nonpositive):
        t = int(nonpositive[0])
        raise ValueError(f"C must have a positive diagonal, but C[{t}, {t}] = {diagonal[t].item()!r}")
    band = torch.zeros(rounds, bands, dtype=_DTYPE)
    for r in range(bands):
        band[r:, r] = C.diagonal(-r)
    return BandedStrategy(_normalize_band(band))


def _check_coefs(coefs: Any, rounds: int) -> torch.Tensor:
    coefs = torch.as_tensor(coefs, dtype=_DTYPE).detach().to("cpu")
    if coefs.ndim != 1 or len(coefs) == 0:
        raise ValueError(f"coefs must be a non-empty 1-D sequence, got shape {tuple(coefs.shape)}")
    if len(coefs) > rounds:
        raise ValueError(f"bands = len(coefs) must satisfy 1 ≤ bands ≤ rounds = {rounds}, got {len(coefs)}")
    if not torch.isfinite(coefs).all():
        raise ValueError("coefs must contain only finite values")
    if coefs[0] <= 0:
        raise ValueError(f"coefs[0] (the diagonal of C) must be positive, got {coefs[0].item()!r}")
    return coefs


def toeplitz_strategy(coefs: Sequence[float] | torch.Tensor, rounds: int) -> BandedStrategy:
    """Column-normalized banded Toeplitz strategy from coefficients c_0 … c_{b−1} (McKenna 2024).

    C̃[t, t − r] = c_r for 0 ≤ r < b (b = len(coefs)), then C = C̃·D⁻¹ with D_j = ‖C̃[:, j]‖. The first
    T − b + 1 columns have norm ‖c‖; the last b − 1 columns are truncated by the bottom of the matrix, so
    their norms are smaller and normalization scales them up; (C̃D⁻¹)⁻¹ = D·C̃⁻¹. Seed 000 §2.1/§4.5;
    Choquette-Choo et al. 2023 ("Amplified banded matrix factorization"); McKenna 2024 ("Scaling up the
    banded matrix factorization mechanism").
    """
    rounds = check_int_range("rounds", rounds, 1)
    coefs = _check_coefs(coefs, rounds)
    return BandedStrategy(_normalize_band(_band_from_toeplitz(coefs, rounds)))


# --------------------------------------------------------------------------------------------------
# Workloads and the dense loss
# --------------------------------------------------------------------------------------------------


def prefix_sum_workload(rounds: int) -> torch.Tensor:
    """A[t, j] = 1 for j ≤ t, else 0 (T×T float64): the prefix-sum workload of DP-FTRL/BandMF (seed 000 §2.1)."""
    rounds = check_int_range("rounds", rounds, 1)
    return torch.tril(torch.ones(rounds, rounds, dtype=_DTYPE))


def momentum_workload(rounds: int, momentum: float) -> torch.Tensor:
    """A[t, j] = (1 − μ^{t−j+1})/(1 − μ) = Σ_{k=0}^{t−j} μ^k for j ≤ t, else 0 (T×T float64).

    The SGD-with-momentum workload (seed 000 §2.1; Choquette-Choo et al. 2023); μ = 0 is prefix-sum.
    """
    rounds = check_int_range("rounds", rounds, 1)
    momentum = check_momentum(momentum)
    idx = torch.arange(rounds, dtype=_DTYPE)
    lag = idx[:, None] - idx[None, :]
    values = (1.0 - momentum ** (lag.clamp(min=0) + 1.0)) / (1.0 - momentum)
    return torch.where(lag >= 0, values, torch.zeros((), dtype=_DTYPE))


def strategy_loss(C: torch.Tensor, A: torch.Tensor) -> float:
    """Dense exact loss sens(C)² · (1/T)·‖A C⁻¹‖_F², sens = max column norm of C.

    The mean squared error per round of the released prefix (workload) estimates per unit of noise
    (seed 000 §2.1/§4.5; Choquette-Choo et al. 2023; McKenna 2024). A C⁻¹ comes from a triangular solve
    (X C = A), never from an explicit inverse. C must be lower-triangular and invertible.
    """
    C = _as_float64_matrix("C", C)
    A = _as_float64_matrix("A", A)
    if A.shape != C.shape:
        raise ValueError(f"A and C must have the same shape, got A {tuple(A.shape)} and C {tuple(C.shape)}")
    _check_lower_triangular("C", C)
    if (C.diagonal() == 0).any():
        raise ValueError("C must be invertible (a zero diagonal entry was found)")
    sens = torch.linalg.vector_norm(C, dim=0).max()
    A_C_inv = torch.linalg.solve_triangular(C, A, upper=False, left=False)
    return float(sens**2 * A_C_inv.square().sum() / C.shape[0])


def banded_error(strategy: BandedStrategy, *, separation: int, momentum: float = 0.0) -> float:
    """sens² · (1/T)·‖A C⁻¹‖_F² with every participation min-separation m allows: sens² = ⌈T/m⌉.

    Columns of a b-banded, column-normalized C that are m ≥ b apart have disjoint supports and unit norms
    (docs/explanation/mechanism.md, Noise), so ⌈T/m⌉ participations have sens² = ⌈T/m⌉; a separation below b is refused. The same
    figure as ``fed_dp.blt.blt_error`` for a BLT, so the two compare at equal ε. Dense (``strategy_loss``):
    for T up to a few thousand.
    """
    separation = check_int_range("separation", separation, 1)
    if separation < strategy.bands:
        raise ValueError(f"separation (the min-separation m = {separation}) must be >= bands (b = {strategy.bands}): "
                         "BandMF's sensitivity √⌈T/m⌉ needs participations at least b rounds apart")
    workload = momentum_workload(strategy.rounds, check_momentum(momentum))
    return math.ceil(strategy.rounds / separation) * strategy_loss(strategy.dense(), workload)


# --------------------------------------------------------------------------------------------------
# Toeplitz loss in O(T·b)
# --------------------------------------------------------------------------------------------------


def _toeplitz_inverse_forward(coefs: np.ndarray, rounds: int) -> np.ndarray:
    """h with C̃h = e_0: h_0 = 1/c_0, h_n = −(Σ_{r=1}^{min(n,b−1)} c_r h_{n−r}) / c_0."""
    lags = len(coefs) - 1
    reversed_tail = coefs[1:][::-1].copy()  # c_{b−1}, …, c_1
    padded = np.zeros(rounds + lags)  # padded[lags + n] = h_n; zeros stand for h_{<0}
    for n in range(rounds):
        acc = 1.0 if n == 0 else 0.0
        if lags:
            acc -= reversed_tail @ padded[n : n + lags]
        padded[lags + n] = acc / coefs[0]
    return padded[lags:]


def _toeplitz_transpose_solve(coefs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """λ with C̃ᵀλ = g: c_0 λ_n + Σ_{r=1}^{b−1} c_r λ_{n+r} = g_n, solved for n = T−1 down to 0."""
    rounds, lags = len(rhs), len(coefs) - 1
    tail = coefs[1:]
    padded = np.zeros(rounds + lags)  # padded[n] = λ_n; zeros stand for λ_{≥T}
    for n in range(rounds - 1, -1, -1):
        acc = rhs[n]
        if lags:
            acc -= tail @ padded[n + 1 : n + 1 + lags]
        padded[n] = acc / coefs[0]
    return padded[:rounds]


class _ToeplitzInverse(torch.autograd.Function):
    """h = coefficients of C̃⁻¹ (lower-triangular Toeplitz) as a differentiable function of c.

    Forward: the O(T·b) recurrence of ``_toeplitz_inverse_forward``. Backward (adjoint of C̃h = e_0): with
    g = ∂L/∂h, solve C̃ᵀλ = g, then ∂L/∂c_r = −Σ_n λ_n h_{n−r}.
    """

    @staticmethod
    def forward(ctx: Any, coefs: torch.Tensor, rounds: int) -> torch.Tensor:
        h = _toeplitz_inverse_forward(coefs.detach().cpu().numpy(), rounds)
        h_tensor = torch.from_numpy(h).to(dtype=_DTYPE, device=coefs.device)
        ctx.save_for_backward(coefs, h_tensor)
        return h_tensor

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor, None]:
        coefs, h_tensor = ctx.saved_tensors
        c = coefs.detach().cpu().numpy()
        h = h_tensor.detach().cpu().numpy()
        lam = _toeplitz_transpose_solve(c, grad_h.detach().cpu().numpy())
        rounds = len(h)
        grad_c = np.array([-(lam[r:] @ h[: rounds - r]) for r in range(len(c))])
        return torch.from_numpy(grad_c).to(dtype=_DTYPE, device=coefs.device), None


def toeplitz_inverse_coefs(coefs: torch.Tensor, rounds: int) -> torch.Tensor:
    """Coefficients h of C̃⁻¹ for the lower-triangular banded Toeplitz C̃ with C̃[t, t−r] = c_r (r < b).

    C̃⁻¹ is lower-triangular Toeplitz, C̃⁻¹[t, j] = h_{t−j}, with h_0 = 1/c_0 and
    h_n = −(Σ_{r=1}^{min(n,b−1)} c_r h_{n−r}) / c_0 (McKenna 2024, "Scaling up the banded matrix
    factorization mechanism"). O(T·b); differentiable in ``coefs`` through a custom autograd Function whose
    backward solves the adjoint system C̃ᵀλ = ∂L/∂h and returns ∂L/∂c_r = −Σ_n λ_n h_{n−r}.
    ``coefs`` must be a 1-D float64 tensor with coefs[0] ≠ 0 and len(coefs) ≤ rounds.
    """
    rounds = check_int_range("rounds", rounds, 1)
    if not isinstance(coefs, torch.Tensor) or coefs.dtype != _DTYPE or coefs.ndim != 1 or len(coefs) == 0:
        raise ValueError("coefs must be a non-empty 1-D torch.float64 tensor")
    if len(coefs) > rounds:
        raise ValueError(f"bands = len(coefs) must satisfy 1 ≤ bands ≤ rounds = {rounds}, got {len(coefs)}")
    if coefs[0].item() == 0.0:
        raise ValueError("coefs[0] (the diagonal of C) must be non-zero")
    return _ToeplitzInverse.apply(coefs, rounds)


def toeplitz_loss(coefs: torch.Tensor, rounds: int, momentum: float = 0.0) -> torch.Tensor:
    """Differentiable O(T·b) loss of the banded Toeplitz strategy: ‖c‖² · (1/T)·‖A C̃⁻¹‖_F².

    C̃[t, t−r] = c_r (r < b) is *not* column-normalized here: the value is the exact loss
    sens² · (1/T)·‖A C⁻¹‖_F² of C = C̃/‖c‖, whose largest column norm is 1 (McKenna 2024, "Scaling up the
    banded matrix factorization mechanism"; seed 000 §2.1/§4.5; Choquette-Choo et al. 2023). It is invariant
    to the scale and sign of c. ``toeplitz_strategy`` then column-normalizes (C = C̃·D⁻¹), which rescales
    only the last b − 1 rows of C⁻¹ by D_j/‖c‖ ≤ 1 (and so changes only the error of the last b − 1 rounds).
    For optimized and sqrt-prefix-sum coefficients this lowers the loss (checked in the tests); it is not
    a theorem for arbitrary c: cancellations between rows of C⁻¹ can make it rise slightly for random c.

    Computation: C̃⁻¹ is lower-triangular Toeplitz with coefficients h (``toeplitz_inverse_coefs``).
    Lower-triangular Toeplitz matrices commute, and the momentum workload factors as A = S·G with S the
    prefix-sum matrix and G[t, j] = μ^{t−j}, whose inverse is bidiagonal (1 on the diagonal, −μ below).
    Hence A C̃⁻¹ = S·(C̃G⁻¹)⁻¹, where C̃G⁻¹ is banded Toeplitz with coefficients c' = c * (1, −μ)
    (b + 1 bands; c' = c for μ = 0). With h' the inverse coefficients of c', A C̃⁻¹ is lower-triangular
    Toeplitz with coefficients p = cumsum(h'), and ‖A C̃⁻¹‖_F² = Σ_n (T − n)·p_n². Everything is O(T·b).
    """
    rounds = check_int_range("rounds", rounds, 1)
    momentum = check_momentum(momentum)
    if not isinstance(coefs, torch.Tensor) or coefs.dtype != _DTYPE or coefs.ndim != 1 or len(coefs) == 0:
        raise ValueError("coefs must be a non-empty 1-D torch.float64 tensor")
    if len(coefs) > rounds:
        raise ValueError(f"bands = len(coefs) must satisfy 1 ≤ bands ≤ rounds = {rounds}, got {len(coefs)}")
    if momentum == 0.0:
        filtered = coefs
    else:
        zero = coefs.new_zeros(1)
        filtered = (torch.cat([coefs, zero]) - momentum * torch.cat([zero, coefs]))[:rounds]
    h = toeplitz_inverse_coefs(filtered, rounds)
    p = torch.cumsum(h, dim=0)
    weights = torch.arange(rounds, 0, -1, dtype=_DTYPE, device=coefs.device)  # T − n
    return coefs.square().sum() * (weights * p.square()).sum() / rounds


# --------------------------------------------------------------------------------------------------
# Optimization and the on-disk cache
# --------------------------------------------------------------------------------------------------


def sqrt_prefix_sum_coefs(bands: int) -> torch.Tensor:
    """c_r = binom(2r, r)/4^r for r < b: the Toeplitz coefficients of the square root of the prefix-sum
    matrix (the Taylor coefficients of (1 − z)^{−1/2}), truncated to b bands. The starting point of
    ``optimize_toeplitz`` (McKenna 2024; Choquette-Choo et al. 2023)."""
    bands = check_int_range("bands", bands, 1)
    coefs = [1.0]
    for r in range(1, bands):
        coefs.append(coefs[-1] * (2 * r - 1) / (2 * r))
    return torch.tensor(coefs, dtype=_DTYPE)


def default_cache_dir() -> Path:
    """The strategy cache folder: $FED_DP_CACHE_DIR if set, else ~/.cache/fed-dp/strategies."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fed-dp" / "strategies"


def _workload_key(momentum: float) -> str:
    return "prefix-sum" if momentum == 0.0 else f"momentum{momentum!r}"


def _cache_path(cache_dir: str | os.PathLike | None, rounds: int, bands: int, momentum: float) -> Path:
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return folder / f"toeplitz-T{rounds}-b{bands}-{_workload_key(momentum)}.json"


def lbfgs_minimize(objective: Any, start: torch.Tensor, *, max_iter: int, tolerance_grad: float,
                   tolerance_change: float) -> torch.Tensor:
    """The point L-BFGS (strong Wolfe line search, history 20, float64) reaches from ``start`` on the
    differentiable scalar ``objective``; used for the BandMF and the BLT strategies alike."""
    free = start.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [free],
        lr=1.0,
        max_iter=max_iter,
        max_eval=2 * max_iter,
        tolerance_grad=tolerance_grad,
        tolerance_change=tolerance_change,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = objective(free)
        value.backward()
        return value

    optimizer.step(closure)
    return free.detach()


def _minimize_toeplitz_loss(rounds: int, bands: int, momentum: float, max_iter: int) -> tuple[torch.Tensor, float]:
    """L-BFGS (strong Wolfe) on toeplitz_loss from the sqrt-prefix-sum coefficients.

    The loss is invariant to the scale of c, so c_0 is fixed to 1 and only c_1 … c_{b−1} are free; this
    removes the flat direction and keeps the diagonal positive. Returns (c / ‖c‖, loss).
    """
    initial = sqrt_prefix_sum_coefs(bands)
    one = torch.ones(1, dtype=_DTYPE)

    def loss_of(tail: torch.Tensor) -> torch.Tensor:
        return toeplitz_loss(torch.cat([one, tail]), rounds, momentum)

    free = lbfgs_minimize(loss_of, initial[1:], max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-13)
    with torch.no_grad():
        best = torch.cat([one, free])
        best_loss = float(loss_of(free))
        initial_loss = float(toeplitz_loss(initial, rounds, momentum))
    if not math.isfinite(best_loss) or best_loss > initial_loss:
        best, best_loss = initial, initial_loss
    return best / torch.linalg.vector_norm(best), best_loss


def _cache_header(rounds: int, bands: int, momentum: float) -> dict[str, Any]:
    """The fields that identify a cached strategy: format, version and the (T, b, workload) key."""
    return {
        "format": _CACHE_FORMAT,
        "version": _CACHE_VERSION,
        "rounds": rounds,
        "bands": bands,
        "workload": "prefix-sum" if momentum == 0.0 else "momentum",
        "momentum": momentum,
    }


def _read_cached(path: Path, rounds: int, bands: int, momentum: float) -> BandedStrategy:
    try:
        payload = json.loads(path.read_text())
        for key, value in _cache_header(rounds, bands, momentum).items():
            if payload.get(key) != value:
                raise ValueError(f"field {key!r} is {payload.get(key)!r}, expected {value!r}")
        coefs = payload["coefs"]
        if not isinstance(coefs, list) or len(coefs) != bands:
            raise ValueError(f"'coefs' must be a list of {bands} numbers")
        return toeplitz_strategy(coefs, rounds)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"cached strategy file {path} is invalid ({error}); delete it to re-optimize"
        ) from error


def optimize_toeplitz(
    rounds: int,
    bands: int,
    *,
    momentum: float = 0.0,
    cache_dir: str | os.PathLike | None = None,
    max_iter: int = 500,
) -> BandedStrategy:
    """Optimized, column-normalized banded Toeplitz strategy for T rounds and b bands (McKenna 2024).

    Minimizes ``toeplitz_loss`` = ‖c‖²·(1/T)·‖A C̃⁻¹‖_F² over c_0 … c_{b−1} (workload A: prefix-sum for
    μ = 0, else SGD with momentum μ) with L-BFGS (strong Wolfe line search, float64), starting from the
    sqrt-prefix-sum coefficients c_r = binom(2r, r)/4^r, then column-normalizes with ``toeplitz_strategy``
    (seed 000 §2.1/§4.5; Choquette-Choo et al. 2023, "Amplified banded matrix factorization"; McKenna 2024,
    "Scaling up the banded matrix factorization mechanism"). ``bands=1`` returns the identity.
    The objective is the loss of C̃/‖c‖, not of the column-normalized C; the two differ only in the last
    b − 1 rounds, so when b is a sizeable fraction of T (b ≳ T/3) the normalized result can be marginally
    (≲1%) worse than the normalized starting point.

    Results are cached as JSON keyed by (T, b, workload), file ``toeplitz-T{T}-b{b}-prefix-sum.json`` or
    ``toeplitz-T{T}-b{b}-momentum{μ}.json`` in ``cache_dir``, else $FED_DP_CACHE_DIR, else
    ~/.cache/fed-dp/strategies; written atomically. A cached file that fails validation raises ValueError
    naming the file (it is never silently recomputed).
    """
    rounds, bands = _check_rounds_bands(rounds, bands)
    momentum = check_momentum(momentum)
    max_iter = check_int_range("max_iter", max_iter, 1)
    if bands == 1:
        return identity_strategy(rounds)
    path = _cache_path(cache_dir, rounds, bands, momentum)
    if path.exists():
        return _read_cached(path, rounds, bands, momentum)
    coefs, loss = _minimize_toeplitz_loss(rounds, bands, momentum, max_iter)
    strategy = toeplitz_strategy(coefs, rounds)
    write_json_atomically(
        path, {**_cache_header(rounds, bands, momentum), "coefs": coefs.tolist(), "loss": loss}
    )
    return strategy
