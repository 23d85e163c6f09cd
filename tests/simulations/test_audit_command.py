"""`fed-dp audit` on the in-process engine: it has power (no noise, and a mechanism with 4× less noise than it
accounts for, are caught, by the mechanism test at accounted ε = 4 and 8) and is sound (with the real mechanism
its lower bound stays below the accounted ε and neither test flags it). Its canaries are trained by the clients
by default; tests/simulations/test_audit_clip.py plants a skipped clip in each client path."""

from __future__ import annotations

import json
import math

import torch

import pytest

from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.audit import mechanism_test_power
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.audit import run_audit
from fed_dp.simulations.tasks.builtin import heavy_tail_task
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


SMALL = heavy_tail_task(dim=100)  # d = 700 parameters: room for 300 canaries; 40 users


def _mechanism_audit(epsilon: float, seed: int, noise_scale: float = 1.0):
    """Mechanism only, 40 users + about 150 inserted canaries, B = 95 (q ≈ 0.5), T = 5, RDP-calibrated σ."""
    privacy = PrivacyConfig(expected_cohort=95, rounds=5, target_epsilon=epsilon, delta=1e-5, accountant="rdp")
    return run_audit(SMALL, privacy, make_optimizer("dp-fedavg"), LOCAL, canaries=300, seed=seed,
                     mechanism_only=True, noise_scale=noise_scale)


@pytest.mark.parametrize("epsilon", [4.0, 8.0])
def test_the_mechanism_test_flags_four_times_too_little_noise_and_passes_the_real_mechanism(epsilon):
    """Issue 25 item 1: at accounted ε = 4 and 8, above the lower bound's cap (2.25 for 300 canaries at δ = 1e-5 and
    the corrected 98.75%), the lower bound is inconclusive, while the hypothesis test decides. Its power from the
    exact law (fed_dp.audit.mechanism_test_power) against 4× too little noise is above 1 − 1e-9 for every seed,
    so a seed misses it with probability below 1e-9: every seed is flagged, p < 1e-6. An honest run gets any of
    the audit's four verdicts with probability at most 5% (Bonferroni, each at 1.25%; the laws are exact:
    tests/fed_dp/test_audit_statistics.py checks the rates by Monte Carlo); the seeds are fixed, so the outcome is
    deterministic (mechanism test p = 0.195, 0.968, 0.078 at ε = 4 and 0.226, 0.983, 0.054 at ε = 8; clip test
    p = 0.325, 1, 0.447 and 0.300, 1, 0.412)."""
    for seed in (0, 1, 2):
        honest = _mechanism_audit(epsilon, seed)
        assert honest.epsilon_accounted == pytest.approx(epsilon, rel=1e-3)
        assert honest.verdicts == 4 and honest.verdict_confidence == pytest.approx(0.9875)
        assert honest.epsilon_accounted >= honest.lower_bound_cap
        for values in honest.results.values():
            assert values["lower_bound_verdict"] == "inconclusive"
        test = honest.mechanism_test
        assert test["verdict"] == honest.clip_test["verdict"] == "consistent" and test["p_value"] > 0.0125
        assert test["held_out_spread"] == pytest.approx(1.0, abs=0.25)  # the accounted noise, measured
        law = {"noise_multiplier": honest.privacy.noise_multiplier, "rounds": 5,
               "sampling_rate": honest.privacy.sampling_rate, "confidence": honest.verdict_confidence}
        groups = (honest.inserted, honest.canaries - honest.inserted)
        assert mechanism_test_power(*groups, **law, noise_scale=0.25) > 1 - 1e-9
        assert test["power_half_noise"] == pytest.approx(mechanism_test_power(*groups, **law, noise_scale=0.5))
        assert 0.5 < test["noise_scale_80"] < 0.8
        broken = _mechanism_audit(epsilon, seed, noise_scale=0.25)
        assert broken.epsilon_accounted == honest.epsilon_accounted  # the accounting still claims the full noise
        test = broken.mechanism_test
        assert test["verdict"] == "leaks more than accounted at confidence 98.75%" and test["p_value"] < 1e-6
        assert test["mu"] > 3 * test["mu_expected"] and test["held_out_spread"] == pytest.approx(0.25, abs=0.07)


def test_the_tests_run_with_training_on_trained_canaries_only():
    """Trained canaries live on coordinates the real users' training leaves at 0: with training the tests keep
    their exact law and run. Injected canaries are in the model's own coordinates, where training's drift
    enters: not tested, and then the family is the two lower bounds (each at 97.5%)."""
    privacy = PrivacyConfig(expected_cohort=95, rounds=2, target_epsilon=4.0, delta=1e-5, accountant="rdp")
    trained = run_audit(SMALL, privacy, make_optimizer("dp-fedavg"), LOCAL, canaries=300, seed=0)
    assert trained.mode == "with training" and trained.canary_kind == "trained"
    assert trained.mechanism_test["verdict"] == trained.clip_test["verdict"] == "consistent"
    assert trained.mechanism_test["held_out_spread"] == pytest.approx(1.0, abs=0.25)
    injected = run_audit(SMALL, privacy, make_optimizer("dp-fedavg"), LOCAL, canaries=300, seed=0,
                         canary_kind="injected")
    assert injected.mechanism_test["verdict"] == injected.clip_test["verdict"] == "not tested"
    assert "drift" in injected.mechanism_test["reason"] and injected.mechanism_test["held_out_spread"] > 0
    assert injected.verdicts == 2 and injected.verdict_confidence == pytest.approx(0.975)


def test_without_noise_there_is_nothing_to_test_against():
    privacy = PrivacyConfig(expected_cohort=95, rounds=2, target_epsilon=4.0, delta=1e-5, accountant="rdp")
    noiseless = run_audit(SMALL, privacy, make_optimizer("dp-fedavg"), LOCAL, canaries=300, mechanism_only=True,
                          no_noise=True)
    assert noiseless.mechanism_test["verdict"] == "not tested" and "infinite" in noiseless.mechanism_test["reason"]
    for values in noiseless.results.values():  # ε = ∞ is above any cap
        assert values["lower_bound_verdict"] == "inconclusive"
    json.dumps(noiseless.rows(), allow_nan=False)  # strict JSON: the infinite ε is null
    assert noiseless.rows()[0]["epsilon_accounted"] is None


@pytest.mark.parametrize("options, message", [
    ({"noise_scale": -1.0}, "noise_scale"),
    ({"canary_kind": "planted"}, "canary_kind must be one of trained, injected"),
    ({"canary_norm": 0.5}, "canary_norm must be a finite number >= 1"),
    ({"optimizer": "dp-adam-stp"}, "trained canaries cannot audit scale-then-privatize"),
])
def test_bad_audit_arguments_are_refused(options, message):
    privacy = PrivacyConfig(expected_cohort=95, rounds=2, target_epsilon=4.0, delta=1e-5, accountant="rdp")
    optimizer = make_optimizer(options.pop("optimizer", "dp-fedavg"))
    with pytest.raises(ValueError, match=message):
        run_audit(SMALL, privacy, optimizer, LOCAL, canaries=300, **options)


def test_the_canaries_are_orthonormal():
    """The mechanism test's law needs ⟨c_i, c_j⟩ = [i = j] (fed_dp.audit.mechanism_test)."""
    from fed_dp.simulations.audit import _canary_directions

    directions = _canary_directions(50, 120, seed=3).double()
    assert torch.allclose(directions @ directions.T, torch.eye(50, dtype=torch.float64), atol=1e-6)


def test_the_command_prints_one_json_object_per_threat_model(tmp_path, capsys):
    sets = ["task.dim=100", "task.users=40", "privacy.expected-cohort=20", "privacy.rounds=2",
            'privacy.accountant="rdp"', "privacy.target-epsilon=4.0"]
    args = ["audit", "--task", "fed_dp.simulations.tasks.builtin:heavy_tail_task", "--canaries", "100", "--json",
            "--out", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    assert cli_main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["threat_model"] for r in rows] == ["final-model", "all-iterates"]
    for row in rows:
        assert {"epsilon_accounted", "epsilon_estimate", "epsilon_lower_bound", "canaries", "threat_model",
                "lower_bound_cap", "lower_bound_verdict", "mechanism_test", "mode"} <= set(row)
        assert row["canaries"] == 100 and row["epsilon_accounted"] <= 4.0 and row["mode"] == "mechanism-only"
        assert {"mu", "mu_expected", "p_value", "verdict"} <= set(row["mechanism_test"])
    assert (tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_noise_multiplier_zero_is_a_labelled_non_private_baseline_and_audits_as_no_noise(capsys, tmp_path):
    sets = ["--set", "privacy.noise-multiplier=0", "--set", "task.dim=100", "--set", "privacy.rounds=1",
            "--set", "privacy.expected-cohort=10", "--set", 'privacy.accountant="rdp"']
    task = ["--task", "fed_dp.simulations.tasks.builtin:heavy_tail_task"]
    # issue 27 item 4: simulate takes σ = 0 too (it refused it before), and labels the run non-private
    assert cli_main(["simulate", *task, *sets, "--quiet", "--no-plot", "--out", str(tmp_path / "sim")]) == 0
    assert "not private" in capsys.readouterr().out
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert all(row["non_private"] is True and row["epsilon"] == "not private" for row in summary)
    assert cli_main(["audit", *task, *sets, "--canaries", "100", "--threat-model", "final-model"]) == 0
    printed = capsys.readouterr().out
    assert "no noise" in printed and "inf" in printed and "inconclusive" in printed
    assert cli_main(["audit", *task, *sets, "--canaries", "100", "--json"]) == 0
    for line in capsys.readouterr().out.splitlines():  # strict JSON (no Infinity): ε = ∞ is null
        assert json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}"))[
            "epsilon_accounted"] is None


def test_a_model_too_small_for_injected_canaries_is_refused():
    """Injected canaries are directions of the model's own d parameters (d ≥ 2m); trained ones have their own."""
    with pytest.raises(ValueError, match="at least 2 × canaries parameters"):
        run_audit(heavy_tail_task(), PRIVACY, make_optimizer("dp-fedavg"), LOCAL, canaries=1000, canary_kind="injected")


@pytest.mark.parametrize("setting, refused", [
    ('server.checkpoint-dir="ckpt"', "server.checkpoint-dir has no effect in fed-dp audit"),
    ("server.max-empty-rounds=3", "server.max-empty-rounds has no effect in fed-dp audit"),
    ('server.noise-source="secure"', "server.noise-source has no effect in fed-dp audit"),
    ("server.min-nodes=2", "server.min-nodes has no effect in fed-dp audit"),
    ("adaptive.enabled=true", "adaptive clipping"),
])
def test_config_keys_the_audit_does_not_act_on_are_refused(setting, refused, capsys):
    """Every key either acts in `fed-dp audit` or is refused there with the reason (issue 25, item 6)."""
    sets = ["--set", "task.dim=100", "--set", "privacy.rounds=1", "--set", "privacy.expected-cohort=10",
            "--set", "privacy.noise-multiplier=1.0", "--set", setting]
    with pytest.raises(SystemExit) as stopped:
        cli_main(["audit", "--task", "fed_dp.simulations.tasks.builtin:heavy_tail_task", *sets, "--canaries", "20"])
    assert stopped.value.code == 2 and refused in capsys.readouterr().err


def test_a_dataset_that_is_not_there_is_one_line_saying_where_to_put_it(tmp_path, capsys):
    """As `fed-dp simulate` does: exit 2 and the loader's message (which folder, what to put there), no traceback."""
    with pytest.raises(SystemExit) as stopped:
        cli_main(["audit", "--config", "femnist", "--set", f"task.root={json.dumps(str(tmp_path / 'none'))}",
                  "--set", "privacy.rounds=1", "--canaries", "20"])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and error.count("\n") == 1, error
    assert "building the task: FileNotFoundError" in error and str(tmp_path / "none") in error
