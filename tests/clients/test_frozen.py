"""Issue 38 item 1: a model with frozen parameters (``requires_grad=False``) trains its trainable part only, on every
path, and its frozen parameters come back bit-identical; running statistics (BatchNorm) are refused on every path.

The oracle: the same network written with its frozen weights as *buffers* (constants, not parameters), which every
path has always trained. Freezing with ``requires_grad=False`` must give the same run: the same d, the same noise
draws, the same model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clients import losses
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.task import Task, Users, frozen_parameters, initial_model, trainable_parameters
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.simulations.engine.inprocess import train


class Frozen(nn.Module):
    """inner (trainable) → base, norm (frozen, in the middle: gradients flow through them) → head (trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.base, self.norm, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.base.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.base(torch.tanh(self.inner(x))))))


class Constants(nn.Module):
    """The same network with base and norm as buffers: only inner and head are parameters."""

    def __init__(self) -> None:
        super().__init__()
        frozen = Frozen()  # the same draws from the RNG, in the same order
        self.inner, self.head = frozen.inner, frozen.head
        for name, p in frozen_parameters(frozen).items():
            self.register_buffer(name.replace(".", "_"), p.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(torch.tanh(self.inner(x)), self.base_weight, self.base_bias)
        return self.head(F.layer_norm(torch.tanh(h), (8,), self.norm_weight, self.norm_bias))


def _users(count: int = 12, examples: int = 4) -> Users:
    g = torch.Generator().manual_seed(1)
    return Users.in_memory([(torch.randn(examples, 6, generator=g), torch.randint(0, 3, (examples,), generator=g))
                            for _ in range(count)])


USERS = _users()
PRIVACY = PrivacyConfig(expected_cohort=4, rounds=3, noise_multiplier=1.0, clip_norm=0.5, delta=1e-5,
                        accountant="rdp")
TRAINABLE = 6 * 8 + 8 + 8 * 3 + 3  # inner and head: 83 of the 83 + 72 + 16 parameters


def _task(model) -> Task:
    return Task(model=model, users=USERS, loss=losses.classification)


#: (training path, local training, the path the records must name)
PATHS = {
    "one-step": ("auto", LocalTraining(epochs=1, batch_size=4, lr=0.5), "one_step"),
    "sequential-flat": ("sequential", LocalTraining(epochs=2, batch_size=2, lr=0.5), None),
    "sequential-momentum": ("sequential", LocalTraining(epochs=2, batch_size=2, lr=0.5, momentum=0.5,
                                                        weight_decay=0.01), None),
    "vectorized": ("vectorized", LocalTraining(epochs=2, batch_size=2, lr=0.5, momentum=0.5), "vectorized"),
}


@pytest.mark.parametrize("path", PATHS)
def test_frozen_parameters_come_back_bit_identical_and_only_the_trainable_part_is_trained(path):
    training, local, marker = PATHS[path]
    task = _task(Frozen)
    result = train(task, PRIVACY, "dp-adam", local, seed=3, training=training, device="cpu", eval_every=0)
    assert result.params.shape == (TRAINABLE,)  # d: the update, the clip, the noise, the optimizer
    assert all(m.shape == (TRAINABLE,) for m in result.state.opt_state if isinstance(m, torch.Tensor) and m.ndim)
    if marker is not None:
        assert all(r[f"nonprivate_{marker}"] == 1.0 for r in result.records)
    initial = initial_model(task, 3)[0]
    after, before = frozen_parameters(result.model), frozen_parameters(initial)
    assert list(after) == ["base.weight", "base.bias", "norm.weight", "norm.bias"]
    assert all(torch.equal(after[name], before[name]) for name in before)  # bit-identical
    trained = torch.cat([p.detach().reshape(-1) for p in trainable_parameters(result.model).values()])
    assert torch.equal(trained, result.params)
    # the oracle: the frozen weights as constants; the same seeds draw the same cohorts and the same noise
    oracle = train(_task(Constants), PRIVACY, "dp-adam", local, seed=3, training=training, device="cpu", eval_every=0)
    assert oracle.params.shape == (TRAINABLE,)
    torch.testing.assert_close(result.params, oracle.params, rtol=1e-6, atol=1e-7)
    assert (result.params - initial_model(task, 3)[2]).norm() > 1e-3  # training and noise moved the trainable part


def test_a_model_with_nothing_trainable_is_refused():
    def all_frozen():
        return nn.Linear(3, 2).requires_grad_(False)

    with pytest.raises(ValueError, match="requires_grad=False: nothing would be trained"):
        _task(all_frozen).build_model()


class Normed(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(6, 8), norm, nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


@pytest.mark.parametrize("training", ["auto", "sequential", "vectorized"])
@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm1d(8), lambda: nn.InstanceNorm1d(8, track_running_stats=True)],
                         ids=["BatchNorm1d", "InstanceNorm1d"])
def test_running_statistics_are_refused_on_every_path_naming_group_and_layer_norm(training, norm):
    task = _task(lambda: Normed(norm()))
    pattern = r"running statistics in norm \((BatchNorm1d|InstanceNorm1d)\).*Use GroupNorm or LayerNorm"
    with pytest.raises(ValueError, match=pattern):
        train(task, PRIVACY, "dp-adam", LocalTraining(batch_size=2), seed=0, training=training, device="cpu")
    with pytest.raises(ValueError, match=pattern):
        LocalTrainer(task, LocalTraining(batch_size=2), device="cpu", training=training)


def test_batchnorm_without_running_statistics_is_accepted():
    task = _task(lambda: Normed(nn.BatchNorm1d(8, track_running_stats=False)))
    result = train(task, PRIVACY, "dp-fedavg", LocalTraining(batch_size=4), seed=0, training="sequential",
                   device="cpu", eval_every=0)
    assert result.params.shape == (6 * 8 + 8 + 16 + 8 * 3 + 3,)
