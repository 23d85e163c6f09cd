"""Buffered-linear-Toeplitz (BLT) strategies: correlated noise from ℓ buffers instead of b − 1 (docs/explanation/mechanism.md, Noise).

References: Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, "Efficient and near-optimal noise
generation for streaming differential privacy"; McMahan et al. 2024, "A hassle-free algorithm for private
learning in practice: don't use tree aggregation, use BLTs". The derivations below are this module's own.

**The matrix.** A BLT(θ, ω) with ℓ buffers is the T×T lower-triangular Toeplitz matrix C̃ with

    c_0 = 1,    c_t = Σ_{j<ℓ} θ_j ω_j^{t−1}  (t ≥ 1),

whose generating function is rational: C̃(x) = Σ_t c_t x^t = 1 + Σ_j θ_j x/(1 − ω_j x) = N(x)/D(x) with
D(x) = Π_j (1 − ω_j x) and N(x) = D(x) + x·Σ_j θ_j Π_{i≠j} (1 − ω_i x), both of degree ℓ with constant term 1.
C̃⁻¹ is lower-triangular Toeplitz with the coefficients h of D(x)/N(x).

**Parameters** (checked by :class:`BLTStrategy`): θ_j real and finite, of either sign, and 0 < ω_j < 1. The
first version of this module required θ_j > 0 and Σθ_j ≤ 1, which make c positive and nonincreasing (c_1 =
Σθ ≤ 1 = c_0, each geometric term decreasing) and C̃(x) free of zeros in the open unit disk
((1 − x)C̃(x) = 1 − Σ_{t≥1} (c_{t−1} − c_t) x^t, nonnegative differences summing to at most 1: Eneström–Kakeya).
Under min-separation that class does no better than two distinct ω (measured at T = 2,000, m = 64: every
start of a multi-start search ends at the same two-exponential optimum, 1.111× BandMF-64's error, for 2 to 5
buffers): a positive sum of decaying exponentials is convex in t and cannot hold c up for about m lags and
then drop. Opposite signs can (a shoulder), so the sign is free now, and the sensitivity below is proven for
every c. With mixed signs nothing makes C̃⁻¹ stable by construction; privacy does not depend on it, and a
growing h would show in the error over the T rounds, which the optimizer minimizes.

**Normalization.** Column j of C̃ is (c_0, …, c_{T−1−j}) from row j down: a truncation of column 0, whose
norm n_0 = ‖(c_0, …, c_{T−1})‖₂ is therefore the largest. The mechanism uses C = C̃/n_0 (still Toeplitz): one
participation has sensitivity 1, as BandMF's column-normalized C, and the noise is C⁻¹Z = n_0·C̃⁻¹Z.
(Normalizing every column, as BandMF does, would break the Toeplitz structure that the streaming and the
sensitivity bound use.) Several participations enter only through the accounting event.

**Streaming with ℓ buffers.** y = C̃⁻¹z solves C̃y = z: y_t = z_t − Σ_{s<t} c_{t−s} y_s = z_t − Σ_j θ_j S_j(t)
with S_j(t) = Σ_{s<t} ω_j^{t−1−s} y_s, i.e. S_j(0) = 0 and S_j(t + 1) = ω_j S_j(t) + y_t (``fed_dp.noise``).

**Sensitivity under min-separation m.** A user's participations P lie at least m rounds apart (cyclic
Poisson: m = b groups; min-sep: m = N // B), so at most ⌈t/m⌉ of them fall in the first t rounds. The release
after t rounds is (C x + noise) restricted to rows < t; the user's clipped contributions u_i (‖u_i‖ ≤ 1 in
units of ζ) move it by Σ_{i∈P} C_{<t,i} u_iᵀ, of squared Frobenius norm Σ_{i,j∈P} X_ij ⟨u_i, u_j⟩ with
X = C_{<t}ᵀ C_{<t}. Let ĉ_r = max_{r≤s<T} |c_s| be the nonnegative nonincreasing envelope of c (the
projection jax_privacy's Toeplitz min-sep sensitivity applies, citing arXiv:2405.13763, Thm. 2; ĉ = c when c
is itself nonnegative and nonincreasing, as in the θ > 0, Σθ ≤ 1 class) and X̂ the same product for ĉ.
Then |X_ij| ≤ Σ_r |c_r||c_{r+p_j−p_i}| ≤ X̂_ij, so

    ‖Σ_{i∈P} C_{<t,i} u_iᵀ‖_F² ≤ Σ_{i,j∈P} |X_ij| ≤ Σ_{i,j∈P} X̂_ij = ‖Σ_{i∈P} Ĉ_{<t,i}‖² ,

with equality for equal u_i when c = ĉ. For nonnegative nonincreasing ĉ the largest pattern is the earliest
one, P* = {0, m, 2m, …} with all ⌈t/m⌉ participations: for any valid P = {p_1 < … < p_n}, p*_i = (i − 1)m ≤ p_i
and p*_j − p*_i ≤ p_j − p_i, and for i < j

    X̂_{p_i p_j} = Σ_{r=0}^{t−1−p_j} ĉ_r ĉ_{r+p_j−p_i}  ≤  Σ_{r=0}^{t−1−p*_j} ĉ_r ĉ_{r+p*_j−p*_i} = X̂_{p*_i p*_j}

(at least as many nonnegative terms, none smaller since ĉ is nonincreasing), while more participations only
add nonnegative terms. Hence, with V_s = Σ_{i≥0, im≤s} ĉ_{s−im} (V_s = ĉ_s + V_{s−m}), the column sum of P*,

    sens_t(C̃)² = Σ_{s<t} V_s² ,    sens_t(C)² = sens_t(C̃)² / n_0² ,

an upper bound for every c and the exact maximum when c = ĉ (then X ≥ 0 and equal u_i attain it). The
accounting event after t rounds is Gaussian(σ / sens_t(C)) (``fed_dp.sampling``), for cyclic Poisson too:
amplification by sampling (Choquette-Choo et al. 2023, Thm. 4) needs a b-banded C, whose epochs have
disjoint columns, and a BLT is not banded, so no amplification is claimed. A BLT's columns m apart always
overlap, so sens² can exceed ⌈t/m⌉ (BandMF's value). ``tests/fed_dp/test_blt.py`` checks the formula against
a brute-force maximum over every pattern, and over vector contributions, on small cases: equal for c = ĉ, an
upper bound for mixed signs and non-monotone c.

**Error** (the objective, as for BandMF; McMahan et al. 2024 optimize a BLT's parameters for this
multi-participation loss directly): sens_T(C̃)² · (1/T)·‖A C̃⁻¹‖_F², invariant to the scale of C̃, with the
workload A(x) = 1/((1 − x)(1 − μx)) (prefix sum: μ = 0). A C̃⁻¹ is lower-triangular Toeplitz with the
coefficients p of A(x)·D(x)/N(x), the impulse response of a rational filter of order ℓ + 2, and
‖A C̃⁻¹‖_F² = Σ_n (T − n)·p_n²: the whole objective costs O(T·ℓ); its gradient comes from the adjoint filter.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from scipy import signal

from fed_dp.atomic import write_json_atomically
from fed_dp.factorization import default_cache_dir, lbfgs_minimize
from fed_dp.validation import check_int_range, check_momentum

if TYPE_CHECKING:
    from fed_dp.config import PrivacyConfig

__all__ = [
    "BLTStrategy",
    "blt_coefs",
    "blt_loss",
    "config_sensitivity_squared",
    "config_strategy",
    "initial_blt",
    "optimize_blt",
    "blt_error",
]

_DTYPE = torch.float64
_CACHE_FORMAT = "fed-dp/blt-strategy"
_CACHE_VERSION = 2  # 2: θ of either sign, envelope sensitivity (version 1 files are never read: other names)
_THETA_BOUND = 2.0  # |θ_j| ≤ 2 in the optimizer (module docstring of optimize_blt)


# --------------------------------------------------------------------------------------------------
# The strategy object
# --------------------------------------------------------------------------------------------------


def _check_parameters(theta: Sequence[float], omega: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    theta = tuple(float(v) for v in theta)
    omega = tuple(float(v) for v in omega)
    if not theta or len(theta) != len(omega):
        raise ValueError(f"theta and omega must be non-empty and of equal length (the buffers), got "
                         f"{len(theta)} and {len(omega)}")
    for j, value in enumerate(theta):
        if not math.isfinite(value):
            raise ValueError(f"theta[{j}] must be a finite number, got {value!r}")
    for j, value in enumerate(omega):
        if not (0 < value < 1):
            raise ValueError(f"omega[{j}] must satisfy 0 < omega < 1, got {value!r}")
    return theta, omega


def blt_coefs(theta: Sequence[float], omega: Sequence[float], rounds: int) -> np.ndarray:
    """c_0 … c_{T−1} of the un-normalized BLT: c_0 = 1, c_t = Σ_j θ_j ω_j^{t−1} (float64, O(T·ℓ))."""
    rounds = check_int_range("rounds", rounds, 1)
    theta, omega = np.asarray(theta, dtype=np.float64), np.asarray(omega, dtype=np.float64)
    coefs = np.ones(rounds)
    coefs[1:] = theta @ np.power(omega[:, None], np.arange(rounds - 1)[None, :])
    return coefs


def _denominator_numerator(theta: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """D(x) = Π_j (1 − ω_j x) and N(x) = D(x) + x·Σ_j θ_j Π_{i≠j}(1 − ω_i x), coefficients in increasing powers."""
    one = theta.new_ones(1)
    factors = [torch.cat([one, -w.reshape(1)]) for w in omega]
    denominator = functools.reduce(_poly_mul, factors, one)
    numerator = torch.cat([denominator, theta.new_zeros(1)])
    for j, t in enumerate(theta):
        others = functools.reduce(_poly_mul, factors[:j] + factors[j + 1:], one)
        numerator = numerator + t * torch.cat([theta.new_zeros(1), others, theta.new_zeros(len(numerator) - len(others) - 1)])
    return denominator, numerator[: len(denominator)]


def _poly_mul(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Coefficients of p(x)·q(x) (increasing powers); differentiable, for the small degrees of BLTs."""
    out = p.new_zeros(len(p) + len(q) - 1)
    for i in range(len(q)):
        out = out + torch.cat([p.new_zeros(i), p * q[i], p.new_zeros(len(q) - 1 - i)])
    return out


class _ImpulseResponse(torch.autograd.Function):
    """p = first T coefficients of b(x)/a(x) (a_0 ≠ 0), i.e. scipy.signal.lfilter(b, a, e_0).

    Backward (adjoint of a ∗ p = b): with g = ∂L/∂p, λ = a⁻ᵀg is the time-reversed filter 1/a applied to
    reversed g; then ∂L/∂b_i = λ_i and ∂L/∂a_i = −Σ_n λ_n p_{n−i}. O(T·deg).
    """

    @staticmethod
    def forward(ctx: Any, b: torch.Tensor, a: torch.Tensor, rounds: int) -> torch.Tensor:
        impulse = np.zeros(rounds)
        impulse[0] = 1.0
        p = signal.lfilter(b.detach().cpu().numpy(), a.detach().cpu().numpy(), impulse)
        out = torch.from_numpy(p).to(dtype=_DTYPE, device=b.device)
        ctx.save_for_backward(b, a, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        b, a, p = ctx.saved_tensors
        a_np, p_np = a.detach().cpu().numpy(), p.detach().cpu().numpy()
        lam = signal.lfilter([1.0], a_np, grad.detach().cpu().numpy()[::-1])[::-1]
        rounds = len(p_np)
        grad_b = np.array([lam[i] if i < rounds else 0.0 for i in range(len(b))])
        grad_a = np.array([-(lam[i:] @ p_np[: rounds - i]) if i < rounds else 0.0 for i in range(len(a))])
        as_tensor = lambda v: torch.from_numpy(v).to(dtype=_DTYPE, device=b.device)  # noqa: E731
        return as_tensor(grad_b), as_tensor(grad_a), None


def _workload_denominator(numerator: torch.Tensor, momentum: float) -> torch.Tensor:
    """N(x)·(1 − x)·(1 − μx): the denominator of A(x)·D(x)/N(x) (μ = 0: prefix sum)."""
    one = numerator.new_ones(1)
    out = _poly_mul(numerator, torch.cat([one, -one]))
    if momentum:
        out = _poly_mul(out, torch.cat([one, -momentum * one]))
    return out


def _envelope(coefs: torch.Tensor) -> torch.Tensor:
    """ĉ_r = max_{r≤s<T} |c_s|: the smallest nonnegative nonincreasing sequence ≥ |c| (ĉ = c when c is
    nonnegative and nonincreasing). O(T); differentiable almost everywhere."""
    return torch.flip(torch.cummax(torch.flip(coefs.abs(), [0]), dim=0).values, [0])


def _comb_sums(coefs: torch.Tensor, separation: int) -> torch.Tensor:
    """V_s = Σ_{i≥0, im≤s} ĉ_{s−im} for s < T (V_s = ĉ_s + V_{s−m}) with ĉ = ``_envelope(coefs)``: blocks of m,
    cumulated. O(T).

    Σ_{s<t} V_s² bounds the squared sensitivity after t rounds for every c, and equals it when c is nonnegative
    and nonincreasing (module docstring): the earliest pattern is the worst for ĉ, and |X| ≤ X̂."""
    coefs = _envelope(coefs)
    rounds = len(coefs)
    blocks = -(-rounds // separation)
    padded = torch.cat([coefs, coefs.new_zeros(blocks * separation - rounds)])
    return torch.cumsum(padded.reshape(blocks, separation), dim=0).reshape(-1)[:rounds]


def _loss_terms(theta: torch.Tensor, omega: torch.Tensor, rounds: int, separation: int,
                momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sens_T(C̃)², ‖A C̃⁻¹‖_F²) of the un-normalized BLT, differentiable in θ, ω (module docstring)."""
    powers = torch.pow(omega[:, None], torch.arange(rounds - 1, dtype=_DTYPE, device=omega.device)[None, :])
    coefs = torch.cat([theta.new_ones(1), theta @ powers])
    sens_sq = _comb_sums(coefs, separation).square().sum()
    denominator, numerator = _denominator_numerator(theta, omega)
    p = _ImpulseResponse.apply(denominator, _workload_denominator(numerator, momentum), rounds)
    weights = torch.arange(rounds, 0, -1, dtype=_DTYPE, device=theta.device)  # T − n
    return sens_sq, (weights * p.square()).sum()


def blt_loss(theta: torch.Tensor, omega: torch.Tensor, rounds: int, *, separation: int,
             momentum: float = 0.0) -> torch.Tensor:
    """sens_T(C̃)² · (1/T)·‖A C̃⁻¹‖_F² of BLT(θ, ω): the expected squared error per round of the workload's
    estimates at unit noise multiplier, with every participation the min-separation allows (module
    docstring). Differentiable in ``theta`` and ``omega`` (float64 tensors); O(T·ℓ)."""
    rounds = check_int_range("rounds", rounds, 1)
    separation = check_int_range("separation", separation, 1)
    momentum = check_momentum(momentum)
    sens_sq, frobenius_sq = _loss_terms(theta, omega, rounds, separation, momentum)
    return sens_sq * frobenius_sq / rounds


@dataclass(frozen=True)
class BLTStrategy:
    """A BLT(θ, ω) strategy for T rounds: C = C̃/n_0 with C̃ the Toeplitz matrix of c (module docstring).

    ``theta`` and ``omega`` are tuples of ℓ floats, θ_j finite of either sign, 0 < ω_j < 1 (ValueError
    otherwise).
    One participation has sensitivity 1 (the largest column norm of C); :meth:`sensitivity_squared` gives
    the multi-participation value under a min-separation, which the accounting uses.
    """

    theta: tuple[float, ...]
    omega: tuple[float, ...]
    rounds: int

    def __post_init__(self) -> None:
        theta, omega = _check_parameters(self.theta, self.omega)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)
        object.__setattr__(self, "rounds", check_int_range("rounds", self.rounds, 1))
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"BLT(theta={self.theta}, omega={self.omega}) has coefficients whose norm over "
                             f"{self.rounds} rounds is {self.scale!r}: not a usable strategy (|theta| too large)")
        if not np.all(np.isfinite(self.inverse_row_sq_norms().numpy())):
            raise ValueError(f"BLT(theta={self.theta}, omega={self.omega}) has an inverse that overflows within "
                             f"{self.rounds} rounds: its noise would not be finite; choose a stable BLT")

    @property
    def buffers(self) -> int:
        """ℓ, the number of buffers (of d floats each) the noise stream keeps."""
        return len(self.theta)

    def coefs(self) -> np.ndarray:
        """c_0 … c_{T−1} of the un-normalized C̃ (c_0 = 1)."""
        return blt_coefs(self.theta, self.omega, self.rounds)

    @functools.cached_property
    def scale(self) -> float:
        """n_0 = ‖column 0 of C̃‖₂ = ‖c‖₂, the largest column norm; C = C̃/n_0 and C⁻¹ = n_0·C̃⁻¹."""
        return float(np.linalg.norm(self.coefs()))

    def dense(self) -> torch.Tensor:
        """The dense T×T float64 matrix C = C̃/n_0. For tests and small T."""
        coefs = torch.from_numpy(self.coefs())
        lag = torch.arange(self.rounds)[:, None] - torch.arange(self.rounds)[None, :]
        return torch.where(lag >= 0, coefs[lag.clamp(min=0)], torch.zeros((), dtype=_DTYPE)) / self.scale

    def inverse_coefs(self) -> np.ndarray:
        """h_0 … h_{T−1}, the coefficients of C̃⁻¹ = D(x)/N(x) (h_0 = 1), by the rational filter: O(T·ℓ)."""
        theta, omega = torch.tensor(self.theta, dtype=_DTYPE), torch.tensor(self.omega, dtype=_DTYPE)
        denominator, numerator = _denominator_numerator(theta, omega)
        impulse = np.zeros(self.rounds)
        impulse[0] = 1.0
        return signal.lfilter(denominator.numpy(), numerator.numpy(), impulse)

    @functools.cached_property
    def _inverse_row_sq_norms(self) -> torch.Tensor:
        return torch.from_numpy(self.scale**2 * np.cumsum(self.inverse_coefs() ** 2))

    def inverse_row_sq_norms(self) -> torch.Tensor:
        """(T,) float64: ‖row t of C⁻¹‖² = n_0²·Σ_{n≤t} h_n², the noise-variance multiplier of round t. Cached
        after the first call; a fresh copy is returned."""
        return self._inverse_row_sq_norms.clone()

    def sensitivity_squared(self, separation: int) -> np.ndarray:
        """(T,) float64: sens_t(C)² for t = 1 … T under min-separation m = ``separation``, every participation
        that fits (⌈t/m⌉) counted: Σ_{s<t} V_s² / n_0² with V the column sum of the earliest pattern of the
        envelope ĉ (module docstring): exact when c is nonnegative and nonincreasing, an upper bound otherwise.
        Nondecreasing in t, from (ĉ_0/n_0)² at t = 1 (only row 0 released) to at least 1."""
        separation = check_int_range("separation", separation, 1)
        comb = _comb_sums(torch.from_numpy(self.coefs()), separation).numpy()
        squared = np.cumsum(comb**2) / self.scale**2
        if not np.all(np.isfinite(squared)):  # a NaN here would reach the accountant as a NaN noise multiplier
            raise ValueError(f"the sensitivity of BLT(theta={self.theta}, omega={self.omega}) under separation "
                             f"{separation} is not finite")
        return squared

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "theta": list(self.theta), "omega": list(self.omega)}


def blt_error(strategy: BLTStrategy, *, separation: int, momentum: float = 0.0) -> float:
    """The objective of ``strategy``: sens_T(C)² · (1/T)·‖A C⁻¹‖_F² (equal for C and C̃; module docstring)."""
    theta, omega = torch.tensor(strategy.theta, dtype=_DTYPE), torch.tensor(strategy.omega, dtype=_DTYPE)
    with torch.no_grad():
        return float(blt_loss(theta, omega, strategy.rounds, separation=separation, momentum=momentum))


# --------------------------------------------------------------------------------------------------
# Optimization and the on-disk cache
# --------------------------------------------------------------------------------------------------


def _parameters(free: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unconstrained (u, a) → θ_j = K·tanh(u_j) (|θ_j| < K = ``_THETA_BOUND``) and ω_j = sigmoid(a_j)."""
    buffers = len(free) // 2
    return _THETA_BOUND * torch.tanh(free[:buffers]), torch.sigmoid(free[buffers:])


def initial_blt(rounds: int, buffers: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A starting point: memory lengths τ_j = 1/(1 − ω_j) log-spaced over [1, T^spread], θ_j ∝ √(1 − ω_j)
    (a sum of exponentials shaped like the square root of the prefix sum, c_t ≈ 1/√(πt)), Σθ = 1/2 = c_1 of
    that square root."""
    rounds, buffers = check_int_range("rounds", rounds, 1), check_int_range("buffers", buffers, 1)
    top = max(math.log(max(rounds, 2)) * spread, 1e-3)
    tau = np.exp((np.arange(buffers) + 0.5) / buffers * top) + 0.5
    omega = 1.0 - 1.0 / tau
    theta = np.sqrt(1.0 - omega)
    return 0.5 * theta / theta.sum(), omega


def _free_from(theta: np.ndarray, omega: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.concatenate([np.arctanh(theta / _THETA_BOUND), np.log(omega / (1.0 - omega))]),
                        dtype=_DTYPE)


def _minimize(rounds: int, buffers: int, separation: int, momentum: float, max_iter: int,
              start: tuple[np.ndarray, np.ndarray]) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """L-BFGS (strong Wolfe, float64) on log(blt_loss) over the unconstrained (u, a) from ``start``."""

    def objective(x: torch.Tensor) -> torch.Tensor:
        theta, omega = _parameters(x)
        loss = blt_loss(theta, omega, rounds, separation=separation, momentum=momentum)
        if not torch.isfinite(loss):  # a trial step whose C̃⁻¹ overflows: a wall for the line search
            return (x * 0).sum() + 1e3
        return torch.log(loss)

    free = lbfgs_minimize(objective, _free_from(*start), max_iter=max_iter, tolerance_grad=1e-9,
                          tolerance_change=1e-12)
    with torch.no_grad():
        theta, omega = _parameters(free)
        loss = float(blt_loss(theta, omega, rounds, separation=separation, momentum=momentum))
    return tuple(theta.tolist()), tuple(omega.tolist()), loss


def _workload_key(momentum: float) -> str:
    return "prefix-sum" if momentum == 0.0 else f"momentum{momentum!r}"


def _cache_header(rounds: int, buffers: int, separation: int, momentum: float) -> dict[str, Any]:
    """The fields that identify a cached BLT: format, version and the (T, ℓ, min-separation, workload) key."""
    return {
        "format": _CACHE_FORMAT,
        "version": _CACHE_VERSION,
        "rounds": rounds,
        "buffers": buffers,
        "separation": separation,
        "workload": "prefix-sum" if momentum == 0.0 else "momentum",
        "momentum": momentum,
    }


def _read_cached(path: Path, header: dict[str, Any]) -> BLTStrategy:
    try:
        payload = json.loads(path.read_text())
        for key, value in header.items():
            if payload.get(key) != value:
                raise ValueError(f"field {key!r} is {payload.get(key)!r}, expected {value!r}")
        theta, omega = payload["theta"], payload["omega"]
        for name, values in (("theta", theta), ("omega", omega)):
            if not isinstance(values, list) or len(values) != header["buffers"] or not all(
                    isinstance(v, float) for v in values):
                raise ValueError(f"{name!r} must be a list of {header['buffers']} floats")
        return BLTStrategy(tuple(theta), tuple(omega), header["rounds"])
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"cached BLT strategy file {path} is invalid ({error}); delete it to re-optimize") from error


def optimize_blt(
    rounds: int,
    buffers: int,
    *,
    separation: int,
    momentum: float = 0.0,
    cache_dir: str | os.PathLike | None = None,
    max_iter: int = 300,
) -> BLTStrategy:
    """The BLT with ``buffers`` = ℓ buffers that minimizes :func:`blt_loss` for T rounds, min-separation m
    and the workload (prefix sum, or SGD with momentum μ), cached on disk.

    L-BFGS (strong Wolfe, float64) on log(loss) over unconstrained parameters (θ_j = 2·tanh(u_j), of either
    sign; ω through a sigmoid), from the :func:`initial_blt` points with memory lengths spread over [1, T^s]
    for s in (1, 0.75, 0.5); the best result is kept. Each loss evaluation is O(T·ℓ). The bound |θ_j| < 2 keeps
    the float32 stream y = z − Σ_j θ_j S_j free of large cancellations: unbounded, the optimum at T = 2,000,
    m = 64 has θ ≈ (−114, 66, 48) on three nearly equal ω for 0.4% less error. Results are cached as JSON
    keyed by (T, ℓ, m, workload): ``blt-v2-T{T}-k{ℓ}-m{m}-prefix-sum.json`` (or ``…-momentum{μ}.json``; v2 is
    the cache version, so files of an older optimizer are not read) in ``cache_dir``, else $FED_DP_CACHE_DIR,
    else ~/.cache/fed-dp/strategies, written atomically; a cached file that fails validation raises ValueError
    naming it (never silently recomputed).
    """
    rounds = check_int_range("rounds", rounds, 1)
    buffers = check_int_range("buffers", buffers, 1)
    separation = check_int_range("separation", separation, 1)
    momentum = check_momentum(momentum)
    max_iter = check_int_range("max_iter", max_iter, 1)
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = folder / f"blt-v{_CACHE_VERSION}-T{rounds}-k{buffers}-m{separation}-{_workload_key(momentum)}.json"
    header = _cache_header(rounds, buffers, separation, momentum)
    if path.exists():
        return _read_cached(path, header)
    best = None
    for spread in (1.0, 0.75, 0.5):
        result = _minimize(rounds, buffers, separation, momentum, max_iter, initial_blt(rounds, buffers, spread))
        if math.isfinite(result[2]) and (best is None or result[2] < best[2]):
            best = result
    if best is None:
        raise ValueError(f"BLT optimization for T = {rounds}, {buffers} buffers found no finite loss")
    theta, omega, loss = best
    strategy = BLTStrategy(theta, omega, rounds)
    write_json_atomically(path, {**header, "theta": list(strategy.theta), "omega": list(strategy.omega), "loss": loss})
    return strategy


# --------------------------------------------------------------------------------------------------
# The strategy of a run configuration (shared by the noise and the accounting)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _cached(rounds: int, buffers: int, separation: int, momentum: float, folder: str) -> BLTStrategy:
    return optimize_blt(rounds, buffers, separation=separation, momentum=momentum, cache_dir=folder)


def config_strategy(config: "PrivacyConfig", cache_dir: str | os.PathLike | None = None) -> BLTStrategy:
    """The BLT of a resolved config with noise 'blt': :func:`optimize_blt` for (T, ℓ = ``buffers``, the
    sampler's min-separation m capped at T, workload), memoized in the process and cached on disk. The privatizer's
    noise and the accounting event both come from this one strategy."""
    if config.noise != "blt":
        raise ValueError(f"config.noise is {config.noise!r}; a BLT strategy exists for noise 'blt' only")
    config.require_resolved("the BLT strategy")  # the min-separation of min-sep needs N
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _cached(config.rounds, config.buffers, _separation(config), config.workload_momentum, str(folder))


def _separation(config: "PrivacyConfig") -> int:
    """The sampler's min-separation m, capped at T: with m ≥ T one participation fits in every prefix, so every
    such m gives the same objective and sensitivity (and one cache file)."""
    return min(config.min_separation, config.rounds)


@functools.lru_cache(maxsize=32)
def _cached_sensitivity(strategy: BLTStrategy, separation: int) -> tuple[float, ...]:
    return tuple(strategy.sensitivity_squared(separation).tolist())


def config_sensitivity_squared(config: "PrivacyConfig") -> tuple[float, ...]:
    """sens_t(C)² for t = 1 … T of the config's BLT under its sampler's min-separation (memoized): what
    the accounting event after t rounds, Gaussian(σ/sens_t), uses."""
    return _cached_sensitivity(config_strategy(config), _separation(config))
