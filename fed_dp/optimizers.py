"""Server optimizers as pure transforms on the private pseudo-gradient (docs/explanation/server-optimizers.md).

Every optimizer is a frozen, validated dataclass with

    init(params)                     -> OptimizerState          (its own step counter inside)
    update(release, state, params)   -> (step, state, metrics)  (new params = params + step)
    scale(state)                     -> s_t to broadcast, or None (scale-then-privatize only)
    needs                            -> RoundNeeds: what the round must deliver
    private                          -> False only for the noiseless baseline

``release`` is a :class:`RoundRelease`: g̃_t = −(Σ_t + w_t)/B (already un-scaled for STP) and, when the
optimizer needs them, the privatized mean of squares (independent moment estimation), the per-coordinate
noise variance Φ_t of g̃_t (bias correction), or the un-noised pseudo-gradient (the non-private baseline).
Noise is added before any of this: everything here is post-processing, except the noiseless baseline.

Variants (seed papers in ../shared/seeds):
    SGD       3.1  DP-FedAvg (η = 1, μ = 0), DP-SGD, DP-SGD with momentum
    Adam      3.2  DP-Adam by post-processing
              3.3  DP-AdamBC: θ −= η·m̂/sqrt(max(ν̂ − Φ̂, γ)), Φ̂ from the privatizer's noise variance
              3.4  DP-AdamW / DP-AdamW-BC: decoupled weight decay λ
              3.5  independent moment estimation: ν from the privatized Σu²
              3.6  scale-then-privatize: broadcast s_t = 1/(sqrt(ν̂_{t−1}) + ε_s)
              3.7  noiseless-preconditioner baseline (simulation only, NOT private)
    AdaGrad   3.8  by post-processing, with independent moment estimation (also "for free"), or with
                   the bias-correction analogue b_t = b_{t−1} + Φ_t
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple

import torch

from fed_dp.context import require_simulation
from fed_dp.diagnostics import second_moment_summary
from fed_dp.validation import check_positive as _positive
from fed_dp.validation import require as _require

SECOND_MOMENTS = ("noisy", "independent", "clean")


class RoundNeeds(NamedTuple):
    """What an optimizer needs from a round, so an engine asks instead of special-casing names.

    squares: users also send Σ u_i² and the server privatizes [Σu ; α·Σu²] (§3.5, §3.8).
    broadcast_scale: the server broadcasts ``scale(state)`` and users clip s_t ⊙ Δ_i (§3.6).
    noise_variance: the per-coordinate variance Φ_t of the noise in g̃_t, every round (§3.3).
    clean_aggregate: the un-noised pseudo-gradient (§3.7; NOT private, simulations only).
    """

    squares: bool = False
    broadcast_scale: bool = False
    noise_variance: bool = False
    clean_aggregate: bool = False


@dataclass(frozen=True)
class RoundRelease:
    """What round t hands the optimizer. All fields but ``clean_grad`` are post-noise.

    grad: g̃_t = −Δ̃_t, the noisy pseudo-gradient (for STP, after un-scaling by s_t).
    second_moment: ŝ_t = (Σu² + noise)/B, the privatized mean of squares (independent moments).
    noise_variance: Φ_t, per-coordinate variance of the noise in g̃_t: (σζ/B)²·‖row t of C⁻¹‖², a
        scalar, or a vector for STP ((σζ/B)²·‖row t of C⁻¹‖²/s_t²).
    clean_grad: −Σ_t/B without noise (noiseless baseline only).
    """

    grad: torch.Tensor
    second_moment: torch.Tensor | None = None
    noise_variance: torch.Tensor | float | None = None
    clean_grad: torch.Tensor | None = None


class OptimizerState(NamedTuple):
    """step: rounds applied so far; m: first moment / momentum; nu: second moment (EMA or sum);
    phi: the matching EMA or sum b_t of the noise variances Φ_τ (None when not tracked)."""

    step: int
    m: torch.Tensor | None
    nu: torch.Tensor | None
    phi: torch.Tensor | None


def _decay(name: str, value: float) -> None:
    _require(
        isinstance(value, (int, float)) and 0 <= value < 1, f"{name} must be in [0, 1), got {value!r}"
    )


def _check_release(release: RoundRelease, params: torch.Tensor) -> None:
    for name in ("grad", "second_moment", "clean_grad"):
        value = getattr(release, name)
        if value is not None and value.shape != params.shape:
            raise ValueError(f"release.{name} has shape {tuple(value.shape)}, parameters have {tuple(params.shape)}")
    phi = release.noise_variance
    if isinstance(phi, torch.Tensor) and phi.ndim and phi.shape != params.shape:
        raise ValueError(
            f"release.noise_variance has shape {tuple(phi.shape)}; give a scalar or a vector shaped like the "
            f"parameters {tuple(params.shape)}"
        )


class ServerOptimizer:
    """Interface of the server optimizers (see module docstring)."""

    @property
    def needs(self) -> RoundNeeds:
        return RoundNeeds()

    @property
    def private(self) -> bool:
        return True

    def init(self, params: torch.Tensor) -> OptimizerState:
        raise NotImplementedError

    def update(
        self, release: RoundRelease, state: OptimizerState, params: torch.Tensor
    ) -> tuple[torch.Tensor, OptimizerState, dict[str, float]]:
        raise NotImplementedError

    def scale(self, state: OptimizerState) -> torch.Tensor | None:
        """s_t to broadcast before round t (scale-then-privatize); None when not used."""
        return None

    def describe(self) -> str:
        """The class and the fields that differ from its defaults, e.g. ``Adam(lr=0.05, bias_correction=True)``."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if f.compare and getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(changed)})"


@dataclass(frozen=True, kw_only=True)
class SGD(ServerOptimizer):
    """DP-FedAvg / DP-SGD / DP-SGD with momentum (docs/explanation/server-optimizers.md; seed 003 DP-GD, DP-GDM).

        m_t = μ·m_{t−1} + g̃_t ,   θ_t = θ_{t−1} − η·m_t          (μ = 0: θ_t = θ_{t−1} − η·g̃_t)

    η = 1, μ = 0 is DP-FedAvg: θ_t = θ_{t−1} + Δ̃_t. Matches ``torch.optim.SGD`` (dampening 0).
    """

    lr: float = 1.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _decay("momentum", self.momentum)

    def init(self, params: torch.Tensor) -> OptimizerState:
        return OptimizerState(0, torch.zeros_like(params) if self.momentum else None, None, None)

    def update(self, release, state, params):
        _check_release(release, params)
        direction = release.grad
        m = None
        if self.momentum:
            m = self.momentum * state.m + release.grad
            direction = m
        return -self.lr * direction, OptimizerState(state.step + 1, m, None, None), {}


# --- shared pieces of the adaptive optimizers ------------------------------------------------------------
def _second_moment_input(release: RoundRelease, source: str) -> torch.Tensor:
    """What feeds ν: g̃² (post-processing), ŝ (independent estimate) or the clean g² (baseline)."""
    if source == "noisy":
        return release.grad.square()
    if source == "independent":
        if release.second_moment is None:
            raise ValueError("independent moment estimation needs release.second_moment (privatized Σu²/B)")
        return release.second_moment
    if release.clean_grad is None:
        raise ValueError("the noiseless baseline needs release.clean_grad (the un-noised pseudo-gradient)")
    return release.clean_grad.square()


def _noise_variance(release: RoundRelease, state: OptimizerState, required: bool) -> torch.Tensor | None:
    """Φ_t as a tensor; it must come every round once tracked (the b_t recursion needs every term)."""
    phi = release.noise_variance
    if phi is None:
        if required:
            raise ValueError("bias correction needs release.noise_variance (Φ_t) every round")
        if state.phi is not None:
            raise ValueError("release.noise_variance was given in earlier rounds; give it every round")
        return None
    if state.step > 0 and state.phi is None:
        raise ValueError("release.noise_variance must be given from the first round on, or never")
    phi = torch.as_tensor(phi, dtype=release.grad.dtype, device=release.grad.device)
    if bool((phi < 0).any()) or not bool(torch.isfinite(phi).all()):
        raise ValueError("release.noise_variance must be finite and >= 0")
    return phi


def _denominator(
    nu_hat: torch.Tensor,
    phi_hat: torch.Tensor | None,
    *,
    source: str,
    bias_correction: bool,
    floor: float | torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """sqrt(max(ν̂ − Φ̂, γ)) with bias correction (no ε outside the root, seed 001 Alg. 1);
    sqrt(max(ν̂, 0)) + ε for the independent estimate, which can be negative (§3.5); sqrt(ν̂) + ε else.
    ``floor`` γ is a number or, for the default γ = Φ̂_t, a tensor (a vector for scale-then-privatize)."""
    if bias_correction:
        return torch.sqrt(torch.maximum(nu_hat - phi_hat, torch.as_tensor(floor, dtype=nu_hat.dtype,
                                                                         device=nu_hat.device)))
    if source == "independent":
        return torch.sqrt(torch.clamp(nu_hat, min=0.0)) + eps
    return torch.sqrt(nu_hat) + eps


def _validate_adaptive(opt: "Adam | AdaGrad") -> None:
    _positive("lr", opt.lr)
    _positive("eps", opt.eps)
    if opt.bc_floor is not None:
        _positive("bc_floor (γ)", opt.bc_floor)
    _positive("ime_alpha (α)", opt.ime_alpha)
    _require(
        opt.second_moment in SECOND_MOMENTS,
        f"second_moment must be one of {', '.join(SECOND_MOMENTS)}; got {opt.second_moment!r}",
    )
    _require(
        not (opt.bias_correction and opt.second_moment != "noisy"),
        "bias_correction subtracts the noise floor Φ̂ of g̃²; the "
        f"{opt.second_moment!r} second moment has no such floor. Use second_moment='noisy'",
    )
    if opt.second_moment == "clean":
        require_simulation("The noiseless-preconditioner baseline (second_moment='clean')")


def _adaptive_needs(opt: "Adam | AdaGrad", broadcast_scale: bool) -> RoundNeeds:
    return RoundNeeds(
        squares=opt.second_moment == "independent",
        broadcast_scale=broadcast_scale,
        noise_variance=opt.bias_correction,
        clean_aggregate=opt.second_moment == "clean",
    )


@dataclass(frozen=True, kw_only=True)
class Adam(ServerOptimizer):
    """DP-Adam and its variants on the server (docs/explanation/server-optimizers.md).

        m_t = β₁m_{t−1} + (1−β₁)g̃_t ,  ν_t = β₂ν_{t−1} + (1−β₂)s_t ,  m̂ = m_t/(1−β₁ᵗ), ν̂ = ν_t/(1−β₂ᵗ)
        θ_t = θ_{t−1} − η·( m̂_t / D_t + λ·θ_{t−1} )

    s_t = g̃_t² (``second_moment='noisy'``, post-processing, seed 000 Alg. 5 / seed 001 §2), the
    privatized ŝ_t (``'independent'``, seed 000 Alg. 6) or the clean g² (``'clean'``, the non-private
    baseline of seed 000 §5.2). D_t = sqrt(ν̂) + ε, or with ``bias_correction`` (DP-AdamBC, seed 001
    Eq. 3 / Alg. 1) D_t = sqrt(max(ν̂_t − Φ̂_t, γ)) where b_t = β₂b_{t−1} + (1−β₂)Φ_t, Φ̂_t = b_t/(1−β₂ᵗ)
    (= (σζ/B)² for independent noise; the correlated-noise recursion of seed 000 App. A for BandMF).
    The floor γ = ``bc_floor`` defaults to Φ̂_t itself, the noise floor of ν̂ ((σζ/B)² for independent
    noise): a coordinate whose ν̂ − Φ̂ is below the noise floor is scaled as if its signal were at that floor,
    a step of about η·m̂/sqrt(Φ̂). A tiny fixed γ (seed 001 uses 1e-8 at its scale) makes such coordinates
    take huge steps once ν̂ − Φ̂ < 0 for many of them, which seed 000 (§4.4, Fig. 4) shows happens for a
    large share of the coordinates when d ≫ (B/σ)²; DP-AdamBC then diverges (the heavy-tail run of docs/explanation/server-optimizers.md).
    λ = ``weight_decay`` is decoupled (DP-AdamW / DP-AdamW-BC, seed 004 Alg. 1, 2); we use the standard
    sqrt(ν̂) + ε form rather than seed 004's sqrt(ν̂ + ε₀). With ``scale_then_privatize`` (seed 000
    Alg. 8) ``scale`` gives s_t = 1/(sqrt(ν̂_{t−1}) + ε_s) to broadcast; the engine clips s_t ⊙ Δ_i and
    un-scales after the noise. σ = 0 without clipping reproduces ``torch.optim.Adam`` / ``AdamW``.
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = False
    bc_floor: float | None = None
    second_moment: str = "noisy"
    ime_alpha: float = 1.0
    scale_then_privatize: bool = False
    stp_eps: float = 1e-3
    record_diagnostics: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        _validate_adaptive(self)
        _decay("beta1", self.beta1)
        _decay("beta2", self.beta2)
        _positive("stp_eps (ε_s)", self.stp_eps)
        _require(
            isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}",
        )

    @property
    def needs(self) -> RoundNeeds:
        return _adaptive_needs(self, self.scale_then_privatize)

    @property
    def private(self) -> bool:
        return self.second_moment != "clean"

    def init(self, params: torch.Tensor) -> OptimizerState:
        return OptimizerState(0, torch.zeros_like(params), torch.zeros_like(params), None)

    def scale(self, state: OptimizerState) -> torch.Tensor | None:
        if not self.scale_then_privatize:
            return None
        nu_hat = state.nu / (1 - self.beta2**state.step) if state.step else torch.zeros_like(state.nu)
        return 1.0 / (torch.sqrt(torch.clamp(nu_hat, min=0.0)) + self.stp_eps)

    def update(self, release, state, params):
        _check_release(release, params)
        t = state.step + 1
        phi_t = _noise_variance(release, state, self.bias_correction)
        m = self.beta1 * state.m + (1 - self.beta1) * release.grad
        nu = self.beta2 * state.nu + (1 - self.beta2) * _second_moment_input(release, self.second_moment)
        phi = None
        if phi_t is not None:
            previous = state.phi if state.phi is not None else torch.zeros_like(phi_t)
            phi = self.beta2 * previous + (1 - self.beta2) * phi_t
        m_hat = m / (1 - self.beta1**t)
        nu_hat = nu / (1 - self.beta2**t)
        phi_hat = None if phi is None else phi / (1 - self.beta2**t)
        denominator = _denominator(
            nu_hat, phi_hat, source=self.second_moment, bias_correction=self.bias_correction,
            floor=phi_hat if self.bc_floor is None else self.bc_floor, eps=self.eps,
        )
        step = -self.lr * (m_hat / denominator + self.weight_decay * params)
        metrics = second_moment_summary(nu_hat, phi_hat) if self.record_diagnostics else {}
        return step, OptimizerState(t, m, nu, phi), metrics


@dataclass(frozen=True, kw_only=True)
class AdaGrad(ServerOptimizer):
    """DP-AdaGrad on the server (docs/explanation/server-optimizers.md; seed 000 §5.1).

        G_t = G_{t−1} + s_t ,   θ_t = θ_{t−1} − η·g̃_t / D_t

    s_t as for :class:`Adam` (g̃², the privatized ŝ, or the clean g²). D_t = sqrt(G_t) + ε, or
    sqrt(max(G_t, 0)) + ε for the independent estimate, or with ``bias_correction``
    D_t = sqrt(max(G_t − b_t, γ)) with b_t = b_{t−1} + Φ_t (γ = ``bc_floor``, default 1e-8: unlike Adam's
    Φ̂_t, b_t grows with t, so no single noise variance is its natural floor). The "for free" variant is independent moment
    estimation under replace-one adjacency with α²ζ² below the threshold of
    ``fed_dp.moment_estimation.free_threshold``: the engine's noise is then that of the first moment
    alone. σ = 0 reproduces ``torch.optim.Adagrad``.
    """

    lr: float = 0.1
    eps: float = 1e-10
    bias_correction: bool = False
    bc_floor: float = 1e-8
    second_moment: str = "noisy"
    ime_alpha: float = 1.0
    record_diagnostics: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        _validate_adaptive(self)
        _positive("bc_floor (γ)", self.bc_floor)

    @property
    def needs(self) -> RoundNeeds:
        return _adaptive_needs(self, False)

    @property
    def private(self) -> bool:
        return self.second_moment != "clean"

    def init(self, params: torch.Tensor) -> OptimizerState:
        return OptimizerState(0, None, torch.zeros_like(params), None)

    def update(self, release, state, params):
        _check_release(release, params)
        phi_t = _noise_variance(release, state, self.bias_correction)
        accumulated = state.nu + _second_moment_input(release, self.second_moment)
        phi = None
        if phi_t is not None:
            phi = phi_t if state.phi is None else state.phi + phi_t
        denominator = _denominator(
            accumulated, phi, source=self.second_moment, bias_correction=self.bias_correction,
            floor=self.bc_floor, eps=self.eps,
        )
        step = -self.lr * release.grad / denominator
        metrics = second_moment_summary(accumulated, phi) if self.record_diagnostics else {}
        return step, OptimizerState(state.step + 1, None, accumulated, phi), metrics


#: Named variants of the seed papers; ``make_optimizer(name, **hyper_parameters)`` builds one.
OPTIMIZERS: dict[str, Callable[..., ServerOptimizer]] = {
    "dp-fedavg": lambda **kw: SGD(**{"lr": 1.0, "momentum": 0.0, **kw}),
    "dp-sgd": lambda **kw: SGD(**kw),
    "dp-sgdm": lambda **kw: SGD(**{"momentum": 0.9, **kw}),
    "dp-adam": lambda **kw: Adam(**kw),
    "dp-adambc": lambda **kw: Adam(**{"bias_correction": True, **kw}),
    "dp-adamw": lambda **kw: Adam(**{"weight_decay": 1e-2, **kw}),
    "dp-adamw-bc": lambda **kw: Adam(**{"weight_decay": 1e-2, "bias_correction": True, **kw}),
    "dp-adam-ime": lambda **kw: Adam(**{"second_moment": "independent", **kw}),
    "dp-adam-stp": lambda **kw: Adam(**{"scale_then_privatize": True, **kw}),
    "noiseless-adam": lambda **kw: Adam(**{"second_moment": "clean", **kw}),
    "noiseless-adam-stp": lambda **kw: Adam(**{"second_moment": "clean", "scale_then_privatize": True, **kw}),
    "dp-adagrad": lambda **kw: AdaGrad(**kw),
    "dp-adagrad-bc": lambda **kw: AdaGrad(**{"bias_correction": True, **kw}),
    "dp-adagrad-ime": lambda **kw: AdaGrad(**{"second_moment": "independent", **kw}),
    "noiseless-adagrad": lambda **kw: AdaGrad(**{"second_moment": "clean", **kw}),
}


def make_optimizer(name: str, **hyper_parameters: Any) -> ServerOptimizer:
    """The named variant with ``hyper_parameters`` (validated; unknown names list the choices)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    try:
        return OPTIMIZERS[name](**hyper_parameters)
    except TypeError as error:  # an unknown hyper-parameter name
        raise ValueError(f"optimizer {name!r}: {error}") from error
