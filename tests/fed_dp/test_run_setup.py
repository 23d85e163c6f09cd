"""A resume continues the run it resumes (issue 40, item 11): a changed seed, learning rate, optimizer, local
training or model is refused before anything is resumed or released, naming each change with its recorded and its
new value; the same configuration resumes to the uninterrupted run, and an unseeded run resumes with the seed it
drew. Runs of the in-process engine (``fed_dp.train``, the round loop every engine runs) on a tiny task."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.checkpoint import load_checkpoint, recorded_run
from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.run_setup import check_resume, describe_run
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.experiments.runner import apply_overrides, load_config, run_experiment

PRIVACY = PrivacyConfig(num_users=24, expected_cohort=6, rounds=3, noise_multiplier=1.0, delta=1e-4, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)


class Stop(Exception):
    """Ends a run after its first round is published (its checkpoint folder then holds round 1)."""


def _stop_after_round_1(phase: str, round_number: int) -> None:
    if (phase, round_number) == ("published", 1):
        raise Stop


def _task(width: int = 5, frozen: bool = False) -> Task:
    g = torch.Generator().manual_seed(0)
    users = [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(24)]

    def model() -> nn.Module:
        net = nn.Sequential(nn.Linear(5, width), nn.Linear(width, 3))
        net[0].requires_grad_(not frozen)  # frozen: a randomly initialized layer, from the run's seed
        return net

    x, y = torch.cat([u[0] for u in users]), torch.cat([u[1] for u in users])
    return Task(name="tiny", users=Users.in_memory(users), model=model, loss=losses.classification,
                evaluate=evaluation.classification((x, y)))


def _interrupted(folder, **options) -> None:
    options = {"task": _task(), "optimizer": make_optimizer("dp-adam", lr=0.05), "local": LOCAL, "seed": 3, **options}
    with pytest.raises(Stop):
        train(options.pop("task"), PRIVACY, options.pop("optimizer"), options.pop("local"), checkpoint_dir=str(folder),
              on_phase=_stop_after_round_1, **options)


#: Changes of a resume, each with what its refusal must name.
CHANGES = [
    ({"optimizer": make_optimizer("dp-adam", lr=0.1)}, ["optimizer.lr: recorded 0.05, now 0.1"]),
    ({"optimizer": make_optimizer("dp-adambc", lr=0.05)}, ["optimizer.bias-correction: recorded False, now True"]),
    ({"optimizer": make_optimizer("dp-sgd")}, ["optimizer: recorded class='Adam'"]),
    ({"local": LocalTraining(batch_size=2, lr=0.2)}, ["local.lr: recorded 0.5, now 0.2"]),
    ({"seed": 4}, ["run.seed: recorded 3, now 4"]),
    ({"task": _task(width=7)}, ["the model: recorded 4 parameter tensors, now 4", "recorded 0.weight:5x5, now 0.weight:7x5"]),
    ({"seed": 4, "local": LocalTraining(batch_size=4, lr=0.5)}, ["local.batch-size: recorded 2, now 4",
                                                                 "run.seed: recorded 3, now 4"]),
    ({"adaptive_clipping": AdaptiveClipConfig(bit_noise_std=5.0, initial_clip_norm=1.0)},
     ["adaptive: recorded off; now target_quantile=0.5"]),
    ({"seed": None, "noise_source": "secure"}, ["server.noise-source: recorded 'torch', now 'secure'"]),
]


def test_a_resume_that_changes_the_run_is_refused_naming_each_change_and_the_same_run_resumes(tmp_path):
    """On main each of these went ahead silently, from the checkpoint's model, ledger and noise, with the new
    values."""
    _interrupted(tmp_path)
    before = (tmp_path / "checkpoint.json").read_bytes()
    for change, named in CHANGES:
        with pytest.raises(ValueError, match="cannot resume the run checkpointed in") as refused:
            _interrupted(tmp_path, **change)  # refused before round 2: the Stop after round 1 is never reached
        assert all(text in str(refused.value) for text in named), (named, str(refused.value))
        assert "another checkpoint folder" in str(refused.value)
        assert (tmp_path / "checkpoint.json").read_bytes() == before  # nothing resumed, nothing released
    resumed = train(_task(), PRIVACY, make_optimizer("dp-adam", lr=0.05), LOCAL, seed=3, checkpoint_dir=str(tmp_path))
    whole = train(_task(), PRIVACY, make_optimizer("dp-adam", lr=0.05), LOCAL, seed=3)
    assert [r["epsilon"] for r in resumed.records] == [r["epsilon"] for r in whole.records]
    torch.testing.assert_close(resumed.params, whole.params)


def test_an_unseeded_run_resumes_with_the_seed_it_drew_so_its_frozen_layer_is_the_same(tmp_path):
    """Its seed comes from OS entropy: a resume draws no new one (a new one would rebuild the frozen, randomly
    initialized layer with other values, and local training from another stream), it takes the recorded one."""
    task = _task(frozen=True)
    _interrupted(tmp_path, task=task, seed=None)
    drawn = recorded_run(tmp_path)[1]["seed"]
    result = train(task, PRIVACY, make_optimizer("dp-adam", lr=0.05), LOCAL, checkpoint_dir=str(tmp_path))
    assert result.state.round == PRIVACY.rounds
    assert load_checkpoint(tmp_path)["extra"]["setup"]["seed"] == drawn
    with pytest.raises(ValueError, match=r"the model: .*:frozen:"):  # another seed: another frozen layer
        train(task, PRIVACY, make_optimizer("dp-adam", lr=0.05), LOCAL, training_seed=drawn + 1,
              checkpoint_dir=str(tmp_path))


def test_the_privacy_configuration_is_compared_field_by_field_and_a_checkpoint_without_a_description_is_not():
    setup = describe_run(optimizer=make_optimizer("dp-sgd"), adaptive=None, noise_source="torch", seed=1)
    with pytest.raises(ValueError, match="privacy.noise-multiplier: recorded 1.0, now 2.0; privacy.clip-norm: "
                                         "recorded 1.0, now 0.5"):
        check_resume("ckpt", PRIVACY, setup, PRIVACY.replace(noise_multiplier=2.0, clip_norm=0.5), setup)
    check_resume("ckpt", PRIVACY, None, PRIVACY, {**setup, "seed": 2})  # written before descriptions were recorded
    check_resume("ckpt", PRIVACY, setup, PRIVACY, {**setup, "local": LocalTraining().__dict__})  # local: unknown


def test_a_refused_resume_of_an_experiment_leaves_its_config_json_as_it_was(tmp_path):
    """fed-dp simulate checks its resumes before it writes anything: config.json keeps describing the run that the
    checkpoint holds."""
    tiny = ["task.groups=2", "task.largest=8", "task.users=16", "task.held-out=4", "privacy.expected-cohort=4",
            "privacy.rounds=2", "run.eval-every=0", 'run.optimizers=["dp-sgd"]',
            f'server.checkpoint-dir="{tmp_path / "ckpt"}"']
    quiet = {"progress": False, "log": lambda *_: None}
    run_experiment(apply_overrides(load_config(None), tiny), tmp_path / "out", **quiet)
    written = (tmp_path / "out" / "config.json").read_text()
    with pytest.raises(ValueError, match=r"optimizer.lr: recorded \d\S*, now 0.5\)"):
        run_experiment(apply_overrides(load_config(None), tiny + ["optimizers.dp-sgd.lr=0.5"]), tmp_path / "out",
                       **quiet)
    assert (tmp_path / "out" / "config.json").read_text() == written
