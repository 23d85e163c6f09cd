"""The sequential path's plain-SGD fast path (``FlatParameters``) against torch's own SGD, and the allocator
setting for CPU training. The two paths agreeing with each other is tests/clients/test_vectorized.py."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fed_dp.clients import losses
from fed_dp.clients import training as seq
from fed_dp.clients.task import Examples
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout
from fed_dp.simulations.tasks.models import w1_cnn


def test_local_schedule():
    """Which minibatches a user with n examples takes: (epoch, start, stop) into that epoch's permutation."""
    assert seq.local_schedule(LocalTraining(epochs=2, batch_size=3), 5) == [(0, 0, 3), (0, 3, 5), (1, 0, 3), (1, 3, 5)]
    assert seq.local_schedule(LocalTraining(steps=3, batch_size=4), 5) == [(0, 0, 4), (0, 4, 5), (1, 0, 4)]
    assert seq.local_schedule(LocalTraining(batch_size=2, max_examples=3), 10) == [(0, 0, 2), (0, 2, 3)]
    assert seq.epochs_needed(LocalTraining(steps=3, batch_size=4), 5) == 2
    assert seq.local_schedule(LocalTraining(), 0) == []


def _layout(model: nn.Module) -> tuple[ParamLayout, torch.Tensor]:
    named = {k: v.detach() for k, v in model.named_parameters()}
    layout = ParamLayout.from_state_dict(named)
    return layout, layout.flatten(named).clone()


def _torch_sgd_delta(model: nn.Module, params: torch.Tensor, layout: ParamLayout, examples: Examples,
                     training: LocalTraining, generator: torch.Generator) -> torch.Tensor:
    """The independent reference: torch.optim.SGD on a copy of ``model`` from θ = ``params``, same minibatches."""
    reference = copy.deepcopy(model)
    for name, value in layout.unflatten(params).items():
        dict(reference.named_parameters())[name].data.copy_(value)
    sgd = torch.optim.SGD(reference.parameters(), lr=training.lr)
    orders = seq.minibatch_orders(len(examples), training, generator)
    for epoch, start, stop in seq.local_schedule(training, len(examples)):
        sgd.zero_grad()
        losses.classification(reference, examples.select(orders[epoch][start:stop])).backward()
        sgd.step()
    return layout.flatten({k: v.detach() for k, v in reference.named_parameters()}) - params


def test_plain_sgd_on_a_channels_last_cnn_is_torch_sgd():
    """W1's CNN in channels-last (its 4-D weights' memory order differs from the layout's flat order, so the
    flat buffers are read through a permutation): local Δ of two users, round after round, equals torch's SGD."""
    torch.manual_seed(0)
    model = w1_cnn()
    g = torch.Generator().manual_seed(3)
    users = [Examples((torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))) for n in (7, 5)]
    seq.use_fast_format(model, [(0, users[0])])
    layout, params = _layout(model)
    training = LocalTraining(epochs=2, batch_size=3, lr=0.05)
    for round_index in range(2):
        for index, examples in enumerate(users):
            examples = examples.to("cpu", torch.channels_last)
            delta, _ = seq.local_delta(model, layout, params, examples, training, losses.classification,
                                       seq.user_generator(1, round_index, index), user=index)
            expected = _torch_sgd_delta(model, params, layout, examples, training,
                                        seq.user_generator(1, round_index, index))
            torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-7)
            assert delta.norm() > 0
        params = params + 0.1 * delta  # a new broadcast θ
    flat = seq.flat_parameters(model, layout)
    assert flat.to_memory is not None  # the permutation was exercised


class WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_parameter_the_loss_does_not_reach_does_not_move():
    torch.manual_seed(1)
    model = WithUnusedHead()
    layout, params = _layout(model)
    examples = Examples((torch.randn(6, 4), torch.randint(0, 3, (6,))))
    training = LocalTraining(epochs=1, batch_size=2, lr=0.5)
    delta, _ = seq.local_delta(model, layout, params, examples, training, losses.classification,
                               seq.user_generator(0, 0, 0))
    moved = dict(zip(layout.names, [d.norm() for d in layout.unflatten(delta).values()]))
    assert moved["unused.weight"] == 0 and moved["unused.bias"] == 0 and moved["body.weight"] > 0
    torch.testing.assert_close(delta, _torch_sgd_delta(model, params, layout, examples, training,
                                                       seq.user_generator(0, 0, 0)), rtol=1e-6, atol=1e-7)


def test_the_flat_buffers_alias_the_parameters_and_are_remade_when_replaced():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    layout, params = _layout(model)
    flat = seq.flat_parameters(model, layout)
    assert torch.equal(flat.read(), params) and flat.to_memory is None
    losses.classification(model, (torch.randn(5, 3), torch.randint(0, 2, (5,)))).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(flat.grads, grads) and flat.grads.abs().sum() > 0  # autograd wrote into the buffer
    flat.values.zero_()
    assert all(p.abs().sum() == 0 for p in model.parameters())  # the parameters are views of it
    assert seq.flat_parameters(model, layout) is flat
    model.zero_grad(set_to_none=True)  # replaces the gradient views: the buffers are made again
    assert not flat.intact() and seq.flat_parameters(model, layout) is not flat


def test_keep_freed_memory_sets_glibc_thresholds_once_and_leaves_a_tuned_environment_alone(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(seq.ctypes, "CDLL", lambda _: Libc())
    monkeypatch.setattr(seq, "_kept", None)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert seq.keep_freed_memory() is False and calls == []
    monkeypatch.setattr(seq, "_kept", None)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    for name in [n for n in __import__("os").environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert seq.keep_freed_memory() is True and seq.keep_freed_memory() is True
    assert calls == [(-3, 32 << 20), (-1, 64 << 20)]  # M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 64 MiB, once
