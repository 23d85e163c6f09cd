"""A plan's contradictions are caught before round 1 (issue 40 items 3 and 4): a target ε above the ε budget, δ ≥ 1/N,
a budget that stops the run early or releases nothing, an ε too large to mean anything. Each is refused with a
ValueError naming the config key, or said in a WeakGuaranteeWarning, before anything trains."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fed_dp.accounting import (MEANINGLESS_EPSILON, PrivacyLedger, WeakGuaranteeWarning, BudgetExceededError,
                               epsilon, epsilon_schedule, rounds_within_budget)
from fed_dp.clients import losses
from fed_dp.clients.task import Task, Users
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.run_config import RunConfig
from fed_dp.simulations.engine.inprocess import train


def _task(users: int = 40) -> Task:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(users)]
    return Task(name="tiny", users=Users.in_memory(data), model=lambda: nn.Linear(6, 3), loss=losses.classification)


def _privacy(**changes) -> PrivacyConfig:
    return PrivacyConfig(**{**dict(expected_cohort=10, rounds=20, noise_multiplier=1.0, delta=1e-5, accountant="rdp"),
                            **changes})


def _weak(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, WeakGuaranteeWarning)]


def test_a_target_epsilon_above_the_budget_is_refused_naming_both_keys():
    """It spent ε 1.87 over 3 of 20 rounds and returned as if done; now the config itself is refused."""
    with pytest.raises(ValueError, match=r"target_epsilon = 4 is above epsilon_budget = 2: .*stop the run part-way"):
        PrivacyConfig(expected_cohort=10, rounds=20, target_epsilon=4, epsilon_budget=2, delta=1e-5)
    with pytest.raises(ValueError, match=r"privacy.target-epsilon = 4.0 is above privacy.epsilon-budget = 2.0"):
        RunConfig.from_tables({"privacy": {"target-epsilon": 4, "epsilon-budget": 2}})
    assert PrivacyConfig(expected_cohort=10, rounds=20, target_epsilon=2, epsilon_budget=2, delta=1e-5)


def test_a_delta_of_at_least_one_over_n_is_refused_before_round_1_unless_allowed():
    """δ = 0.1 with 40 users was accepted silently. It is refused once N is known (here: the task's, filled in by
    train), naming N and a δ that fits; with allow_large_delta the run goes ahead and warns, naming the population."""
    with pytest.raises(ValueError, match=r"privacy.delta = 0.1 is not below 1/N = 0.025 \(N = 40 users\).*about 4 "
                                         r"users' data.*e.g. 0.001.*privacy.allow-large-delta = true"):
        train(_task(), _privacy(delta=0.1), "dp-sgd", LocalTraining(), seed=0)
    with pytest.raises(ValueError, match=r"1/N = 0.025"):
        RunConfig.from_tables({"privacy": {"delta": 0.025, "num-users": 40, "expected-cohort": 10}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(_task(), _privacy(delta=0.1, allow_large_delta=True, rounds=2), "dp-sgd", LocalTraining(),
                       seed=0, eval_every=0)
    assert [r["round"] for r in result.records] == [1, 2]
    (message,) = _weak(caught)
    assert "delta = 0.1 is not below 1/N = 0.025 (N = 40 users), allowed by allow_large_delta" in message
    assert RunConfig.from_tables({"privacy": {"delta": 0.1, "allow-large-delta": True}}).privacy.allow_large_delta


def test_a_noise_multiplier_so_small_that_epsilon_means_nothing_is_warned_about():
    """σ = 1e-30 gave ε ≈ 10⁶¹ without a word; a sane σ gets no warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(_task(), _privacy(noise_multiplier=1e-30, rounds=2), "dp-sgd", LocalTraining(), seed=0, eval_every=0)
        train(_task(), _privacy(rounds=2), "dp-sgd", LocalTraining(), seed=0, eval_every=0)
    (message,) = _weak(caught)
    assert f"epsilon after 2 rounds is {epsilon(_privacy(noise_multiplier=1e-30, rounds=2, num_users=40)):.4g}" \
        in message and f"above {MEANINGLESS_EPSILON:g}" in message and "privacy.noise-multiplier" in message


def test_a_budget_that_stops_the_run_early_is_said_before_round_1_and_one_that_allows_no_round_is_refused(tmp_path):
    privacy = _privacy(num_users=40)
    budget = (epsilon(privacy, 5) + epsilon(privacy, 6)) / 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(_task(), privacy.replace(epsilon_budget=budget), "dp-sgd", LocalTraining(), seed=0,
                       eval_every=0)
    (message,) = _weak(caught)
    assert f"privacy.epsilon-budget) = {budget:g} stops this run after round 5 of 20" in message
    assert len(result.records) == 5 and "budget" in result.stopped  # what the warning said happened
    too_small = privacy.replace(epsilon_budget=epsilon(privacy, 1) / 2)
    with pytest.raises(ValueError, match=r"is below epsilon after round 1 .*could release no round at all"):
        train(_task(), too_small, "dp-sgd", LocalTraining(), seed=0, checkpoint_dir=str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_rounds_within_budget_are_those_the_ledger_releases_with_pld_between_its_exact_rounds():
    """With PLD the schedule between exact rounds is an upper bound; the ledger then decides on the exact ε, and so
    does the count of rounds the plan check announces."""
    config = PrivacyConfig(num_users=1000, expected_cohort=10, rounds=30, noise_multiplier=1.5, delta=1e-5)
    schedule = epsilon_schedule(config)
    between = next(t for t in range(2, 31) if t not in schedule.exact_rounds and epsilon(config, t) < schedule.at(t))
    for budget in ((epsilon(config, between) + schedule.at(between)) / 2, epsilon(config, 12) * (1 + 1e-9)):
        planned = config.replace(epsilon_budget=budget)
        ledger = PrivacyLedger(planned)
        with pytest.raises(BudgetExceededError):
            while True:
                ledger.record_round()
        assert rounds_within_budget(planned) == ledger.rounds
    assert rounds_within_budget(config) == 30
