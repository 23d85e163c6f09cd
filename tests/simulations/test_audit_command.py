"""`fed-dp audit` on the in-process engine: it has power (no noise, and a mechanism with 4× less noise than it
accounts for, are caught) and is sound (with the real mechanism its lower bound stays below the accounted ε)."""

from __future__ import annotations

import json
import math

import pytest

from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.audit import run_audit
from fed_dp.simulations.builtin_tasks import heavy_tail_task
from fed_dp.simulations.cli import main as cli_main

TASK = heavy_tail_task(dim=600)  # d = 600 · 7 = 4,200 parameters: room for 1,000 canary directions
LOCAL = LocalTraining(batch_size=2, lr=0.5)
PRIVACY = PrivacyConfig(expected_cohort=500, rounds=5, target_epsilon=1.5, delta=1e-5, accountant="rdp")


def _audit(seed: int, **options):
    return run_audit(TASK, PRIVACY, make_optimizer("dp-fedavg"), LOCAL, canaries=1000, seed=seed, **options)


def test_without_noise_the_audit_reports_a_large_epsilon():
    result = _audit(0, no_noise=True)
    assert math.isinf(result.epsilon_accounted)
    for values in result.results.values():
        assert values["epsilon_estimate"] > 10  # at δ = 1e-5 with 1,000 canaries
        assert values["epsilon_lower_bound"] > 3  # near the most 1,000 candidates can certify at 95%


def test_a_mechanism_with_four_times_less_noise_than_accounted_is_caught():
    result = _audit(0, noise_scale=0.25)
    assert result.epsilon_accounted == pytest.approx(1.5, abs=1e-3)
    assert result.results["final-model"]["epsilon_lower_bound"] > result.epsilon_accounted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_the_real_mechanism_the_lower_bound_stays_below_the_accounted_epsilon(seed):
    result = _audit(seed)
    assert result.inserted == int(result.inserted_mask.sum()) and 400 < result.inserted < 600
    assert result.privacy.num_users == TASK.num_users + result.inserted  # accounted as it ran
    for values in result.results.values():
        assert values["epsilon_lower_bound"] < result.epsilon_accounted


def test_mechanism_only_sees_the_canaries_through_the_noise_alone():
    """Real users send zero updates: the accounting is the run's, and without noise every canary is found."""
    result = _audit(0, mechanism_only=True)
    assert result.epsilon_accounted == pytest.approx(1.5, abs=1e-3)
    for values in result.results.values():
        assert values["epsilon_lower_bound"] < result.epsilon_accounted
    noiseless = _audit(0, mechanism_only=True, no_noise=True)
    assert noiseless.results["final-model"]["epsilon_lower_bound"] > 3


def test_the_command_prints_one_json_object_per_threat_model(tmp_path, capsys):
    sets = ["task.dim=100", "task.users=40", "privacy.expected-cohort=20", "privacy.rounds=2",
            'privacy.accountant="rdp"', "privacy.target-epsilon=4.0"]
    args = ["audit", "--task", "fed_dp.simulations.builtin_tasks:heavy_tail_task", "--canaries", "100", "--json",
            "--out", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    assert cli_main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["threat_model"] for r in rows] == ["final-model", "all-iterates"]
    for row in rows:
        assert {"epsilon_accounted", "epsilon_estimate", "epsilon_lower_bound", "canaries", "threat_model"} <= set(row)
        assert row["canaries"] == 100 and row["epsilon_accounted"] <= 4.0
    assert (tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_noise_multiplier_zero_only_in_the_audit(capsys):
    sets = ["--set", "privacy.noise-multiplier=0", "--set", "task.dim=100", "--set", "privacy.rounds=1",
            "--set", "privacy.expected-cohort=10", "--set", 'privacy.accountant="rdp"']
    task = ["--task", "fed_dp.simulations.builtin_tasks:heavy_tail_task"]
    with pytest.raises(SystemExit) as refused:
        cli_main(["simulate", *task, *sets, "--quiet", "--no-plot"])
    assert refused.value.code == 2 and "only `fed-dp audit` takes 0" in capsys.readouterr().err
    assert cli_main(["audit", *task, *sets, "--canaries", "100", "--threat-model", "final-model"]) == 0
    printed = capsys.readouterr().out
    assert "no noise" in printed and "inf" in printed


def test_a_model_too_small_for_the_canaries_is_refused():
    with pytest.raises(ValueError, match="at least 2 × canaries parameters"):
        run_audit(heavy_tail_task(), PRIVACY, make_optimizer("dp-fedavg"), LOCAL, canaries=1000)
