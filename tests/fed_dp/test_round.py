"""The one round: denominator, noise, validation of replies, accounting, resume — end to end on fed_dp."""

from __future__ import annotations

import io
import math

import pytest
import torch

from fed_dp.accounting import BudgetExceededError, epsilon
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import SGD, Adam, make_optimizer
from fed_dp.round import Contribution, begin_round, finish_round, init_server

DIM = 50


def _config(**changes) -> PrivacyConfig:
    base = dict(num_users=200, expected_cohort=20, rounds=8, noise_multiplier=1.0, clip_norm=1.0,
                delta=1e-5, accountant="rdp")
    return PrivacyConfig(**{**base, **changes})


def _unit_updates(n: int, dim: int, seed: int, norm: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    updates = torch.randn(n, dim, generator=g, dtype=torch.float64)
    return list(norm * updates / updates.norm(dim=1, keepdim=True))


def _honest_replies(plan, seed: int) -> list[Contribution]:
    """One reply per sampled user: its update clipped to ζ (norm exactly ζ here)."""
    return [Contribution(u, 1, source=f"user{i}") for i, u in
            enumerate(_unit_updates(plan.cohort.numel(), DIM, seed, plan.clip_norm))]


def test_fedavg_step_is_noisy_sum_over_fixed_B():
    """θ_1 − θ_0 = (Σu + w)/B; with replies from only some users the denominator is still B."""
    config = _config(noise_multiplier=1e-9)  # negligible noise: the sum is visible
    state = init_server(config, make_optimizer("dp-fedavg"), torch.zeros(DIM, dtype=torch.float64), seed=3)
    plan = begin_round(state)
    replies = _honest_replies(plan, seed=1)[:3]  # most sampled users dropped out
    new, metrics = finish_round(state, plan, replies)
    expected = sum(r.total for r in replies) / config.expected_cohort
    torch.testing.assert_close(new.params, expected, atol=1e-7, rtol=0)
    assert metrics["nonprivate"]["replied_users"] == 3


def test_noise_on_zero_updates_has_std_sigma_zeta_over_B():
    config = _config(noise_multiplier=2.0, clip_norm=0.5, expected_cohort=10, num_users=100)
    dim = 100_000
    state = init_server(config, make_optimizer("dp-fedavg"), torch.zeros(dim, dtype=torch.float64), seed=5)
    plan = begin_round(state)
    new, _ = finish_round(state, plan, [Contribution(torch.zeros(dim, dtype=torch.float64), plan.cohort.numel())])
    expected = 2.0 * 0.5 / 10
    assert abs(new.params.std().item() / expected - 1) < 5 / math.sqrt(2 * dim)


def test_an_oversized_contribution_is_reclipped_and_moves_the_model_by_at_most_zeta_over_B():
    config = _config(noise_multiplier=1e-9)
    state = init_server(config, SGD(lr=1.0), torch.zeros(DIM, dtype=torch.float64), seed=7)
    plan = begin_round(state)
    huge = torch.full((DIM,), 1e6, dtype=torch.float64)
    new, metrics = finish_round(state, plan, [Contribution(huge, 1, source="huge")])
    assert metrics["nonprivate"]["reclipped_replies"] == 1 and metrics["nonprivate"]["replied_users"] == 1
    moved = new.params.norm().item()
    assert config.clip_norm / config.expected_cohort * (1 - 1e-6) <= moved <= config.clip_norm / config.expected_cohort * (1 + 1e-6)


_NAN = torch.zeros(DIM, dtype=torch.float64)
_NAN[3] = float("nan")


@pytest.mark.parametrize("bad, reason", [
    (Contribution(_NAN, 1), "NaN"),
    (Contribution(torch.zeros(DIM + 1, dtype=torch.float64), 1), "shape"),
    (Contribution(torch.zeros(DIM, dtype=torch.int64), 1), "dtype"),
    (Contribution(torch.zeros(DIM, dtype=torch.float64), -1), "count"),
    ("not a contribution", "Contribution objects"),
])
def test_an_invalid_contribution_raises_and_leaves_the_state_untouched(bad, reason):
    """In-process callers hand finish_round Contribution objects; a malformed one is a programming error and
    raises (network replies are parsed, and dropped with a reason, before they become contributions)."""
    state = init_server(_config(), SGD(lr=1.0), torch.zeros(DIM, dtype=torch.float64), seed=7)
    plan = begin_round(state)
    with pytest.raises(ValueError, match=reason):
        finish_round(state, plan, [bad])
    assert state.round == 0 and state.ledger.rounds == 0 and torch.equal(state.params, torch.zeros(DIM, dtype=torch.float64))


def test_more_users_than_sampled_are_refused():
    state = init_server(_config(), SGD(), torch.zeros(DIM), seed=1)
    plan = begin_round(state)
    n = plan.cohort.numel()
    with pytest.raises(ValueError, match="more users"):
        finish_round(state, plan, [Contribution(torch.zeros(DIM), n), Contribution(torch.zeros(DIM), 1)])


def test_ledger_matches_dp_accounting_and_budget_refuses_the_next_round():
    config = _config(rounds=6)
    budget = (epsilon(config, 3) + epsilon(config, 4)) / 2
    config = config.replace(epsilon_budget=budget)
    state = init_server(config, SGD(), torch.zeros(DIM), seed=2)
    for t in range(3):
        plan = begin_round(state)
        state, metrics = finish_round(state, plan, [])  # everyone dropped: the round still counts in full
        assert metrics["epsilon"] == pytest.approx(epsilon(config, t + 1), rel=1e-12)
    sampled_before = state.sampler.rounds_sampled
    with pytest.raises(BudgetExceededError, match="budget"):
        begin_round(state)
    assert state.sampler.rounds_sampled == sampled_before  # refused before a cohort was drawn


BLT_CONFIG = dict(sampler="min-sep", noise="blt", buffers=3, num_users=200, expected_cohort=40, accountant="pld")


@pytest.mark.parametrize("name, noise", [("dp-fedavg", {}), ("dp-adambc", {}), ("dp-adam-ime", {}),
                                         ("dp-adambc", BLT_CONFIG), ("dp-adam-ime", BLT_CONFIG)])
def test_resume_from_checkpoint_reaches_the_same_model_and_ledger(name, noise, tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = _config(rounds=6, **noise)

    def run(state, rounds):
        for _ in range(rounds):
            plan = begin_round(state)
            replies = _honest_replies(plan, seed=100 + plan.round)
            if plan.send_squares:
                replies = [Contribution(r.total, 1, r.total.square()) for r in replies]
            state, _ = finish_round(state, plan, replies)
        return state

    params0 = torch.zeros(DIM, dtype=torch.float64)
    straight = run(init_server(config, make_optimizer(name, lr=0.1), params0, seed=11), 6)
    first = run(init_server(config, make_optimizer(name, lr=0.1), params0, seed=11), 3)
    buffer = io.BytesIO()
    torch.save((first.state_dict(), first.secret_state_dict()), buffer)
    buffer.seek(0)
    resumed = init_server(config, make_optimizer(name, lr=0.1), params0)  # fresh entropy seeds
    resumed.load_state_dict(*torch.load(buffer, weights_only=False))
    resumed = run(resumed, 3)
    assert torch.equal(resumed.params, straight.params)
    assert resumed.ledger.records == straight.ledger.records


def test_resume_refuses_another_configuration():
    state = init_server(_config(), SGD(), torch.zeros(DIM), seed=1)
    other = init_server(_config(noise_multiplier=2.0), SGD(), torch.zeros(DIM), seed=1)
    with pytest.raises(ValueError, match="configuration"):
        other.load_state_dict(state.state_dict(), state.secret_state_dict())


def test_ime_round_noises_both_moments_with_the_joint_sensitivity():
    config = _config(noise_multiplier=1.5, clip_norm=0.5, expected_cohort=10, num_users=100)
    optimizer = make_optimizer("dp-adam-ime", ime_alpha=2.0)
    dim = 40_000
    state = init_server(config, optimizer, torch.zeros(dim, dtype=torch.float64), seed=4)
    plan = begin_round(state)
    assert plan.send_squares
    zeros = torch.zeros(dim, dtype=torch.float64)
    _, metrics = finish_round(state, plan, [Contribution(zeros, 1, zeros)])
    delta = 0.5 * math.sqrt(1 + (2.0 * 0.5) ** 2)  # ζ·sqrt(1 + α²ζ²)
    # ν̂ after one step is ŝ = noise₂/B: its std is σΔ/(αB).
    # The optimizer reports quantiles of ν̂; for a centered Gaussian, q75 = 0.6745·std.
    expected_std = 1.5 * delta / (2.0 * 10)
    assert metrics["nu_hat_q75"] == pytest.approx(0.6745 * expected_std, rel=0.03)


def test_ime_reply_without_squares_is_refused():
    state = init_server(_config(), make_optimizer("dp-adam-ime"), torch.zeros(DIM), seed=1)
    plan = begin_round(state)
    with pytest.raises(ValueError, match="total_squares"):
        finish_round(state, plan, [Contribution(torch.zeros(DIM), 1)])


def test_stp_round_with_negligible_noise_matches_plain_adam():
    """Users clip s_t ⊙ Δ with a clip that never binds; after un-scaling the optimizer sees −ΣΔ/B."""
    config = _config(noise_multiplier=1e-18, clip_norm=1e6)  # σζ = 1e-12: noise far below the tolerance
    params0 = torch.zeros(DIM, dtype=torch.float64)
    stp = init_server(config, Adam(lr=0.05, scale_then_privatize=True, stp_eps=1e-2), params0, seed=9)
    plain = init_server(config, Adam(lr=0.05), params0, seed=9)
    for _ in range(5):
        plan_s, plan_p = begin_round(stp), begin_round(plain)
        assert torch.equal(plan_s.cohort, plan_p.cohort)
        deltas = _unit_updates(plan_s.cohort.numel(), DIM, seed=plan_s.round)
        stp, _ = finish_round(stp, plan_s, [Contribution(plan_s.scale * d, 1, scaled=True) for d in deltas])
        plain, _ = finish_round(plain, plan_p, [Contribution(d, 1) for d in deltas])
    torch.testing.assert_close(stp.params, plain.params, rtol=1e-6, atol=1e-9)


def test_noiseless_baseline_reports_not_private_and_alignment_only_in_simulation():
    with simulation():
        optimizer = make_optimizer("noiseless-adam")
        state = init_server(_config(), optimizer, torch.zeros(DIM, dtype=torch.float64), seed=1)
        plan = begin_round(state)
        _, metrics = finish_round(state, plan, _honest_replies(plan, seed=2))
    assert metrics["epsilon"] == "not private"
    assert 0 < metrics["nonprivate"]["alignment_ratio"] <= 1
    state = init_server(_config(), SGD(), torch.zeros(DIM, dtype=torch.float64), seed=1)
    plan = begin_round(state)
    _, metrics = finish_round(state, plan, _honest_replies(plan, seed=2))
    assert isinstance(metrics["epsilon"], float) and "alignment_ratio" not in metrics["nonprivate"]


def test_bandmf_round_uses_the_strategy_noise(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = _config(sampler="cyclic-poisson", noise="bandmf", bands=4, num_users=400)
    state = init_server(config, make_optimizer("dp-adambc"), torch.zeros(DIM), seed=1)
    assert state.privatizer.strategy is not None and state.privatizer.strategy.bands == 4
    for _ in range(3):
        plan = begin_round(state)
        state, metrics = finish_round(state, plan, _honest_replies(plan, seed=plan.round))
    assert metrics["epsilon"] == pytest.approx(epsilon(config, 3))


def test_blt_round_uses_the_configs_blt_noise_and_accounting(tmp_path, monkeypatch):
    from fed_dp.blt import BLTStrategy, config_strategy

    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = _config(sampler="cyclic-poisson", noise="blt", buffers=2, bands=4, num_users=400)
    state = init_server(config, make_optimizer("dp-adambc"), torch.zeros(DIM), seed=1)
    assert isinstance(state.privatizer.strategy, BLTStrategy) and state.privatizer.strategy == config_strategy(config)
    for t in range(3):
        plan = begin_round(state)
        state, metrics = finish_round(state, plan, _honest_replies(plan, seed=plan.round))
        assert metrics["epsilon"] == epsilon(config, t + 1)  # RDP: exact every round
    with pytest.raises(ValueError, match="adaptive clipping"):
        init_server(config, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1, adaptive_clipping=ADAPTIVE)


# --- adaptive clipping through the round ------------------------------------------------------------
from fed_dp.adaptive_clipping import AdaptiveClipConfig, update_noise_multiplier  # noqa: E402

ADAPTIVE = AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.2, bit_noise_std=0.3, initial_clip_norm=1.0)


def _adaptive_config(**changes) -> PrivacyConfig:
    return _config(**{"num_users": 1000, "expected_cohort": 100, "noise_multiplier": 0.5, **changes})


def test_adaptive_round_noise_uses_sigma_delta_times_the_current_clip_norm():
    dim = 100_000
    state = init_server(_adaptive_config(), make_optimizer("dp-fedavg"), torch.zeros(dim, dtype=torch.float64),
                        seed=1, adaptive_clipping=ADAPTIVE)
    plan = begin_round(state)
    assert plan.send_clip_bits and plan.clip_norm == 1.0
    zeros = torch.zeros(dim, dtype=torch.float64)
    new, metrics = finish_round(state, plan, [Contribution(zeros, plan.cohort.numel(), unclipped=plan.cohort.numel())])
    sigma_delta = (0.5**-2 - (2 * 0.3) ** -2) ** -0.5  # computed here, independently of the code
    assert sigma_delta == pytest.approx(update_noise_multiplier(0.5, 0.3))
    assert abs(new.params.std().item() / (sigma_delta * 1.0 / 100) - 1) < 5 / math.sqrt(2 * dim)
    assert metrics["epsilon"] == pytest.approx(epsilon(state.config, 1))  # accounting unchanged: σ of the config


@pytest.mark.parametrize("all_clipped, direction", [(True, 1), (False, -1)])
def test_clip_norm_moves_towards_the_target_quantile(all_clipped, direction):
    state = init_server(_adaptive_config(), make_optimizer("dp-fedavg"), torch.zeros(DIM, dtype=torch.float64),
                        seed=2, adaptive_clipping=ADAPTIVE)
    for _ in range(3):
        plan = begin_round(state)
        n = plan.cohort.numel()
        state, metrics = finish_round(state, plan, [Contribution(torch.zeros(DIM, dtype=torch.float64), n,
                                                                 unclipped=0 if all_clipped else n)])
        assert math.copysign(1, metrics["next_clip_norm"] - metrics["clip_norm"]) == direction


def test_adaptive_round_rejects_missing_or_impossible_clip_bits():
    state = init_server(_adaptive_config(), make_optimizer("dp-fedavg"), torch.zeros(DIM), seed=3,
                        adaptive_clipping=ADAPTIVE)
    plan = begin_round(state)
    with pytest.raises(ValueError, match="no clip bits"):
        finish_round(state, plan, [Contribution(torch.zeros(DIM), 2)])
    with pytest.raises(ValueError, match=r"not an integer in \[0, count"):
        finish_round(state, plan, [Contribution(torch.zeros(DIM), 2, unclipped=3)])


def test_adaptive_clipping_resumes_exactly_and_refuses_bandmf(tmp_path, monkeypatch):
    def run(state, rounds):
        for _ in range(rounds):
            plan = begin_round(state)
            n = plan.cohort.numel()
            state, _ = finish_round(state, plan, [Contribution(torch.zeros(DIM, dtype=torch.float64), n, unclipped=n // 3)])
        return state

    config = _adaptive_config(rounds=4)
    straight = run(init_server(config, make_optimizer("dp-sgd"), torch.zeros(DIM, dtype=torch.float64), seed=4,
                               adaptive_clipping=ADAPTIVE), 4)
    first = run(init_server(config, make_optimizer("dp-sgd"), torch.zeros(DIM, dtype=torch.float64), seed=4,
                            adaptive_clipping=ADAPTIVE), 2)
    resumed = init_server(config, make_optimizer("dp-sgd"), torch.zeros(DIM, dtype=torch.float64), adaptive_clipping=ADAPTIVE)
    resumed.load_state_dict(first.state_dict(), first.secret_state_dict())
    resumed = run(resumed, 2)
    assert resumed.clipper.clip_norm == straight.clipper.clip_norm and torch.equal(resumed.params, straight.params)
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    bandmf = _adaptive_config(sampler="cyclic-poisson", noise="bandmf", bands=2)
    with pytest.raises(ValueError, match="BandMF"):
        init_server(bandmf, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1, adaptive_clipping=ADAPTIVE)


def test_an_aggregating_exchange_runs_the_core_round_once_and_the_loop_runs_it_when_the_exchange_did_not():
    """run_rounds(exchange_aggregates=True), the Flower Strategy's path: the exchange may run the round's core step
    (finish_round) itself, once; a round whose exchange returns without it is aggregated by the loop, so every
    released round is noised and in the ledger exactly once."""
    from fed_dp.round_loop import RoundReplies, run_rounds

    config = PrivacyConfig(num_users=40, expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
    one_user = Contribution(torch.full((DIM,), 0.1), 1)

    def exchange(plan, aggregate):
        if plan.round == 0:  # aggregates itself, as UserLevelDP.aggregate_train does
            state, metrics = aggregate(RoundReplies([one_user]))
            assert state.round == 1 and "nonprivate" not in metrics
            assert metrics["epsilon"] == pytest.approx(epsilon(config, 1))
            with pytest.raises(RuntimeError, match="round 1 is already aggregated"):
                aggregate(RoundReplies([one_user]))
        return RoundReplies([one_user])

    loop = run_rounds(init_server(config, make_optimizer("dp-fedavg"), torch.zeros(DIM), seed=1), exchange,
                      exchange_aggregates=True, max_empty_rounds=10)
    assert loop.state.round == 3 and len(loop.state.ledger.records) == 3
    assert [r["epsilon"] for r in loop.records] == pytest.approx([epsilon(config, t) for t in (1, 2, 3)])
