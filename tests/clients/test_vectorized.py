"""The vectorized path (clients.vectorized) computes the sequential path's contributions (clients.training); the
choice between them (clients.training_paths) is tested here too.

Both paths run the same local training (same per-user generator, minibatch order, the task's loss, the
LocalTraining SGD step with momentum and weight decay when set) and the same clip; they differ only in float32 rounding: batched kernels (grouped
convolutions, batched matmuls) and the order of the sum over users. Stated tolerance: every coordinate
agrees within RTOL = 1e-4 relative plus ATOL = 1e-5 · (‖u‖₂ + 1e-3) absolute (a per-user update of norm 1
agrees to 1e-5 per coordinate); norms and losses within 1e-4 relative; counts and clip bits exactly
(ζ is either far below or far above every update norm, so no norm sits within rounding of ζ).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fed_dp.clients import losses
from fed_dp.clients import training as seq
from fed_dp.clients import training_paths as paths
from fed_dp.clients import vectorized as vec
from fed_dp.clients.task import Examples
from fed_dp.clients.training import LocalRound
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout
from fed_dp.simulations.tasks.models import linear_softmax, w1_cnn
from fed_dp.simulations.tasks.synthetic import heavy_tail_data


def UserData(x: torch.Tensor, y: torch.Tensor) -> Examples:  # noqa: N802 - one user's (inputs, labels)
    return Examples((x, y))

RTOL = 1e-4
ATOL = 1e-5
ACTIVE, INACTIVE = 1e-3, 1e6  # ζ: every update clipped / none clipped


def _flat(model: nn.Module) -> tuple[ParamLayout, torch.Tensor]:
    named = {k: v.detach() for k, v in model.named_parameters()}
    layout = ParamLayout.from_state_dict(named)
    return layout, layout.flatten(named)


def _linear_setup():
    """Heavy-tail data (G = 3, L = 16: 48 examples, d = 64, 7 classes) split into users of 1..9 examples."""
    x, y, _ = heavy_tail_data(groups=3, largest=16, seed=0)
    sizes = [1, 2, 2, 3, 5, 5, 7, 9, 5, 9]  # 48 examples, 6 distinct sizes
    users, start = [], 0
    for user_id, n in enumerate(sizes):
        users.append((100 + user_id, UserData(x[start : start + n], y[start : start + n])))
        start += n
    torch.manual_seed(0)
    model = linear_softmax(64, 7, bias=True, zero_init=False)
    return model, users, LocalTraining(epochs=2, batch_size=3, lr=0.5)


def _w1_setup():
    """W1's CNN on small random CIFAR-shaped users of 3, 5, 5 and 7 examples."""
    g = torch.Generator().manual_seed(1)
    users = [(7 + i, UserData(torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)))
             for i, n in enumerate([5, 3, 7, 5])]
    torch.manual_seed(0)
    return w1_cnn(), users, LocalTraining(epochs=2, batch_size=2, lr=0.05)


SETUPS = {"linear_softmax": _linear_setup, "w1_cnn": _w1_setup}


def work(kwargs: dict, **overrides) -> LocalRound:
    """The LocalRound of a test's keyword arguments, some of them replaced."""
    return LocalRound(**{**kwargs, **overrides})


def _kwargs(model, training, *, clip_norm, stp, send_squares=True, seed=5, loss=losses.classification):
    layout, params = _flat(model)
    scale = None
    if stp:  # a broadcast s_t = 1/(sqrt(ν̂) + ε): positive, spread over two orders of magnitude
        scale = torch.exp(torch.randn(layout.size, generator=torch.Generator().manual_seed(2)))
    return {"params": params, "round_index": 3, "clip_norm": clip_norm, "scale": scale,
            "send_squares": send_squares, "model": model, "layout": layout, "training": training, "seed": seed,
            "loss": loss}


def _assert_updates_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(torch.linalg.vector_norm(expected)) + 1e-3
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale)


def _assert_same(vectorized, sequential) -> None:
    (cv, mv), (cs, ms) = vectorized, sequential
    assert cv.count == cs.count
    assert cv.source == cs.source
    _assert_updates_close(cv.total, cs.total)
    if cs.total_squares is None:
        assert cv.total_squares is None
    else:
        _assert_updates_close(cv.total_squares, cs.total_squares)
    assert mv.keys() == ms.keys()
    assert mv["fraction_clipped"] == ms["fraction_clipped"]
    for key in ("train_loss", "mean_update_norm"):
        assert mv[key] == pytest.approx(ms[key], rel=RTOL)


CASES = [(name, clip, stp) for name in SETUPS for clip in (ACTIVE, INACTIVE) for stp in (False, True)]


@pytest.mark.parametrize(("setup", "clip_norm", "stp"), CASES)
def test_every_user_gets_the_sequential_clipped_update(setup, clip_norm, stp):
    """Per user (a cohort of one): the same u_i, u_i², norm, clip bit and loss."""
    model, users, training = SETUPS[setup]()
    kwargs = _kwargs(model, training, clip_norm=clip_norm, stp=stp)
    for user in users:
        _assert_same(vec.users_contribution([user], work(kwargs)), seq.users_contribution([user], work(kwargs)))


@pytest.mark.parametrize(("setup", "clip_norm", "stp"), CASES)
def test_a_cohort_of_several_sizes_gets_the_sequential_sum_count_and_squares(setup, clip_norm, stp):
    model, users, training = SETUPS[setup]()
    kwargs = _kwargs(model, training, clip_norm=clip_norm, stp=stp)
    vectorized = vec.users_contribution(users, work(kwargs, source="node"))
    _assert_same(vectorized, seq.users_contribution(users, work(kwargs, source="node")))
    assert vectorized[1]["fraction_clipped"] == (1.0 if clip_norm == ACTIVE else 0.0)
    if clip_norm == ACTIVE:  # every clipped u_i has norm ζ, so ‖Σu‖ ≤ Bζ and Σ‖u‖² = Bζ²
        assert float(vectorized[0].total_squares.sum()) == pytest.approx(len(users) * ACTIVE**2, rel=1e-4)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_chunking_does_not_change_the_result(setup):
    model, users, training = SETUPS[setup]()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=True)
    whole = vec.users_contribution(users, work(kwargs), chunk_size=256)
    for chunk_size in (1, 2):
        _assert_same(vec.users_contribution(users, work(kwargs), chunk_size=chunk_size), whole)
    _assert_same(whole, seq.users_contribution(users, work(kwargs)))


def test_without_squares_no_squares_are_sent():
    model, users, training = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=False, send_squares=False)
    vectorized = vec.users_contribution(users, work(kwargs))
    assert vectorized[0].total_squares is None
    _assert_same(vectorized, seq.users_contribution(users, work(kwargs)))


def test_empty_cohort_and_a_user_without_examples():
    model, users, training = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=False)
    empty, metrics = vec.users_contribution([], work(kwargs))
    assert empty.count == 0 and not bool(empty.total.any()) and not bool(empty.total_squares.any())
    assert all(math.isnan(v) for v in metrics.values())
    no_data = (55, UserData(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)))
    for path in (vec.users_contribution, seq.users_contribution):
        with pytest.raises(ValueError, match="user 55 has no examples"):
            path([users[0], no_data, users[4]], work(kwargs))


@pytest.mark.parametrize("training", [
    LocalTraining(epochs=2, batch_size=3, lr=0.2, momentum=0.9),
    LocalTraining(epochs=1, batch_size=2, lr=0.3, weight_decay=0.05),
    LocalTraining(steps=5, batch_size=2, lr=0.2, momentum=0.5, weight_decay=0.01, max_examples=4),
], ids=["momentum", "weight-decay", "steps-cap-both"])
def test_local_optimizer_options_agree_between_paths_and_with_torch_sgd(training):
    """Momentum, weight decay, a step count and an example cap: the vectorized path equals the sequential
    one, and the sequential one equals torch.optim.SGD run by hand on the same minibatches (the independent
    reference: torch's own SGD with momentum and weight decay, dampening 0)."""
    model, users, _ = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=INACTIVE, stp=False)
    _assert_same(vec.users_contribution(users, work(kwargs)), seq.users_contribution(users, work(kwargs)))
    index, examples = users[7]  # 9 examples: the cap of 4 and the step count both bite
    delta, _ = seq.local_delta(model, kwargs["layout"], kwargs["params"], examples, training,
                               losses.classification, seq.user_generator(5, 3, index), user=index)
    reference = linear_softmax(64, 7, bias=True, zero_init=False)
    for name, p in reference.named_parameters():
        p.data.copy_(kwargs["layout"].unflatten(kwargs["params"])[name])
    sgd = torch.optim.SGD(reference.parameters(), lr=training.lr, momentum=training.momentum,
                          weight_decay=training.weight_decay)
    generator = seq.user_generator(5, 3, index)
    m = seq.examples_used(training, len(examples))
    orders = [torch.randperm(m, generator=generator) for _ in range(seq.epochs_needed(training, len(examples)))]
    steps = 0
    for epoch, start, stop in seq.local_schedule(training, len(examples)):
        sgd.zero_grad()
        losses.classification(reference, examples.select(orders[epoch][start:stop])).backward()
        sgd.step()
        steps += 1
    assert steps == (training.steps or training.epochs * math.ceil(m / training.batch_size))
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]) - kwargs["params"]
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-6)


def test_the_task_loss_is_what_trains():
    """A regression loss (MSE) through both paths: the same update, and one that differs from the
    classification loss's (the loss really is the task's, not a built-in cross-entropy)."""
    g = torch.Generator().manual_seed(4)
    users = [(i, UserData(torch.randn(n, 5, generator=g), torch.randn(n, generator=g))) for i, n in enumerate([3, 4, 3])]
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    kwargs = _kwargs(model, LocalTraining(batch_size=2, lr=0.1), clip_norm=INACTIVE, stp=False, loss=losses.regression)
    vectorized = vec.users_contribution(users, work(kwargs))
    _assert_same(vectorized, seq.users_contribution(users, work(kwargs)))
    x = torch.cat([u[1].fields[0] for u in users])
    assert vectorized[1]["train_loss"] > 0
    with pytest.raises(ValueError, match="regression target"):
        seq.users_contribution([(0, UserData(x[:2], torch.randn(2)))], work({**kwargs, "loss": losses.classification}))


def test_a_loss_that_is_not_a_scalar_or_becomes_nan_names_the_user():
    model, users, training = _linear_setup()
    per_example = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="none")  # noqa: E731
    for path in (vec.users_contribution, seq.users_contribution):
        with pytest.raises(ValueError, match="scalar"):
            path(users, work(_kwargs(model, training, clip_norm=1.0, stp=False, loss=per_example)))
    nan_loss = lambda m, batch: losses.classification(m, batch) * float("nan")  # noqa: E731
    for path in (vec.users_contribution, seq.users_contribution):
        with pytest.raises(ValueError, match=r"loss of user 10\d became nan"):
            path(users, work(_kwargs(model, training, clip_norm=1.0, stp=False, loss=nan_loss)))


def test_data_dependent_control_flow_falls_back_to_the_sequential_path_with_one_log_line(caplog, monkeypatch):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 7)

        def forward(self, x):
            if x.sum() > 0:  # Python control flow on data: vmap cannot trace it
                return self.linear(x)
            return -self.linear(x)

    torch.manual_seed(0)
    model = Branchy()
    _, users, training = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=False)
    monkeypatch.setattr(paths, "select_path", lambda *args, **kw: ("vectorized", ""))  # what auto picks on CUDA
    paths._reported_fallbacks.discard("Branchy")
    with caplog.at_level("WARNING", logger="fed_dp.clients"):
        result, metrics, path = paths.contribution(users, work(kwargs))
        again = paths.contribution(users, work(kwargs))
    assert path == "sequential" and again[2] == "sequential"
    expected, expected_metrics = seq.users_contribution(users, work(kwargs))
    assert torch.equal(result.total, expected.total) and metrics == expected_metrics
    assert sum("cannot be vectorized" in r.getMessage() for r in caplog.records) == 1  # said once
    with pytest.raises(RuntimeError):  # forced vectorization: the error, not a silent fallback
        paths.contribution(users, work(kwargs), vectorized=True)


class _Normed(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.norm(self.conv(x))).flatten(1))


def _normed_users():
    g = torch.Generator().manual_seed(3)
    return [(i, UserData(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)))
            for i, n in enumerate([4, 6, 4])]


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 4), nn.LayerNorm([4, 8, 8])], ids=["GroupNorm", "LayerNorm"])
def test_group_and_layer_norm_are_vectorized(norm):
    torch.manual_seed(0)
    model = _Normed(norm)
    assert vec.can_vectorize(model) == (True, "")
    kwargs = _kwargs(model, LocalTraining(epochs=2, batch_size=3, lr=0.1), clip_norm=0.5, stp=False)
    result, metrics, path = paths.contribution(_normed_users(), work(kwargs), vectorized=True)
    assert path == "vectorized"
    _assert_same((result, metrics), seq.users_contribution(_normed_users(), work(kwargs)))


def test_batchnorm_is_rejected_with_the_reason():
    torch.manual_seed(0)
    model = _Normed(nn.BatchNorm2d(4))
    ok, reason = vec.can_vectorize(model)
    assert not ok and "BatchNorm2d" in reason and "leak" in reason
    kwargs = _kwargs(model, LocalTraining(batch_size=2), clip_norm=1.0, stp=False)
    with pytest.raises(ValueError, match="BatchNorm.*statistics.*leak"):
        vec.users_contribution(_normed_users(), work(kwargs))
    with pytest.raises(ValueError, match="BatchNorm"):
        paths.contribution(_normed_users(), work(kwargs), vectorized=True)
    # auto: the sequential path runs (users trained one at a time) and says so
    result, metrics, path = paths.contribution(_normed_users(), work(kwargs))
    assert path == "sequential"
    assert paths.select_path(model, device="cuda") == ("sequential", reason)
    torch.manual_seed(0)
    fresh = _Normed(nn.BatchNorm2d(4))
    expected, expected_metrics = seq.users_contribution(_normed_users(), work({**kwargs, "model": fresh}))
    assert torch.equal(result.total, expected.total) and metrics == expected_metrics


def test_active_dropout_falls_back_and_eval_mode_vectorizes():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.Dropout(0.5), nn.Linear(4, 3))
    ok, reason = vec.can_vectorize(model)
    assert not ok and "dropout" in reason
    model.eval()
    assert vec.can_vectorize(model) == (True, "")
    assert vec.can_vectorize(nn.Linear(3, 2).double())[0] is False  # the flat update is float32


def test_dispatcher_reports_the_path_and_the_forced_sequential_path_is_the_sequential_code():
    model, users, training = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=True)
    result, metrics, path = paths.contribution(users, work(kwargs), vectorized=True)
    assert path == "vectorized"
    assert all(isinstance(v, float) for v in metrics.values())  # ready for a Flower MetricRecord
    _assert_same((result, metrics), seq.users_contribution(users, work(kwargs)))
    result, metrics, path = paths.contribution(users, work(kwargs), vectorized=False)
    expected, expected_metrics = seq.users_contribution(users, work(kwargs))
    assert path == "sequential" and torch.equal(result.total, expected.total) and metrics == expected_metrics


def test_invalid_arguments():
    model, users, training = _linear_setup()
    kwargs = _kwargs(model, training, clip_norm=1.0, stp=False)
    with pytest.raises(ValueError, match="chunk_size"):
        vec.users_contribution(users, work(kwargs), chunk_size=0)
    with pytest.raises(ValueError, match="scale must be positive"):
        vec.users_contribution(users, work({**kwargs, "scale": -torch.ones_like(kwargs["params"])}))
    with pytest.raises(ValueError, match="clip_norm"):
        vec.users_contribution(users, work({**kwargs, "clip_norm": 0.0}))


def test_the_model_module_is_left_untouched():
    model, users, training = _w1_setup()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    vec.users_contribution(users, work(_kwargs(model, training, clip_norm=1.0, stp=False)))
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())


def test_auto_chunk_size_bounds_memory():
    assert vec.auto_chunk_size(25_578) == vec.DEFAULT_CHUNK_SIZE  # W1
    assert vec.auto_chunk_size(9216 * 255) == 7  # heavy-tail default: 256 MiB / (16 B · d)
    assert vec.auto_chunk_size(10**9) == 1


def test_auto_path_is_vectorized_on_cuda_and_on_cpu_only_for_small_models_without_convolutions():
    """The auto rule looks at the device type and, on the CPU, at the model (no GPU needed to check it): small
    models without convolutions vectorize there (measured 3-5x faster), convolutions and larger models do not
    (measured 3x and 1.7x slower); forced choices win."""
    model = nn.Linear(3, 2)
    assert paths.select_path(model, None, torch.device("cuda"))[0] == "vectorized"
    assert paths.select_path(model, None, "cuda:1")[0] == "vectorized"
    assert paths.select_path(model, None, "cpu") == ("vectorized", "")
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    path, reason = paths.select_path(conv, None, "cpu")
    assert path == "sequential" and "CPU" in reason and "convolution (0: Conv2d)" in reason
    assert paths.select_path(conv, None, "cuda")[0] == "vectorized"
    big = nn.Linear(paths.CPU_VECTORIZE_MAX_PARAMS, 1)  # one parameter over the bound (the bias)
    path, reason = paths.select_path(big, None, "cpu")
    assert path == "sequential" and f"{paths.CPU_VECTORIZE_MAX_PARAMS + 1:,} parameters" in reason
    assert paths.select_path(nn.Linear(paths.CPU_VECTORIZE_MAX_PARAMS - 1, 1), None, "cpu")[0] == "vectorized"
    assert paths.select_path(conv, True, "cpu")[0] == "vectorized"
    assert paths.select_path(model, False, "cuda")[0] == "sequential"
    model, users, training = _linear_setup()  # two local epochs: not one step, so a model per user
    _, _, path = paths.contribution(users, work(_kwargs(model, training, clip_norm=1.0, stp=False)))
    assert path == "vectorized"  # params on the CPU, 455 parameters
    cnn, cnn_users, cnn_training = _w1_setup()
    _, _, path = paths.contribution(cnn_users, work(_kwargs(cnn, cnn_training, clip_norm=1.0, stp=False)))
    assert path == "sequential"  # the W1 CNN on the CPU
