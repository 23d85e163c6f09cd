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
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
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
