"""Server optimizers (docs/explanation/server-optimizers.md): reference reproduction, STP, DP-AdamBC Φ, variants, validation, state.

Expected values come from outside the code under test: ``torch.optim`` as a second implementation (σ = 0,
no clipping), hand computations in Python floats, closed forms such as (σζ/B)², and Monte Carlo over
coordinates with a stated statistical tolerance. Every random draw uses an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math

import pytest
import torch

from fed_dp.aggregation import private_average, unscale
from fed_dp.clipping import clip_scaled
from fed_dp.context import reported_epsilon, simulation
from fed_dp.noise import Privatizer
from fed_dp.optimizers import (
    OPTIMIZERS,
    Adam,
    AdaGrad,
    RoundNeeds,
    RoundRelease,
    SGD,
    make_optimizer,
)
from fed_dp.factorization import sqrt_prefix_sum_coefs, toeplitz_strategy

F64 = torch.float64
DIM = 100
ROUNDS = 50
TIGHT = 1e-10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_problem(seed: int, dim: int = DIM, rounds: int = ROUNDS):
    """Random initial params and per-round gradients whose coordinate scales span 1e-4 … 10, so that
    ε matters for some coordinates (a misplaced ε is then visible at the 1e-10 level)."""
    gen = _gen(seed)
    init = torch.randn(dim, generator=gen, dtype=F64)
    scales = torch.logspace(-4, 1, dim, dtype=F64)
    grads = [scales * torch.randn(dim, generator=gen, dtype=F64) for _ in range(rounds)]
    return init, grads


def _run_ours(opt, init: torch.Tensor, grads) -> list[torch.Tensor]:
    params = init.clone()
    state = opt.init(params)
    trajectory = []
    for g in grads:
        step, state, _ = opt.update(RoundRelease(grad=g), state, params)
        params = params + step
        trajectory.append(params.clone())
    return trajectory


def _run_torch(factory, init: torch.Tensor, grads) -> list[torch.Tensor]:
    p = torch.nn.Parameter(init.clone())
    reference = factory([p])
    trajectory = []
    for g in grads:
        p.grad = g.clone()
        reference.step()
        trajectory.append(p.detach().clone())
    return trajectory


def _assert_same_trajectory(ours, reference, tol: float = TIGHT) -> None:
    assert len(ours) == len(reference)
    for t, (a, b) in enumerate(zip(ours, reference), start=1):
        err = (a - b).abs().max().item()
        assert err <= tol, f"round {t}: max |Δθ| = {err:.3e} > {tol:g}"
    # the trajectory must actually move (otherwise agreement would be vacuous)
    assert (ours[-1] - ours[0]).abs().max().item() > 1e-3


# =====================================================================================================
# 1. σ = 0, no clipping: torch.optim reproduced step for step
# =====================================================================================================
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_reproduces_torch_sgd(momentum):
    init, grads = _random_problem(1)
    lr = 0.05
    ours = _run_ours(SGD(lr=lr, momentum=momentum), init, grads)
    ref = _run_torch(lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum), init, grads)
    _assert_same_trajectory(ours, ref)


@pytest.mark.parametrize(
    "lr, beta1, beta2, eps",
    [(1e-3, 0.9, 0.999, 1e-8), (0.05, 0.8, 0.95, 1e-3), (0.02, 0.0, 0.5, 1e-2)],
)
def test_adam_reproduces_torch_adam(lr, beta1, beta2, eps):
    init, grads = _random_problem(2)
    ours = _run_ours(Adam(lr=lr, beta1=beta1, beta2=beta2, eps=eps), init, grads)
    ref = _run_torch(lambda p: torch.optim.Adam(p, lr=lr, betas=(beta1, beta2), eps=eps), init, grads)
    _assert_same_trajectory(ours, ref)


@pytest.mark.parametrize("weight_decay", [1e-2, 0.3])
def test_adam_weight_decay_reproduces_torch_adamw(weight_decay):
    init, grads = _random_problem(3)
    lr, betas, eps = 0.03, (0.85, 0.99), 1e-3
    opt = Adam(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    ours = _run_ours(opt, init, grads)
    ref = _run_torch(lambda p: torch.optim.AdamW(p, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), init, grads)
    _assert_same_trajectory(ours, ref)
    # and it is NOT coupled (L2-in-gradient) weight decay: torch.optim.Adam(weight_decay=λ) differs
    coupled = _run_torch(lambda p: torch.optim.Adam(p, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), init, grads)
    assert (ours[-1] - coupled[-1]).abs().max().item() > 1e-6


@pytest.mark.parametrize("lr, eps", [(0.1, 1e-10), (0.05, 1e-3)])
def test_adagrad_reproduces_torch_adagrad(lr, eps):
    init, grads = _random_problem(4)
    ours = _run_ours(AdaGrad(lr=lr, eps=eps), init, grads)
    ref = _run_torch(
        lambda p: torch.optim.Adagrad(p, lr=lr, eps=eps, initial_accumulator_value=0.0, lr_decay=0.0), init, grads
    )
    _assert_same_trajectory(ours, ref)


def test_make_optimizer_dp_fedavg_adds_the_noisy_average_exactly():
    init, grads = _random_problem(5, rounds=5)
    opt = make_optimizer("dp-fedavg")
    params = init.clone()
    state = opt.init(params)
    for g in grads:
        delta_tilde = -g
        step, state, _ = opt.update(RoundRelease(grad=g), state, params)
        assert torch.equal(step, delta_tilde)
        new = params + step
        assert torch.equal(new, params + delta_tilde)
        params = new


@pytest.mark.parametrize(
    "name, factory",
    [
        ("dp-sgd", lambda p: torch.optim.SGD(p, lr=0.3)),
        ("dp-sgdm", lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9)),
        ("dp-adam", lambda p: torch.optim.Adam(p, lr=0.3)),
        ("dp-adamw", lambda p: torch.optim.AdamW(p, lr=0.3, weight_decay=1e-2)),
        ("dp-adagrad", lambda p: torch.optim.Adagrad(p, lr=0.3, eps=1e-10, initial_accumulator_value=0.0)),
    ],
)
def test_make_optimizer_named_variants_reproduce_torch(name, factory):
    init, grads = _random_problem(6, rounds=20)
    ours = _run_ours(make_optimizer(name, lr=0.3), init, grads)
    _assert_same_trajectory(ours, _run_torch(factory, init, grads))


def test_make_optimizer_builds_the_documented_variants():
    assert make_optimizer("dp-fedavg") == SGD(lr=1.0, momentum=0.0)
    assert make_optimizer("dp-sgdm") == SGD(momentum=0.9)
    assert make_optimizer("dp-adam", lr=0.2) == Adam(lr=0.2)
    assert make_optimizer("dp-adambc") == Adam(bias_correction=True)
    assert make_optimizer("dp-adamw") == Adam(weight_decay=1e-2)
    assert make_optimizer("dp-adamw-bc", weight_decay=0.1) == Adam(weight_decay=0.1, bias_correction=True)
    assert make_optimizer("dp-adam-ime") == Adam(second_moment="independent")
    assert make_optimizer("dp-adam-stp") == Adam(scale_then_privatize=True)
    assert make_optimizer("dp-adagrad-bc") == AdaGrad(bias_correction=True)
    assert make_optimizer("dp-adagrad-ime") == AdaGrad(second_moment="independent")


# =====================================================================================================
# 2. Scale-then-privatize
# =====================================================================================================
def _cohort(gen: torch.Generator, users: int, dim: int) -> torch.Tensor:
    scales = torch.logspace(-3, 0, dim, dtype=F64)
    return scales * torch.randn(users, dim, generator=gen, dtype=F64)


def test_stp_adam_with_sigma_zero_and_no_clipping_reproduces_plain_adam():
    gen = _gen(21)
    users, cohort, huge_clip = 5, 8, 1e12
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8)
    stp = Adam(scale_then_privatize=True, stp_eps=1e-3, **hyper)
    plain = Adam(**hyper)
    params_stp = torch.randn(DIM, generator=gen, dtype=F64)
    params_plain = params_stp.clone()
    state_stp, state_plain = stp.init(params_stp), plain.init(params_plain)
    assert plain.scale(state_plain) is None
    for t in range(1, ROUNDS + 1):
        deltas = _cohort(gen, users, DIM)
        s_t = stp.scale(state_stp)
        if t == 1:  # ν̂₀ = 0: uniform 1/ε_s
            assert torch.allclose(s_t, torch.full((DIM,), 1 / 1e-3, dtype=F64), rtol=1e-15, atol=0)
        else:
            assert s_t.std() > 0
        total = sum(clip_scaled(deltas[i], s_t, huge_clip).update for i in range(users))
        g_stp = -unscale(total / cohort, s_t)
        g_plain = -deltas.sum(0) / cohort
        assert torch.allclose(g_stp, g_plain, rtol=1e-12, atol=1e-15)
        step_stp, state_stp, _ = stp.update(RoundRelease(grad=g_stp), state_stp, params_stp)
        step_plain, state_plain, _ = plain.update(RoundRelease(grad=g_plain), state_plain, params_plain)
        params_stp, params_plain = params_stp + step_stp, params_plain + step_plain
        assert (params_stp - params_plain).abs().max().item() <= 1e-9, f"round {t}"
    # the scale really is 1/(sqrt(ν̂) + ε_s) of the current state (independent recomputation)
    nu_hat = state_stp.nu / (1 - 0.99**ROUNDS)
    assert torch.allclose(stp.scale(state_stp), 1 / (nu_hat.sqrt() + 1e-3), rtol=1e-12, atol=0)


def test_stp_first_noisy_rounds_neither_stall_nor_explode():
    gen = _gen(22)
    users, cohort, clip, sigma, lr = 5, 5, 1.0, 1.0, 0.01
    opt = make_optimizer("dp-adam-stp", lr=lr)  # ε_s = 1e-3: scaled updates are ~1e3× larger than Δ
    privatizer = Privatizer(None, noise_std=sigma * clip, dim=DIM, seed=23, dtype=F64)
    params = torch.zeros(DIM, dtype=F64)
    state = opt.init(params)
    for t in range(1, 6):
        s_t = opt.scale(state)
        assert bool(torch.isfinite(s_t).all()) and bool((s_t > 0).all())
        deltas = 0.01 * torch.randn(users, DIM, generator=gen, dtype=F64)
        total = sum(clip_scaled(deltas[i], s_t, clip).update for i in range(users))
        g = -unscale(private_average(total, privatizer, cohort), s_t)
        step, state, _ = opt.update(RoundRelease(grad=g), state, params)
        params = params + step
        assert bool(torch.isfinite(step).all()), f"round {t}"
        # For t ≤ 5, |m̂|/sqrt(ν̂) ≤ sqrt(Σ_k a_k²/b_k) ≈ 1.0 (Cauchy–Schwarz with the bias-corrected
        # EMA weights a_k, b_k), so |step| ≈ lr at most; 1.5·lr excludes an explosion, and a median of
        # at least 0.3·lr excludes a stall (a step drowned by ε or by a degenerate scale).
        assert step.abs().max().item() <= 1.5 * lr, f"round {t}"
        assert step.abs().median().item() >= 0.3 * lr, f"round {t}"


# =====================================================================================================
# 3. DP-AdamBC: Φ̂ for independent noise, the BandMF recursion (Monte Carlo), the denominator
# =====================================================================================================
def _phi_hat(state, beta2: float) -> torch.Tensor:
    return state.phi / (1 - beta2**state.step)


def test_independent_noise_phi_hat_is_constant_sigma_zeta_over_b_squared():
    sigma, clip, cohort, beta2 = 1.3, 0.7, 25, 0.999
    phi = (sigma * clip / cohort) ** 2
    opt = Adam(bias_correction=True, beta2=beta2, lr=0.01)
    gen = _gen(31)
    params = torch.zeros(10, dtype=F64)
    state = opt.init(params)
    for t in range(1, 201):
        g = torch.randn(10, generator=gen, dtype=F64)
        _, state, _ = opt.update(RoundRelease(grad=g, noise_variance=phi), state, params)
        assert state.step == t
        assert abs(_phi_hat(state, beta2).item() / phi - 1) < 1e-12, f"round {t}"


def test_snli_reference_noise_floor():
    # seed 001 §3: SNLI with B = 256, ζ = 0.1, σ = 0.4 quotes Φ = 2.441e-8
    sigma, clip, cohort = 0.4, 0.1, 256
    phi = (sigma * clip / cohort) ** 2
    assert f"{phi:.3e}" == "2.441e-08"
    # what an engine would pass: the privatizer's variance on the sum, divided by B²
    privatizer = Privatizer(None, noise_std=sigma * clip, dim=4, seed=0)
    assert math.isclose(privatizer.noise_variance(0) / cohort**2, phi, rel_tol=1e-12)
    opt = Adam(bias_correction=True)
    params = torch.zeros(4, dtype=F64)
    _, state, _ = opt.update(RoundRelease(grad=torch.ones(4, dtype=F64), noise_variance=phi), opt.init(params), params)
    assert math.isclose(_phi_hat(state, opt.beta2).item(), 2.441e-8, rel_tol=5e-4)


def test_bandmf_phi_hat_matches_monte_carlo_noise_floor_every_round():
    """E[ν̂_t] = ḡ² + Φ̂_t with Φ̂_t = b_t/(1−β₂ᵗ), b_t = β₂b_{t−1} + (1−β₂)Φ_t, Φ_t = Var(w_t)/B².

    Monte Carlo over d independent coordinates (the rows of Z are i.i.d.); per round the tolerance is
    5 standard errors of the coordinate mean of ν̂_t − ḡ² (estimated from the same sample).
    """
    rounds, bands, dim, cohort, noise_std, beta1, beta2 = 12, 4, 200_000, 16, 2.0, 0.9, 0.8
    strategy = toeplitz_strategy(sqrt_prefix_sum_coefs(bands), rounds)
    privatizer = Privatizer(strategy, noise_std=noise_std, dim=dim, seed=32, dtype=F64)
    gen = _gen(33)
    g_bar = 0.2 * torch.randn(dim, generator=gen, dtype=F64)  # constant true signal per coordinate
    opt = Adam(bias_correction=True, beta1=beta1, beta2=beta2, lr=0.01)
    params = torch.zeros(dim, dtype=F64)
    state = opt.init(params)
    # independent expectation of Φ_t from the dense inverse of C
    row_sq = torch.linalg.inv(strategy.dense()).square().sum(1)
    phis, mc_means, mc_ses, independent_ema = [], [], [], 0.0
    for t in range(1, rounds + 1):
        g_tilde = -private_average(-cohort * g_bar, privatizer, cohort)  # ḡ + w_t/B (up to sign of w)
        phi_t = privatizer.noise_variance() / cohort**2
        assert math.isclose(phi_t, (noise_std / cohort) ** 2 * row_sq[t - 1].item(), rel_tol=1e-10)
        _, state, _ = opt.update(RoundRelease(grad=g_tilde, noise_variance=phi_t), state, params)
        phi_hat = _phi_hat(state, beta2).item()
        independent_ema = beta2 * independent_ema + (1 - beta2) * phi_t
        assert math.isclose(phi_hat, independent_ema / (1 - beta2**t), rel_tol=1e-12)
        excess = state.nu / (1 - beta2**t) - g_bar.square()
        mean, se = excess.mean().item(), excess.std().item() / math.sqrt(dim)
        assert abs(mean - phi_hat) <= 5 * se, f"round {t}: MC {mean:.5g} ± {se:.2g}, Φ̂ {phi_hat:.5g}"
        phis.append(phi_hat)
        mc_means.append(mean)
        mc_ses.append(se)
    # Φ̂_t really varies with t, far beyond the Monte Carlo resolution: a constant Φ (whichever) fails.
    spread = max(phis) - min(phis)
    assert spread > 20 * max(mc_ses)
    for constant in ((noise_std / cohort) ** 2, phis[0], phis[-1], sum(phis) / len(phis)):
        assert any(abs(m - constant) > 5 * s for m, s in zip(mc_means, mc_ses))


def test_adambc_denominator_has_no_eps_outside_and_is_floored():
    lr, beta1, beta2, eps, floor = 0.1, 0.9, 0.99, 0.5, 1e-3  # a large ε: any ε in the BC path shows
    opt = Adam(lr=lr, beta1=beta1, beta2=beta2, eps=eps, bias_correction=True, bc_floor=floor)
    g1 = [0.3, -0.02, 1.5, 0.0]
    g2 = [0.1, 0.05, -2.0, 0.01]
    phi1, phi2 = 0.01, 0.04
    params = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    state = opt.init(params)
    step1, state, _ = opt.update(RoundRelease(grad=torch.tensor(g1, dtype=F64), noise_variance=phi1), state, params)
    step2, state, _ = opt.update(RoundRelease(grad=torch.tensor(g2, dtype=F64), noise_variance=phi2), state, params)
    for j in range(4):
        # t = 1: m̂ = g, ν̂ = g², Φ̂ = Φ₁
        expected1 = -lr * g1[j] / math.sqrt(max(g1[j] ** 2 - phi1, floor))
        m = beta1 * (1 - beta1) * g1[j] + (1 - beta1) * g2[j]
        nu = beta2 * (1 - beta2) * g1[j] ** 2 + (1 - beta2) * g2[j] ** 2
        b = beta2 * (1 - beta2) * phi1 + (1 - beta2) * phi2
        m_hat, nu_hat, phi_hat = m / (1 - beta1**2), nu / (1 - beta2**2), b / (1 - beta2**2)
        expected2 = -lr * m_hat / math.sqrt(max(nu_hat - phi_hat, floor))
        assert math.isclose(step1[j].item(), expected1, rel_tol=1e-12, abs_tol=1e-15), j
        assert math.isclose(step2[j].item(), expected2, rel_tol=1e-12, abs_tol=1e-15), j
    # coordinates 1 and 3 hit the floor γ (ν̂ − Φ̂ < γ) in round 1
    assert math.isclose(step1[1].item(), -lr * -0.02 / math.sqrt(floor), rel_tol=1e-12)


# =====================================================================================================
# 4. DP-AdamW-BC and AdaGrad-BC
# =====================================================================================================
def test_adamw_bc_is_decoupled_weight_decay_plus_bc_denominator():
    lr, beta1, beta2, wd, floor = 0.05, 0.8, 0.9, 0.2, 1e-6
    opt = make_optimizer("dp-adamw-bc", lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, bc_floor=floor, eps=0.3)
    theta = [1.0, -2.0, 0.5]
    grads = [[0.4, -0.1, 0.05], [0.2, 0.3, -0.6]]
    phis = [0.02, 0.005]
    params = torch.tensor(theta, dtype=F64)
    state = opt.init(params)
    m, nu, b = [0.0] * 3, [0.0] * 3, 0.0
    for t, (g, phi) in enumerate(zip(grads, phis), start=1):
        step, state, _ = opt.update(RoundRelease(grad=torch.tensor(g, dtype=F64), noise_variance=phi), state, params)
        b = beta2 * b + (1 - beta2) * phi
        for j in range(3):
            m[j] = beta1 * m[j] + (1 - beta1) * g[j]
            nu[j] = beta2 * nu[j] + (1 - beta2) * g[j] ** 2
            m_hat, nu_hat, phi_hat = m[j] / (1 - beta1**t), nu[j] / (1 - beta2**t), b / (1 - beta2**t)
            expected = -lr * (m_hat / math.sqrt(max(nu_hat - phi_hat, floor)) + wd * theta[j])
            assert math.isclose(step[j].item(), expected, rel_tol=1e-12), (t, j)
            theta[j] += expected
        params = params + step


def test_adagrad_bc_accumulates_noise_variances():
    lr, floor = 0.2, 1e-4
    opt = make_optimizer("dp-adagrad-bc", lr=lr, bc_floor=floor, eps=0.5)
    grads = [[0.5, -0.01, 2.0], [0.3, 0.02, -1.0], [-0.4, 0.0, 0.5]]
    phis = [0.05, 0.2, 0.1]  # a varying Φ_t: b_t must be their plain sum
    params = torch.zeros(3, dtype=F64)
    state = opt.init(params)
    G, b = [0.0] * 3, 0.0
    for t, (g, phi) in enumerate(zip(grads, phis), start=1):
        step, state, _ = opt.update(RoundRelease(grad=torch.tensor(g, dtype=F64), noise_variance=phi), state, params)
        b += phi
        assert math.isclose(state.phi.item(), b, rel_tol=1e-14)
        for j in range(3):
            G[j] += g[j] ** 2
            expected = -lr * g[j] / math.sqrt(max(G[j] - b, floor))
            assert math.isclose(step[j].item(), expected, rel_tol=1e-12, abs_tol=1e-15), (t, j)


# =====================================================================================================
# 5. Independent moment estimation in the optimizers
# =====================================================================================================
def test_adam_ime_uses_clamped_root_plus_eps_with_negative_second_moment():
    lr, beta1, beta2, eps = 0.1, 0.9, 0.99, 0.25
    opt = make_optimizer("dp-adam-ime", lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    g1, s1 = [0.3, -0.2, 0.1], [0.16, -0.05, 0.01]
    g2, s2 = [0.1, 0.4, -0.2], [0.04, -0.3, 0.02]
    params = torch.zeros(3, dtype=F64)
    state = opt.init(params)
    rel = lambda g, s: RoundRelease(grad=torch.tensor(g, dtype=F64), second_moment=torch.tensor(s, dtype=F64))
    step1, state, _ = opt.update(rel(g1, s1), state, params)
    step2, state, _ = opt.update(rel(g2, s2), state, params)
    for j in range(3):
        expected1 = -lr * g1[j] / (math.sqrt(max(s1[j], 0.0)) + eps)
        m_hat = (beta1 * (1 - beta1) * g1[j] + (1 - beta1) * g2[j]) / (1 - beta1**2)
        nu_hat = (beta2 * (1 - beta2) * s1[j] + (1 - beta2) * s2[j]) / (1 - beta2**2)
        expected2 = -lr * m_hat / (math.sqrt(max(nu_hat, 0.0)) + eps)
        assert math.isclose(step1[j].item(), expected1, rel_tol=1e-12), j
        assert math.isclose(step2[j].item(), expected2, rel_tol=1e-12), j
    assert bool(torch.isfinite(step2).all())
    # ν is built from ŝ, never from g̃²
    assert math.isclose(state.nu[1].item(), beta2 * (1 - beta2) * s1[1] + (1 - beta2) * s2[1], rel_tol=1e-12)


def test_adagrad_ime_uses_clamped_root_plus_eps():
    lr, eps = 0.1, 0.2
    opt = make_optimizer("dp-adagrad-ime", lr=lr, eps=eps)
    params = torch.zeros(2, dtype=F64)
    state = opt.init(params)
    g, s = [0.5, -0.3], [0.09, -0.4]
    step, state, _ = opt.update(
        RoundRelease(grad=torch.tensor(g, dtype=F64), second_moment=torch.tensor(s, dtype=F64)), state, params
    )
    for j in range(2):
        assert math.isclose(step[j].item(), -lr * g[j] / (math.sqrt(max(s[j], 0.0)) + eps), rel_tol=1e-12)


def test_ime_requires_the_second_moment():
    params = torch.zeros(3)
    for opt in (Adam(second_moment="independent"), AdaGrad(second_moment="independent")):
        with pytest.raises(ValueError, match="second_moment"):
            opt.update(RoundRelease(grad=torch.ones(3)), opt.init(params), params)


# =====================================================================================================
# 7. Noiseless-preconditioner baseline (simulation only)
# =====================================================================================================
NOISELESS_BUILDERS = [
    ("noiseless-adam", lambda: make_optimizer("noiseless-adam")),
    ("noiseless-adam-stp", lambda: make_optimizer("noiseless-adam-stp")),
    ("noiseless-adagrad", lambda: make_optimizer("noiseless-adagrad")),
    ("Adam(clean)", lambda: Adam(second_moment="clean")),
    ("Adam(clean, stp)", lambda: Adam(second_moment="clean", scale_then_privatize=True)),
    ("AdaGrad(clean)", lambda: AdaGrad(second_moment="clean")),
]


@pytest.mark.parametrize("label, build", NOISELESS_BUILDERS, ids=[n for n, _ in NOISELESS_BUILDERS])
def test_noiseless_baseline_only_in_simulation_and_reported_not_private(label, build):
    with pytest.raises(RuntimeError, match="NOT differentially private"):
        build()
    with simulation():
        opt = build()
    assert opt.private is False
    assert opt.needs.clean_aggregate is True
    assert reported_epsilon(3.0, opt.private) == "not private"
    # outside the context again: refused again (the context is restored)
    with pytest.raises(RuntimeError):
        build()


def test_reported_epsilon_is_the_number_for_private_optimizers():
    for name in OPTIMIZERS:
        if name.startswith("noiseless"):
            continue
        opt = make_optimizer(name)
        assert opt.private is True
        assert reported_epsilon(3.0, opt.private) == 3.0


@pytest.mark.parametrize("stp", [False, True])
def test_noiseless_adam_builds_nu_from_clean_grad_and_m_from_noisy(stp):
    lr, beta1, beta2, eps = 0.1, 0.9, 0.99, 1e-3
    with simulation():
        opt = Adam(lr=lr, beta1=beta1, beta2=beta2, eps=eps, second_moment="clean", scale_then_privatize=stp)
    params = torch.zeros(3, dtype=F64)
    state = opt.init(params)
    noisy1, clean1 = [0.5, -0.2, 0.05], [0.3, -0.1, 0.4]
    noisy2, clean2 = [0.1, 0.6, -0.3], [0.2, 0.2, -0.1]
    with pytest.raises(ValueError, match="clean_grad"):
        opt.update(RoundRelease(grad=torch.tensor(noisy1, dtype=F64)), state, params)
    rel = lambda g, c: RoundRelease(grad=torch.tensor(g, dtype=F64), clean_grad=torch.tensor(c, dtype=F64))
    step1, state, _ = opt.update(rel(noisy1, clean1), state, params)
    step2, state, _ = opt.update(rel(noisy2, clean2), state, params)
    for j in range(3):
        assert math.isclose(step1[j].item(), -lr * noisy1[j] / (abs(clean1[j]) + eps), rel_tol=1e-12)
        m_hat = (beta1 * (1 - beta1) * noisy1[j] + (1 - beta1) * noisy2[j]) / (1 - beta1**2)
        nu_hat = (beta2 * (1 - beta2) * clean1[j] ** 2 + (1 - beta2) * clean2[j] ** 2) / (1 - beta2**2)
        assert math.isclose(step2[j].item(), -lr * m_hat / (math.sqrt(nu_hat) + eps), rel_tol=1e-12)
    if stp:  # the broadcast scale comes from the clean ν
        nu_hat = state.nu / (1 - beta2**2)
        assert torch.allclose(opt.scale(state), 1 / (nu_hat.sqrt() + opt.stp_eps), rtol=1e-12, atol=0)


def test_noiseless_adagrad_builds_accumulator_from_clean_grad():
    with simulation():
        opt = AdaGrad(lr=0.1, eps=1e-3, second_moment="clean")
    params = torch.zeros(2, dtype=F64)
    state = opt.init(params)
    with pytest.raises(ValueError, match="clean_grad"):
        opt.update(RoundRelease(grad=torch.ones(2, dtype=F64)), state, params)
    noisy, clean = [0.5, -0.4], [0.1, 0.3]
    step, state, _ = opt.update(
        RoundRelease(grad=torch.tensor(noisy, dtype=F64), clean_grad=torch.tensor(clean, dtype=F64)), state, params
    )
    for j in range(2):
        assert math.isclose(step[j].item(), -0.1 * noisy[j] / (abs(clean[j]) + 1e-3), rel_tol=1e-12)


# =====================================================================================================
# 8. RoundNeeds of every named variant
# =====================================================================================================
EXPECTED_NEEDS = {
    "dp-fedavg": RoundNeeds(),
    "dp-sgd": RoundNeeds(),
    "dp-sgdm": RoundNeeds(),
    "dp-adam": RoundNeeds(),
    "dp-adambc": RoundNeeds(noise_variance=True),
    "dp-adamw": RoundNeeds(),
    "dp-adamw-bc": RoundNeeds(noise_variance=True),
    "dp-adam-ime": RoundNeeds(squares=True),
    "dp-adam-stp": RoundNeeds(broadcast_scale=True),
    "noiseless-adam": RoundNeeds(clean_aggregate=True),
    "noiseless-adam-stp": RoundNeeds(broadcast_scale=True, clean_aggregate=True),
    "dp-adagrad": RoundNeeds(),
    "dp-adagrad-bc": RoundNeeds(noise_variance=True),
    "dp-adagrad-ime": RoundNeeds(squares=True),
    "noiseless-adagrad": RoundNeeds(clean_aggregate=True),
}


def test_every_named_variant_is_covered():
    assert set(OPTIMIZERS) == set(EXPECTED_NEEDS)


@pytest.mark.parametrize("name", sorted(EXPECTED_NEEDS))
def test_needs_of_named_variants(name):
    with simulation():
        opt = make_optimizer(name)
    assert opt.needs == EXPECTED_NEEDS[name]
    # broadcast_scale ⇔ scale() gives a tensor
    params = torch.zeros(4)
    assert (opt.scale(opt.init(params)) is not None) == EXPECTED_NEEDS[name].broadcast_scale


# =====================================================================================================
# 9. Validation
# =====================================================================================================
@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (Adam, {"beta1": 1.0}, "beta1"),
        (Adam, {"beta1": -0.1}, "beta1"),
        (Adam, {"beta2": 1.0}, "beta2"),
        (Adam, {"beta2": 1.5}, "beta2"),
        (SGD, {"momentum": 1.0}, "momentum"),
        (SGD, {"momentum": -0.5}, "momentum"),
        (SGD, {"lr": 0.0}, "lr"),
        (Adam, {"lr": 0.0}, "lr"),
        (Adam, {"lr": -1e-3}, "lr"),
        (AdaGrad, {"lr": -0.1}, "lr"),
        (Adam, {"eps": 0.0}, "eps"),
        (AdaGrad, {"eps": -1e-10}, "eps"),
        (Adam, {"bc_floor": 0.0}, "bc_floor"),
        (AdaGrad, {"bc_floor": -1.0}, "bc_floor"),
        (Adam, {"stp_eps": 0.0}, "stp_eps"),
        (Adam, {"ime_alpha": 0.0}, "ime_alpha"),
        (AdaGrad, {"ime_alpha": -2.0}, "ime_alpha"),
        (Adam, {"weight_decay": -0.01}, "weight_decay"),
        (Adam, {"lr": float("nan")}, "lr"),
        (Adam, {"second_moment": "exact"}, "second_moment"),
        (Adam, {"bias_correction": True, "second_moment": "independent"}, "bias_correction"),
        (Adam, {"bias_correction": True, "second_moment": "clean"}, "bias_correction"),
        (AdaGrad, {"bias_correction": True, "second_moment": "independent"}, "bias_correction"),
    ],
)
def test_invalid_hyper_parameters_raise_naming_the_field(cls, kwargs, field):
    with simulation(), pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_unknown_optimizer_name_and_hyper_parameter():
    with pytest.raises(ValueError, match="dp-lamb"):
        make_optimizer("dp-lamb")
    with pytest.raises(ValueError, match="nesterov"):
        make_optimizer("dp-sgdm", nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        make_optimizer("dp-adam", momentum=0.9)


@pytest.mark.parametrize("opt", [Adam(), AdaGrad()], ids=["adam", "adagrad"])
def test_noise_variance_given_then_missing_raises(opt):
    params = torch.zeros(3)
    state = opt.init(params)
    _, state, _ = opt.update(RoundRelease(grad=torch.ones(3), noise_variance=0.1), state, params)
    with pytest.raises(ValueError, match="noise_variance"):
        opt.update(RoundRelease(grad=torch.ones(3)), state, params)


@pytest.mark.parametrize("opt", [Adam(), AdaGrad()], ids=["adam", "adagrad"])
def test_noise_variance_must_start_in_round_one(opt):
    params = torch.zeros(3)
    state = opt.init(params)
    _, state, _ = opt.update(RoundRelease(grad=torch.ones(3)), state, params)
    with pytest.raises(ValueError, match="noise_variance"):
        opt.update(RoundRelease(grad=torch.ones(3), noise_variance=0.1), state, params)


@pytest.mark.parametrize("opt", [Adam(bias_correction=True), AdaGrad(bias_correction=True)], ids=["adam", "adagrad"])
def test_bias_correction_without_noise_variance_raises(opt):
    params = torch.zeros(3)
    with pytest.raises(ValueError, match="noise_variance"):
        opt.update(RoundRelease(grad=torch.ones(3)), opt.init(params), params)


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_invalid_noise_variance_value_raises(bad):
    opt = Adam(bias_correction=True)
    params = torch.zeros(3)
    with pytest.raises(ValueError, match="noise_variance"):
        opt.update(RoundRelease(grad=torch.ones(3), noise_variance=bad), opt.init(params), params)


@pytest.mark.parametrize("field", ["grad", "second_moment", "clean_grad"])
@pytest.mark.parametrize("name", ["dp-sgdm", "dp-adam", "dp-adam-ime", "noiseless-adam", "dp-adagrad"])
def test_release_shape_mismatch_raises(name, field):
    with simulation():
        opt = make_optimizer(name)
    params = torch.zeros(4)
    good = torch.ones(4)
    release = dict(grad=good, second_moment=good, clean_grad=good)
    release[field] = torch.ones(5)
    with pytest.raises(ValueError, match=field):
        opt.update(RoundRelease(**release), opt.init(params), params)


@pytest.mark.parametrize("phi_shape", [(5,), (4, 1)])
def test_noise_variance_vector_shape_mismatch_raises_value_error(phi_shape):
    opt = Adam(bias_correction=True)
    params = torch.zeros(4)
    try:
        step, _, _ = opt.update(RoundRelease(grad=torch.ones(4), noise_variance=torch.full(phi_shape, 0.1)),
                                opt.init(params), params)
    except ValueError:
        return
    assert step.shape == params.shape, f"a noise_variance of shape {phi_shape} gave a step of shape {tuple(step.shape)}"
    raise AssertionError("no ValueError for a noise_variance vector of the wrong shape")


# =====================================================================================================
# 10. State: step counter, independence, no in-place mutation
# =====================================================================================================
def _full_release(dim: int, gen: torch.Generator) -> RoundRelease:
    return RoundRelease(
        grad=torch.randn(dim, generator=gen, dtype=F64),
        second_moment=torch.rand(dim, generator=gen, dtype=F64),
        noise_variance=0.01,
        clean_grad=torch.randn(dim, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("name", sorted(EXPECTED_NEEDS))
def test_step_counter_lives_in_the_state_and_states_do_not_interact(name):
    with simulation():
        opt = make_optimizer(name, lr=0.1)
    dim = 6
    gen_a, gen_b = _gen(101), _gen(102)
    releases_a = [_full_release(dim, gen_a) for _ in range(4)]
    releases_b = [_full_release(dim, gen_b) for _ in range(4)]
    init = torch.linspace(-1, 1, dim, dtype=F64)

    def alone(releases):
        params, state, steps = init.clone(), opt.init(init), []
        for r in releases:
            step, state, _ = opt.update(r, state, params)
            params = params + step
            steps.append(step)
        return steps, state

    steps_a, final_a = alone(releases_a)
    steps_b, _ = alone(releases_b)
    # interleaved with one optimizer object and two states: identical to running each alone
    pa, pb, sa, sb = init.clone(), init.clone(), opt.init(init), opt.init(init)
    assert sa.step == 0
    for t, (ra, rb) in enumerate(zip(releases_a, releases_b), start=1):
        step_a, sa, _ = opt.update(ra, sa, pa)
        step_b, sb, _ = opt.update(rb, sb, pb)
        pa, pb = pa + step_a, pb + step_b
        assert sa.step == t and sb.step == t
        assert torch.equal(step_a, steps_a[t - 1]) and torch.equal(step_b, steps_b[t - 1])
    assert final_a.step == 4
    assert not torch.equal(steps_a[-1], steps_b[-1])


@pytest.mark.parametrize("name", sorted(EXPECTED_NEEDS))
def test_update_does_not_mutate_inputs(name):
    with simulation():
        opt = make_optimizer(name, lr=0.1)
    dim = 6
    gen = _gen(103)
    params = torch.randn(dim, generator=gen, dtype=F64)
    state = opt.init(params)
    for _ in range(2):  # non-zero state tensors before the checked call
        step, state, _ = opt.update(_full_release(dim, gen), state, params)
        params = params + step
    release = _full_release(dim, gen)
    snapshot = lambda x: None if x is None else x.clone()
    before_state = [snapshot(v) if isinstance(v, torch.Tensor) else v for v in state]
    before_params = params.clone()
    before_release = [snapshot(getattr(release, f)) for f in ("grad", "second_moment", "clean_grad")]
    step, new_state, _ = opt.update(release, state, params)
    assert torch.equal(params, before_params)
    for old, now in zip(before_state, state):
        if isinstance(old, torch.Tensor):
            assert torch.equal(old, now)
        else:
            assert old == now
    for old, f in zip(before_release, ("grad", "second_moment", "clean_grad")):
        assert torch.equal(old, getattr(release, f))
    assert new_state.step == state.step + 1
    # the new state does not alias the old one's storage
    for old, new in zip(state[1:], new_state[1:]):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            assert old.data_ptr() != new.data_ptr()


# =====================================================================================================
# DP-AdamBC's default floor γ = Φ̂_t (the noise floor itself), scalar and per-coordinate (STP)
# =====================================================================================================
def test_adambc_default_floor_is_the_noise_variance_estimate():
    """One step from zero state: m̂ = g, ν̂ = g², Φ̂ = Φ. Coordinates with ν̂ − Φ̂ below Φ̂ are divided by
    sqrt(Φ̂); the others by sqrt(ν̂ − Φ̂) (closed form, no ε). A floor of 1e-8 would divide by 1e-4 instead."""
    lr, phi = 0.1, 1.0
    g = torch.tensor([0.1, 1.2, 3.0], dtype=F64)
    params = torch.zeros(3, dtype=F64)
    opt = Adam(bias_correction=True, lr=lr)
    assert opt.bc_floor is None
    step, _, _ = opt.update(RoundRelease(grad=g, noise_variance=phi), opt.init(params), params)
    denominator = torch.tensor([math.sqrt(phi), math.sqrt(max(1.44 - phi, phi)), math.sqrt(9.0 - phi)], dtype=F64)
    torch.testing.assert_close(step, -lr * g / denominator, rtol=1e-12, atol=0)
    fixed, _, _ = Adam(bias_correction=True, lr=lr, bc_floor=1e-8).update(
        RoundRelease(grad=g, noise_variance=phi), opt.init(params), params)
    assert abs(fixed[0].item()) == pytest.approx(lr * 0.1 / 1e-4)  # what the default protects against


def test_adambc_default_floor_follows_a_per_coordinate_noise_variance():
    """Scale-then-privatize hands Φ_t per coordinate; the default floor is then per coordinate too."""
    lr = 0.5
    g = torch.tensor([0.2, 0.2], dtype=F64)
    phi = torch.tensor([0.01, 4.0], dtype=F64)
    params = torch.zeros(2, dtype=F64)
    opt = Adam(bias_correction=True, lr=lr)
    step, _, _ = opt.update(RoundRelease(grad=g, noise_variance=phi), opt.init(params), params)
    expected = -lr * g / torch.sqrt(torch.maximum(g.square() - phi, phi))
    torch.testing.assert_close(step, expected, rtol=1e-12, atol=0)
