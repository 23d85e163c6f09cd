"""The one-step path (clients/one_step.py) against the sequential path, layer type by layer type.

Every case trains the same users both ways from the same θ and compares Σu (and Σu² for independent moment
estimation, the scaled geometry for scale-then-privatize, the clip bits and the metrics). The sequential path
trains a model per user with autograd, so it is an independent computation of what the hooks reconstruct.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fed_dp.clients import one_step, training as sequential
from fed_dp.clients.losses import classification, multi_label, next_token, regression
from fed_dp.clients.task import Examples
from fed_dp.clients.training import LocalRound
from fed_dp.clients.training_paths import contribution, path_metrics, select_path
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout

FULL_BATCH = LocalTraining(batch_size=64, lr=0.5, epochs=1)


class TokenModel(nn.Module):
    """Embedding → LayerNorm → Linear to the vocabulary, per position (a next-token model)."""

    def __init__(self, vocabulary: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(tokens)))


class Conv1dModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1, stride=2)
        self.head = nn.Linear(3 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class Twice(nn.Module):
    """One Linear applied twice: its gradient has terms from both calls (the ghost norm needs their cross terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(torch.tanh(self.inner(x))))


def _images(m: int, g: torch.Generator):
    return torch.randn(m, 2, 6, 6, generator=g), torch.randint(0, 4, (m,), generator=g)


CASES = {
    "linear+layernorm": (lambda: nn.Sequential(nn.Linear(7, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 4)),
                         lambda m, g: (torch.randn(m, 7, generator=g), torch.randint(0, 4, (m,), generator=g)),
                         classification),
    "conv2d+groupnorm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                                               nn.Conv2d(4, 3, 2, stride=2, bias=False), nn.Flatten(),
                                               nn.Linear(27, 4)),
                         _images, classification),
    "conv1d": (Conv1dModel, lambda m, g: (torch.randn(m, 2, 8, generator=g), torch.randint(0, 4, (m,), generator=g)),
               classification),
    "embedding+next-token": (TokenModel, lambda m, g: (torch.randint(0, 11, (m, 5), generator=g),), next_token),
    "masked next-token": (TokenModel, lambda m, g: (torch.randint(0, 11, (m, 5), generator=g),
                                                    (torch.rand(m, 5, generator=g) > 0.3).float()), next_token),
    "layer used twice": (Twice, lambda m, g: (torch.randn(m, 5, generator=g), torch.randint(0, 3, (m,), generator=g)),
                         classification),
    "regression": (lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
                   lambda m, g: (torch.randn(m, 4, generator=g), torch.randn(m, 2, generator=g)), regression),
    "regression, one target": (lambda: nn.Linear(4, 1),
                               lambda m, g: (torch.randn(m, 4, generator=g), torch.randn(m, generator=g)), regression),
    "multi-label": (lambda: nn.Linear(4, 3),
                    lambda m, g: (torch.randn(m, 4, generator=g), (torch.rand(m, 3, generator=g) > 0.5).float()),
                    multi_label),
}


def work(kwargs: dict, **overrides) -> LocalRound:
    """The LocalRound of a test's keyword arguments, some of them replaced."""
    return LocalRound(**{**kwargs, **overrides})


def _setup(case: str, sizes: list[int], seed: int = 0):
    build, data, loss = CASES[case]
    torch.manual_seed(seed)
    model = build()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    g = torch.Generator().manual_seed(seed + 1)
    users = [(index, Examples(data(m, g))) for index, m in enumerate(sizes)]
    return model, layout, params, users, loss


def _both(case, sizes, *, clip_norm, scale=None, send_squares=False, training=FULL_BATCH):
    model, layout, params, users, loss = _setup(case, sizes)
    scale = None if scale is None else torch.rand(layout.size, generator=torch.Generator().manual_seed(9)) + 0.5
    kwargs = dict(params=params, round_index=3, clip_norm=clip_norm, scale=scale, send_squares=send_squares,
                  model=model, layout=layout, training=training, loss=loss, seed=0)
    return one_step.users_contribution(users, work(kwargs)), sequential.users_contribution(users, work(kwargs))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * (1 + float(b.abs().max())))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("clip_norm", [0.05, 100.0])  # every user clipped / none
def test_sum_equals_sequential(case, clip_norm):
    (fast, fast_metrics), (slow, slow_metrics) = _both(case, [1, 1, 3, 3, 2, 5, 1], clip_norm=clip_norm)
    _close(fast.total, slow.total)
    assert (fast.count, fast.unclipped) == (slow.count, slow.unclipped)
    for key in ("train_loss", "mean_update_norm", "fraction_clipped"):
        assert fast_metrics[key] == pytest.approx(slow_metrics[key], rel=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_squares_and_scaled_geometry_equal_sequential(case):
    for scale in (None, True):
        (fast, _), (slow, _) = _both(case, [1, 2, 2, 4, 1], clip_norm=0.3, scale=scale, send_squares=True)
        _close(fast.total, slow.total)
        _close(fast.total_squares, slow.total_squares)
        assert fast.scaled == slow.scaled == (scale is not None)
        assert fast.unclipped == slow.unclipped


def test_clip_bits_count_users_at_or_under_the_clip():
    model, layout, params, users, loss = _setup("linear+layernorm", [1] * 40)
    kwargs = dict(params=params, round_index=0, scale=None, send_squares=False, model=model, layout=layout,
                  training=FULL_BATCH, loss=loss, seed=0)
    _, metrics = one_step.users_contribution(users, work(kwargs, clip_norm=1e9))
    mean_norm = metrics["mean_update_norm"]
    fast, _ = one_step.users_contribution(users, work(kwargs, clip_norm=mean_norm))
    slow, _ = sequential.users_contribution(users, work(kwargs, clip_norm=mean_norm))
    assert 0 < fast.unclipped < 40 and fast.unclipped == slow.unclipped


def test_chunks_do_not_change_the_result():
    model, layout, params, users, loss = _setup("embedding+next-token", [1, 2, 2, 3, 1, 1, 2])
    kwargs = dict(params=params, round_index=0, clip_norm=0.2, scale=None, send_squares=True, model=model,
                  layout=layout, training=FULL_BATCH, loss=loss, seed=0)
    whole, _ = one_step.users_contribution(users, work(kwargs))
    tiny, _ = one_step.users_contribution(users, work(kwargs), budget_bytes=8 * 40)  # one user per chunk
    _close(tiny.total, whole.total)
    _close(tiny.total_squares, whole.total_squares)


def test_examples_cap_uses_the_first_examples():
    capped = LocalTraining(batch_size=64, lr=0.5, epochs=1, max_examples=2)
    (fast, _), (slow, _) = _both("linear+layernorm", [1, 4, 5, 2], clip_norm=0.2, training=capped)
    _close(fast.total, slow.total)


def test_which_users_train_one_step():
    training = LocalTraining(batch_size=4, lr=0.1, epochs=1)
    assert one_step.one_step(training, 4) and not one_step.one_step(training, 5)
    assert not one_step.one_step(LocalTraining(batch_size=4, lr=0.1, epochs=2), 3)
    assert not one_step.one_step(LocalTraining(batch_size=4, lr=0.1, epochs=1, weight_decay=0.1), 3)
    assert one_step.one_step(LocalTraining(batch_size=4, lr=0.1, steps=1), 4)
    assert not one_step.one_step(LocalTraining(batch_size=4, lr=0.1, steps=1), 6)  # a random subset of 6


def test_contribution_mixes_paths_and_says_which_ran():
    """Users with more examples than one batch go the usual way; the reply is the sum of both parts."""
    model, layout, params, users, loss = _setup("linear+layernorm", [1, 2, 9, 1, 12, 3])
    training = LocalTraining(batch_size=4, lr=0.5, epochs=1)
    kwargs = dict(params=params, round_index=0, clip_norm=0.3, scale=None, send_squares=True, model=model,
                  layout=layout, training=training, loss=loss, seed=5)
    mixed, metrics, path = contribution(users, work(kwargs))
    slow, slow_metrics = sequential.users_contribution(users, work(kwargs))
    assert path == "one-step+vectorized" and path_metrics(path) == {"vectorized": 1.0, "one_step": 1.0}
    _close(mixed.total, slow.total)
    _close(mixed.total_squares, slow.total_squares)
    assert (mixed.count, mixed.unclipped) == (slow.count, slow.unclipped)
    assert metrics["train_loss"] == pytest.approx(slow_metrics["train_loss"], rel=1e-5)
    only_fast = [u for u in users if len(u[1]) <= 4]
    assert contribution(only_fast, work(kwargs))[2] == "one-step"
    assert contribution(only_fast, work(kwargs), vectorized=False)[2] == "sequential"


def test_extra_work_per_form():
    """What each gradient form costs beyond a per-user backward pass, in multiply-adds (C users, Q positions)."""
    c, q, k, o = 3, 4, 5, 7
    rank_one = one_step._Outer(torch.ones(c, 1, k), torch.ones(c, 1, o))
    assert rank_one.extra_macs(scaled=True, squares=True) == 0  # closed forms
    wide = one_step._Outer(torch.ones(c, q, 50), torch.ones(c, q, 60))  # Q(k + o) < k·o: Gram matrices
    assert wide.ghost_cheaper() and wide.extra_macs(False, False) == c * q * q * 110
    assert wide.extra_macs(True, False) == c * q * 50 * 60  # the scale needs G_u itself
    assert wide.extra_macs(False, True) == c * q * q * 110 + c * q * 50 * 60  # and so do the squares
    thin = one_step._Outer(torch.ones(c, q, k), torch.ones(c, q, o))
    assert not thin.ghost_cheaper() and thin.extra_macs(False, False) == c * q * k * o
    assert one_step._Dense(torch.ones(c, 9)).extra_macs(True, True) == 0


def test_auto_leaves_users_whose_norms_cost_more_than_a_model_per_user():
    """Long sequences into a wide output layer: materializing G_u over 38 predicted positions (2 sequences of 20
    tokens) costs 38·24·800 = 730k multiply-adds per user beyond the per-user path's work (the limit is 2^20 ≈
    1.05M); over 98 (1.88M) the auto choice refuses once, says why, and every user trains with a model per user,
    to the same sum."""
    def setup(length):
        torch.manual_seed(0)
        model = TokenModel(vocabulary=800, width=24)
        layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
        params = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
        g = torch.Generator().manual_seed(1)
        users = [(i, Examples((torch.randint(0, 800, (2, length), generator=g),))) for i in range(3)]
        kwargs = dict(params=params, round_index=0, clip_norm=0.5, scale=None, send_squares=False, model=model,
                      layout=layout, training=FULL_BATCH, loss=next_token, seed=5)
        return model, users, kwargs

    model, users, kwargs = setup(20)  # 2 × 19 positions a user
    assert contribution(users, work(kwargs))[2] == "one-step"
    model, users, kwargs = setup(50)  # 2 × 49 positions: 1.88M
    with pytest.raises(one_step.Unsupported, match=r"1\.88e\+06 extra multiply-adds per user \(over 1\.05e\+06; most in out\.weight\)"):
        one_step.users_contribution(users, work(kwargs), max_extra_macs=one_step.AUTO_MAX_EXTRA_MACS)
    forced, _ = one_step.users_contribution(users, work(kwargs))  # no limit: the path itself still works
    result, _, path = contribution(users, work(kwargs))
    assert path == "sequential" and "multiply-adds" in model._fed_dp_one_step_refused  # 39,248 parameters: > 2^15
    slow, _ = sequential.users_contribution(users, work(kwargs))
    _close(result.total, slow.total)
    _close(forced.total, slow.total)


class OutsideUse(nn.Module):
    """Uses a Linear's weight outside the Linear's forward: the hooks cannot see that gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x[:, :3] @ self.fc.weight[:, :3].T


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu_(self.fc(x)))


@pytest.mark.parametrize("build, reason", [
    (OutsideUse, "outside the forward of its layer"),
    (InPlace, "changed in place"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), "BatchNorm"),
    (lambda: nn.GRU(4, 3), "GRU"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 3)), "dropout"),
])
def test_what_this_path_cannot_train_goes_the_usual_way(build, reason, caplog):
    torch.manual_seed(0)
    model = build()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    g = torch.Generator().manual_seed(0)
    users = [(i, Examples((torch.randn(2, 4, generator=g), torch.randint(0, 3, (2,), generator=g)))) for i in range(3)]
    kwargs = dict(params=params, round_index=0, clip_norm=0.3, scale=None, send_squares=False, model=model,
                  layout=layout, training=FULL_BATCH, loss=classification, seed=0)
    with pytest.raises(one_step.Unsupported, match=reason):
        one_step.users_contribution(users, work(kwargs))
    if isinstance(model, nn.GRU):
        return  # the classification loss does not take a GRU's (output, state); nothing more to compare
    with caplog.at_level(logging.WARNING, logger="fed_dp.clients"):
        result, _, path = contribution(users, work(kwargs))
        assert contribution(users, work(kwargs))[2] == path  # the refusal is remembered: logged once
    assert path == select_path(model, None, params.device)[0]  # the usual path, as if one-step did not exist
    assert sum(reason in r.getMessage() for r in caplog.records) == 1
    if not isinstance(model, (nn.Sequential,)) or not any(isinstance(m, nn.Dropout) for m in model.modules()):
        expected, _ = sequential.users_contribution(users, work(kwargs))
        _close(result.total, expected.total)


def test_a_loss_without_per_example_or_with_a_wrong_one_is_refused():
    model, layout, params, users, _ = _setup("linear+layernorm", [1, 2])
    kwargs = dict(params=params, round_index=0, clip_norm=0.3, scale=None, send_squares=False, model=model,
                  layout=layout, training=FULL_BATCH, seed=0)

    def own_loss(model, batch):
        return classification(model, batch)

    with pytest.raises(one_step.Unsupported, match="no per_example"):
        one_step.users_contribution(users, work(kwargs, loss=own_loss))
    own_loss.per_example = lambda model, batch: (lambda a, b: (2 * a, b))(*classification.per_example(model, batch))
    with pytest.raises(one_step.Unsupported, match="does not add up"):
        one_step.users_contribution(users, work(kwargs, loss=own_loss))


def test_a_non_finite_loss_names_the_user():
    model, layout, params, users, loss = _setup("linear+layernorm", [1, 1, 2])
    users[1] = (1, Examples((torch.full((1, 7), float("nan")), torch.zeros(1, dtype=torch.long))))
    with pytest.raises(ValueError, match="user 1"):
        one_step.users_contribution(users, LocalRound(params=params, round_index=0, clip_norm=0.3, scale=None,
                                                      send_squares=False, model=model, layout=layout,
                                                      training=FULL_BATCH, loss=loss, seed=0))


@pytest.mark.parametrize("loss, data", [
    (classification, lambda g: (torch.randn(3, 4, generator=g), torch.randint(0, 3, (3,), generator=g))),
    (regression, lambda g: (torch.randn(3, 4, generator=g), torch.randn(3, 3, generator=g))),
    (regression, lambda g: (torch.randn(3, 4, generator=g), torch.randn(3, generator=g))),  # (b,) targets
    (multi_label, lambda g: (torch.randn(3, 4, generator=g), (torch.rand(3, 3, generator=g) > 0.5).float())),
])
def test_per_example_terms_add_up_to_each_loss(loss, data):
    batch = data(torch.Generator().manual_seed(0))
    model = nn.Linear(4, 1 if loss is regression and batch[1].ndim == 1 else 3)
    a, b = loss.per_example(model, batch)
    assert a.shape == b.shape == (3,)
    torch.testing.assert_close(a.sum() / b.sum().clamp(min=1), loss(model, batch))


def test_next_token_terms_add_up_with_and_without_mask():
    model, g = TokenModel(), torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (4, 6), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]]).float()
    for batch in ((tokens,), (tokens, mask)):
        a, b = next_token.per_example(model, batch)
        torch.testing.assert_close(a.sum() / b.sum().clamp(min=1), next_token(model, batch))


def _bounded(computed, exact: torch.Tensor) -> None:
    """The computed squared norms are close to the exact ones, and value + error bounds them from above."""
    torch.testing.assert_close(computed.value, exact, rtol=1e-12, atol=1e-12)
    assert bool((computed.value + computed.error >= exact).all())
    assert bool((computed.error <= 1e-9 * (exact + 1e-30)).all())


@pytest.mark.parametrize("positions", [1, 3, 40])  # rank one, ghost (Gram) and materialized
@pytest.mark.parametrize("block_bytes", [4, 64 * 2**20])  # one user per block / all at once
def test_outer_product_gradients_against_explicit_ones(positions, block_bytes):
    """‖s ⊙ G_u‖², Σ w_u G_u and Σ w_u² G_u² of G_u = Σ_q δ_q x_qᵀ, each form against G_u built explicitly."""
    g = torch.Generator().manual_seed(positions)
    x, d = torch.randn(6, positions, 5, generator=g), torch.randn(6, positions, 4, generator=g)
    explicit = torch.einsum("cqo,cqk->cok", d.double(), x.double()).flatten(1)  # exact to float64 rounding
    grads = one_step._Outer(x, d, block_bytes=block_bytes)
    w = torch.rand(6, generator=g)
    s2 = torch.rand(20, generator=g, dtype=torch.float64) + 0.5
    _bounded(grads.norm_sq(None), explicit.square().sum(1))
    _bounded(grads.norm_sq(s2.float()), (explicit.square() * s2.float().double()).sum(1))
    torch.testing.assert_close(grads.weighted_sum(w).double(), w.double() @ explicit, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads.weighted_squares(w.square()).double(), w.double().square() @ explicit.square(),
                               rtol=1e-5, atol=1e-6)


def test_embedding_rows_against_explicit_gradients():
    """An embedding's per-user gradient rows (repeated tokens summed) against a dense per-user gradient."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (3, 4), generator=g)  # 3 users, 4 positions, tokens repeat
    d = torch.randn(3, 4, 2, generator=g)
    explicit = torch.zeros(3, 5, 2, dtype=torch.float64)
    for u in range(3):
        for q in range(4):
            explicit[u, tokens[u, q]] += d[u, q].double()
    module = nn.Embedding(5, 2)
    call = one_step._Call(module, tokens, torch.empty(0), (0, 0), grad=d)
    rows = one_step._embedding(call, 3)["weight"]
    w = torch.rand(3, generator=g)
    explicit = explicit.flatten(1)
    norms = rows.norm_sq(None)
    torch.testing.assert_close(norms.value, explicit.square().sum(1), rtol=1e-6, atol=1e-9)
    released = torch.zeros(3, dtype=torch.float64).index_add_(0, rows.owner, rows.rows.double().square().sum(1))
    _bounded(norms, released)  # the bound holds for the float32 rows that the node's sum is built from
    torch.testing.assert_close(rows.weighted_sum(w).double(), w.double() @ explicit, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.weighted_squares(w.square()).double(), w.double().square() @ explicit.square(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case, sizes, scale", [
    ("linear+layernorm", [1], None),             # rank one
    ("masked next-token", [3], None),            # Gram matrices, embedding rows, LayerNorm
    ("conv2d+groupnorm", [2], True),             # materialized in float64 (scaled geometry)
])
def test_each_released_update_is_within_the_clip_in_floating_point(case, sizes, scale):
    """A user alone at the node: the node's sum is that user's released u. With ζ a hair (10⁻⁷ relative) under
    the user's own norm, ‖u‖ must still be ≤ ζ as fed_dp.clipping.l2_norm (an upper bound) measures it."""
    from fed_dp.clipping import l2_norm

    outside = 0
    for seed in range(40):
        model, layout, params, users, loss = _setup(case, sizes, seed=seed)
        s = None if scale is None else torch.rand(layout.size, generator=torch.Generator().manual_seed(seed)) + 0.5
        kwargs = dict(params=params, round_index=0, scale=s, send_squares=False, model=model, layout=layout,
                      training=FULL_BATCH, loss=loss, seed=0)
        _, metrics = one_step.users_contribution(users, work(kwargs, clip_norm=1e9))
        clip_norm = metrics["mean_update_norm"] * (1 - 1e-7)
        released, _ = one_step.users_contribution(users, work(kwargs, clip_norm=clip_norm))
        assert released.unclipped == 0
        outside += float(l2_norm(released.total)) > clip_norm
    assert outside == 0
