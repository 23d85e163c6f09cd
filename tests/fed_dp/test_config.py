"""PrivacyConfig: every invalid field or combination is refused with a message naming it."""

from __future__ import annotations

import dataclasses

import pytest

from fed_dp.config import PrivacyConfig

BASE = dict(num_users=1000, expected_cohort=10, rounds=50, noise_multiplier=1.0, delta=1e-5)


def make(**changes) -> PrivacyConfig:
    return PrivacyConfig(**{**BASE, **changes})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_users": 0}, "num_users"),
        ({"expected_cohort": 2000}, "expected_cohort"),
        ({"rounds": 1.5}, "rounds"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),  # 0 is the non-private baseline (test_non_private)
        ({"noise_multiplier": float("inf")}, "noise_multiplier"),
        ({"noise_multiplier": 0.0, "epsilon_budget": 4.0}, "no privacy"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"epsilon_budget": 0.0}, "epsilon_budget"),
        ({"sampler": "uniform"}, "sampler must be one of"),
        ({"accountant": "gdp"}, "accountant must be one of"),
        ({"noise": "laplace"}, "noise must be one of"),
        ({"noise": "bandmf", "bands": 4}, "cyclic-poisson or min-sep"),
        ({"noise": "bandmf", "sampler": "all", "expected_cohort": 1000, "bands": 4}, "minimum separation"),
        ({"bands": 4}, "bands = 4 has no meaning"),
        ({"sampler": "all"}, "expected_cohort must equal num_users"),
        ({"sampler": "without-replacement"}, "accountant 'rdp'"),
        ({"sampler": "cyclic-poisson", "bands": 200}, "q_b"),
        ({"sampler": "min-sep", "expected_cohort": 100, "bands": 20}, "min-separation"),
        ({"sampler": "min-sep", "rounds": 250, "max_participations": 2}, "under-count"),
        ({"max_participations": 3}, "only applies to sampler 'min-sep'"),
        ({"momentum": 0.9}, "workload"),
        ({"momentum": 1.0}, "momentum"),
        ({"workload": "momentum", "momentum": 0.9}, "only applies to noise 'bandmf'"),
        ({"noise": "blt", "buffers": 4}, "cyclic-poisson or min-sep"),
        ({"noise": "blt", "sampler": "min-sep"}, "needs buffers"),
        ({"noise": "blt", "sampler": "min-sep", "buffers": 0}, "needs buffers"),
        ({"noise": "blt", "sampler": "min-sep", "buffers": 17}, "needs buffers"),
        ({"noise": "blt", "sampler": "min-sep", "buffers": 2.0}, "needs buffers"),
        ({"noise": "bandmf", "sampler": "min-sep", "buffers": 4}, "only applies to noise 'blt'"),
        ({"buffers": 4}, "only applies to noise 'blt'"),
    ],
)
def test_invalid_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        make(**changes)


def test_config_is_frozen_and_replace_revalidates():
    config = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rounds = 3  # type: ignore[misc]
    assert config.replace(rounds=3).rounds == 3
    with pytest.raises(ValueError, match="rounds"):
        config.replace(rounds=0)
    with pytest.raises(ValueError, match="unknown"):
        config.replace(round=3)


def test_derived_rates_and_participations():
    assert make().sampling_rate == pytest.approx(10 / 1000)
    cyclic = make(sampler="cyclic-poisson", noise="bandmf", bands=5)
    assert cyclic.sampling_rate == pytest.approx(10 * 5 / 1000)
    assert cyclic.min_separation == 5 and cyclic.participations() == 10 and cyclic.participations(11) == 3
    minsep = make(sampler="min-sep", noise="bandmf", bands=8)  # m = 1000 // 10 = 100 groups
    assert minsep.min_separation == 100 and minsep.participations() == 1
    assert make(sampler="min-sep", rounds=250).participations() == 3
    assert make(sampler="min-sep", rounds=250, max_participations=5).participations() == 5
    assert make().participations() == 50


def test_to_dict_round_trips():
    config = make(sampler="cyclic-poisson", noise="bandmf", bands=5, workload="momentum", momentum=0.9)
    assert PrivacyConfig(**config.to_dict()) == config
    blt = make(sampler="min-sep", noise="blt", buffers=3, workload="momentum", momentum=0.5)
    assert PrivacyConfig(**blt.to_dict()) == blt and blt.workload_momentum == 0.5
    assert make(sampler="cyclic-poisson", noise="blt", buffers=1, bands=5).workload_momentum == 0.0


# --- target ε, the task's population, and resolution -------------------------------------------------------
def test_give_exactly_one_of_sigma_and_target_epsilon():
    from fed_dp.config import PrivacyConfig

    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        PrivacyConfig(expected_cohort=5, rounds=3, delta=1e-5)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        PrivacyConfig(expected_cohort=5, rounds=3, delta=1e-5, noise_multiplier=1.0, target_epsilon=2.0)
    with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
        PrivacyConfig(expected_cohort=5, rounds=3, delta=1e-5, target_epsilon=-1.0)


def test_an_unresolved_config_cannot_drive_a_sampler_noise_or_accounting():
    from fed_dp.accounting import PrivacyLedger, epsilon
    from fed_dp.config import PrivacyConfig
    from fed_dp.noise import make_privatizer
    from fed_dp.sampling import make_sampler

    partial = PrivacyConfig(expected_cohort=5, rounds=3, delta=1e-5, target_epsilon=2.0)
    assert not partial.resolved
    for use in (lambda: make_sampler(partial), lambda: make_privatizer(partial, 4), lambda: epsilon(partial),
                lambda: PrivacyLedger(partial)):
        with pytest.raises(ValueError, match="resolve_privacy"):
            use()


def test_resolve_fills_the_population_and_calibrates_in_one_step():
    from fed_dp.accounting import calibrate_noise_multiplier, epsilon, resolve_privacy
    from fed_dp.config import PrivacyConfig

    partial = PrivacyConfig(expected_cohort=5, rounds=20, delta=1e-5, target_epsilon=2.0, accountant="rdp")
    resolved = resolve_privacy(partial, 100)
    assert resolved.num_users == 100 and resolved.target_epsilon is None and resolved.resolved
    # the σ of one step is the σ of the two-step route (placeholder σ, then calibrate)
    two_steps = calibrate_noise_multiplier(partial.replace(num_users=100, target_epsilon=None, noise_multiplier=1.0), 2.0)
    assert resolved.noise_multiplier == two_steps
    assert epsilon(resolved) <= 2.0 < epsilon(resolved.replace(noise_multiplier=resolved.noise_multiplier * 0.99))
    with pytest.raises(ValueError, match="task has 50 users"):
        resolve_privacy(resolved, 50)
    with pytest.raises(ValueError, match="population size is unknown"):
        resolve_privacy(partial)
    with pytest.raises(ValueError, match="must be <= num_users"):
        resolve_privacy(partial, 3)  # B = 5 > N = 3: checked once N is known
    assert resolve_privacy(resolved) is resolved


def test_local_training_checks():
    from fed_dp.config import LocalTraining

    for bad, message in (({"epochs": 0}, "epochs"), ({"steps": 0}, "steps"), ({"steps": 2, "epochs": 2}, "not both"),
                         ({"momentum": 1.0}, "momentum"), ({"weight_decay": -0.1}, "weight_decay"),
                         ({"max_examples": 0}, "max_examples"), ({"lr": float("nan")}, "lr")):
        with pytest.raises(ValueError, match=message):
            LocalTraining(**bad)
