"""fed_dp.plan.RunPlan: one run as an engine executes it, built from a run configuration or keywords and validated once."""

from __future__ import annotations

import pytest

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import ServerOptimizer, make_optimizer
from fed_dp.plan import RunPlan
from fed_dp.run_config import RunConfig

PRIVACY = PrivacyConfig(num_users=100, expected_cohort=10, rounds=4, noise_multiplier=1.0, delta=1e-4)


def _plan(**changes) -> RunPlan:
    return RunPlan(**{"privacy": PRIVACY, "optimizer": make_optimizer("dp-adam"), "noise_source": "torch", **changes})


@pytest.mark.parametrize("changes, message", [
    ({"privacy": "epsilon 3"}, "privacy must be a fed_dp PrivacyConfig, got str"),
    ({"optimizer": "dp-adam"}, "optimizer must be a name or a fed_dp ServerOptimizer, got str"),
    ({"local": {"lr": 0.1}}, "local must be a fed_dp LocalTraining, got dict"),
    ({"adaptive_clipping": 0.5}, "adaptive_clipping must be a fed_dp AdaptiveClipConfig or None, got float"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"training_seed": 2**64}, "training_seed must be an integer >= 0"),
    ({"noise_source": "auto"}, "noise_source must be torch or secure .*resolve_noise_source.*'auto'"),
    ({"checkpoint_dir": 3}, "checkpoint_dir must be a folder name or None, got 3"),
    ({"eval_every": -1}, "eval_every must be an integer >= 0, got -1"),
    ({"eval_every": True}, "eval_every must be an integer >= 0, got True"),
    ({"max_empty_rounds": 0}, "max_empty_rounds must be an integer >= 1, got 0"),
])
def test_a_plan_refuses_each_bad_part_naming_it(changes, message):
    with pytest.raises(ValueError, match=message):
        _plan(**changes)


def test_a_plan_may_hold_a_privacy_configuration_that_is_not_resolved_yet():
    """N and σ are filled in once by the engine that runs the plan (the task's population, calibration)."""
    plan = _plan(privacy=PrivacyConfig(expected_cohort=10, rounds=4, target_epsilon=3.0, delta=1e-4))
    assert not plan.privacy.resolved and plan.local is None and plan.noise_source == "torch"


def test_a_plan_has_no_default_noise_source():
    """The source depends on the engine (a Flower run without a server seed: "secure"); a plan built without one
    must not fall back to torch's generator, which a deployment would then use for its noise."""
    with pytest.raises(TypeError, match="noise_source"):
        RunPlan(privacy=PRIVACY, optimizer=make_optimizer("dp-adam"))


def test_the_plan_of_a_run_configuration_builds_its_sections_once():
    run = RunConfig.from_tables({
        "privacy": {"expected-cohort": 10, "rounds": 4, "noise-multiplier": 1.0, "delta": 1e-4},
        "optimizer": {"name": "dp-sgdm", "lr": 0.5, "momentum": 0.8},
        "local": {"lr": 0.2, "batch-size": 4},
        "adaptive": {"enabled": True, "target-quantile": 0.6},
        "server": {"max-empty-rounds": 3, "noise-source": "auto"},
        "run": {"eval-every": 2, "seed": 7},
    })
    resolved = run.privacy.replace(num_users=100)
    plan = RunPlan.from_run_config(run, privacy=resolved, seed=11, training_seed=7, checkpoint_dir="ckpt",
                                   flower_run=False)
    assert plan.privacy is resolved and isinstance(plan.optimizer, ServerOptimizer)
    assert plan.optimizer.describe() == make_optimizer("dp-sgdm", lr=0.5, momentum=0.8).describe()
    assert plan.local == LocalTraining(lr=0.2, batch_size=4)
    assert plan.adaptive_clipping == AdaptiveClipConfig(target_quantile=0.6, initial_clip_norm=resolved.clip_norm)
    assert (plan.seed, plan.training_seed, plan.checkpoint_dir) == (11, 7, "ckpt")
    assert (plan.eval_every, plan.max_empty_rounds, plan.noise_source) == (2, 3, "torch")
    # "auto" is decided for the engine: a Flower run without a server seed draws secure noise
    flower = RunPlan.from_run_config(run, seed=None, training_seed=7, checkpoint_dir=None, flower_run=True)
    assert flower.noise_source == "secure" and flower.privacy is run.privacy
