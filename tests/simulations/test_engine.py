"""The in-process engine runs fed_dp's round: its noise, denominator and accounting are fed_dp's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fed_dp.accounting import epsilon
from fed_dp.clipping import clip_update
from fed_dp.config import PrivacyConfig
from fed_dp.flat import ParamLayout
from fed_dp.optimizers import make_optimizer
from fed_dp.clients.training import LocalTraining, local_delta, user_generator
from fed_dp.simulations.engine import run
from fed_dp.simulations.task import Task, UserData


def _task(num_users: int = 40, dim: int = 6, seed: int = 0) -> Task:
    g = torch.Generator().manual_seed(seed)
    users = [UserData(torch.randn(4, dim, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(num_users)]
    x = torch.cat([u.x for u in users])
    y = torch.cat([u.y for u in users])
    return Task(name="tiny", users=users, eval_data=UserData(x, y), make_model=lambda: nn.Linear(dim, 3),
                num_classes=3, description="tiny")


def _privacy(**changes) -> PrivacyConfig:
    base = dict(num_users=40, expected_cohort=8, rounds=5, noise_multiplier=1.0, clip_norm=1.0, delta=1e-4,
                accountant="rdp")
    return PrivacyConfig(**{**base, **changes})


def test_noise_of_a_round_with_zero_updates_is_sigma_zeta_over_B():
    """Local lr so small that Δ_i ≈ 0: the model moves by the noise only, std σζ/B per coordinate."""
    zeros = UserData(torch.zeros(1, 2000), torch.zeros(1, dtype=torch.long))
    task = Task(name="zeros", users=[zeros] * 40, eval_data=zeros, make_model=lambda: nn.Linear(2000, 50), num_classes=50)
    privacy = _privacy(noise_multiplier=3.0, clip_norm=0.5, rounds=1)
    torch.manual_seed(0)
    before = ParamLayout.from_state_dict(dict(task.make_model().named_parameters()))
    state, records = run(task, privacy, make_optimizer("dp-fedavg"), LocalTraining(lr=1e-30), seed=0)
    torch.manual_seed(0)
    params0 = before.flatten({k: v.detach() for k, v in task.make_model().named_parameters()})
    moved = (state.params - params0).double()
    expected = 3.0 * 0.5 / 8
    assert abs(moved.std().item() / expected - 1) < 5 / math.sqrt(2 * moved.numel())
    assert records[0]["epsilon"] == pytest.approx(epsilon(privacy, 1))


def test_fedavg_with_negligible_noise_adds_the_clipped_updates_over_B():
    """Recompute round 1 by hand: same cohort, same local SGD, clip, sum, divide by B."""
    task = _task()
    privacy = _privacy(noise_multiplier=1e-12, rounds=1, clip_norm=0.05)
    training = LocalTraining(lr=0.5, batch_size=2)
    state, _ = run(task, privacy, make_optimizer("dp-fedavg"), training, seed=3)
    torch.manual_seed(3)
    model = task.make_model()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params0 = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    cohort = state.sampler.__class__(privacy, seed=3).next_cohort()
    total = torch.zeros_like(params0)
    for uid in cohort.tolist():
        delta, _ = local_delta(model, layout, params0, task.users[uid], training, user_generator(3, 0, uid))
        total += clip_update(delta, 0.05).update
    torch.testing.assert_close(state.params, params0 + total / privacy.expected_cohort, atol=1e-6, rtol=0)


def test_runs_are_reproducible_for_a_seed_and_differ_across_seeds():
    task, privacy = _task(), _privacy()
    a, ra = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=1)
    b, rb = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=1)
    c, _ = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=2)
    untimed = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]
    assert torch.equal(a.params, b.params) and untimed(ra) == untimed(rb)
    assert all(r["round_seconds"] > 0 for r in ra)
    assert not torch.equal(a.params, c.params)


def test_ledger_and_records_match_dp_accounting_every_round():
    task, privacy = _task(), _privacy(rounds=4)
    _, records = run(task, privacy, make_optimizer("dp-sgd"), LocalTraining(), seed=0, eval_every=2)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    for t, record in enumerate(records):
        assert record["epsilon"] == pytest.approx(epsilon(privacy, t + 1), rel=1e-12)
    assert "eval_accuracy" in records[1] and "eval_accuracy" not in records[0]


def test_every_optimizer_family_runs_through_the_engine():
    from fed_dp.context import simulation

    task, privacy = _task(), _privacy(rounds=3)
    for name in ["dp-sgdm", "dp-adambc", "dp-adamw-bc", "dp-adam-ime", "dp-adam-stp", "dp-adagrad-ime"]:
        _, records = run(task, privacy, make_optimizer(name), LocalTraining(), seed=0)
        assert isinstance(records[-1]["epsilon"], float)
        assert all(math.isfinite(r["update_norm"]) for r in records)
    with simulation():
        baseline = make_optimizer("noiseless-adam")
    _, records = run(task, privacy, baseline, LocalTraining(), seed=0)
    assert records[-1]["epsilon"] == "not private" and "alignment_ratio" in records[-1]


def test_population_mismatch_is_refused():
    with pytest.raises(ValueError, match="num_users"):
        run(_task(num_users=40), _privacy(num_users=41), make_optimizer("dp-sgd"), LocalTraining(), seed=0)


def test_local_training_validation():
    for kwargs in ({"epochs": 0}, {"batch_size": 0}, {"lr": -1.0}):
        with pytest.raises(ValueError):
            LocalTraining(**kwargs)


def test_vectorized_engine_run_matches_the_sequential_one():
    task, privacy = _task(), _privacy(rounds=3)
    sequential, records_s = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(batch_size=3),
                                seed=4, vectorized=False)
    vectorized, records_v = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(batch_size=3),
                                seed=4, vectorized=True)
    assert {r["vectorized"] for r in records_s} == {0.0} and {r["vectorized"] for r in records_v} == {1.0}
    torch.testing.assert_close(vectorized.params, sequential.params, rtol=1e-4, atol=1e-5)
    assert [r["epsilon"] for r in records_v] == [r["epsilon"] for r in records_s]


def test_device_is_resolved_with_clear_errors():
    from fed_dp.simulations.engine import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")


def test_evaluation_runs_in_eval_mode_and_restores_training_mode():
    """Dropout is off while evaluating (two evaluations agree exactly) and back on for local training."""
    from fed_dp.simulations.engine import evaluate

    task = _task()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    first, second = evaluate(model, layout, params, task), evaluate(model, layout, params, task)
    assert first == second and model.training
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.eval()(task.eval_data.x), task.eval_data.y)
    assert first["eval_loss"] == pytest.approx(float(expected))
