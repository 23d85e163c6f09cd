"""The in-process engine (fed_dp.train) runs fed_dp's round: its noise, denominator and accounting are fed_dp's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fed_dp.accounting import epsilon
from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.clients.training import local_delta, user_generator
from fed_dp.clipping import clip_update
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.flat import ParamLayout
from fed_dp.optimizers import make_optimizer
from fed_dp.randomness import derive_seed
from fed_dp.contribution import UserTrainingError
from fed_dp.round_loop import TrainingStopped
from fed_dp.simulations.engine.inprocess import train


def _task(num_users: int = 40, dim: int = 6, seed: int = 0) -> Task:
    g = torch.Generator().manual_seed(seed)
    users = [(torch.randn(4, dim, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(num_users)]
    x = torch.cat([u[0] for u in users])
    y = torch.cat([u[1] for u in users])
    return Task(name="tiny", users=Users.in_memory(users), model=lambda: nn.Linear(dim, 3), loss=losses.classification,
                evaluate=evaluation.classification((x, y)), description="tiny")


def run(task, privacy, optimizer, local, *, seed, **options):
    """The engine's result as (final server state, records)."""
    result = train(task, privacy, optimizer, local, seed=seed, **options)
    return result.state, result.records


def _privacy(**changes) -> PrivacyConfig:
    base = dict(num_users=40, expected_cohort=8, rounds=5, noise_multiplier=1.0, clip_norm=1.0, delta=1e-4,
                accountant="rdp")
    return PrivacyConfig(**{**base, **changes})


def test_noise_of_a_round_with_zero_updates_is_sigma_zeta_over_B():
    """Local lr so small that Δ_i ≈ 0: the model moves by the noise only, std σζ/B per coordinate."""
    zeros = (torch.zeros(1, 2000), torch.zeros(1, dtype=torch.long))
    task = Task(name="zeros", users=Users.in_memory([zeros] * 40), model=lambda: nn.Linear(2000, 50),
                loss=losses.classification)
    privacy = _privacy(noise_multiplier=3.0, clip_norm=0.5, rounds=1)
    torch.manual_seed(0)
    before = ParamLayout.from_state_dict(dict(task.build_model().named_parameters()))
    state, records = run(task, privacy, make_optimizer("dp-fedavg"), LocalTraining(lr=1e-30), seed=0)
    torch.manual_seed(0)
    params0 = before.flatten({k: v.detach() for k, v in task.build_model().named_parameters()})
    moved = (state.params - params0).double()
    expected = 3.0 * 0.5 / 8
    assert abs(moved.std().item() / expected - 1) < 5 / math.sqrt(2 * moved.numel())
    first = next(r for r in records if r["round"] == 1)  # rounds are numbered 1 … T
    assert first["epsilon"] == pytest.approx(epsilon(privacy, 1))


def test_fedavg_with_negligible_noise_adds_the_clipped_updates_over_B():
    """Recompute round 1 by hand: same cohort, same local SGD, clip, sum, divide by B."""
    task = _task()
    privacy = _privacy(noise_multiplier=1e-12, rounds=1, clip_norm=0.05)
    training = LocalTraining(lr=0.5, batch_size=2)
    state, _ = run(task, privacy, make_optimizer("dp-fedavg"), training, seed=3)
    torch.manual_seed(3)
    model = task.build_model()
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params0 = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    cohort = state.sampler.__class__(privacy, seed=derive_seed(3, "sampler")).next_cohort()  # the run's own seeds
    total = torch.zeros_like(params0)
    for uid in cohort.tolist():
        delta, _ = local_delta(model, layout, params0, task.users[uid], training, losses.classification,
                               user_generator(derive_seed(3, "local-training"), 0, uid))
        total += clip_update(delta, 0.05).update
    torch.testing.assert_close(state.params, params0 + total / privacy.expected_cohort, atol=1e-6, rtol=0)


def test_runs_are_reproducible_for_a_seed_and_differ_across_seeds():
    task, privacy = _task(), _privacy()
    a, ra = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=1)
    b, rb = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=1)
    c, _ = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(), seed=2)
    untimed = lambda records: [{k: v for k, v in r.items() if k != "nonprivate_round_seconds"} for r in records]
    assert torch.equal(a.params, b.params) and untimed(ra) == untimed(rb)
    assert all(r["nonprivate_round_seconds"] > 0 for r in ra[1:])  # ra[0]: round 0, the initial evaluation
    assert not torch.equal(a.params, c.params)


def test_ledger_and_records_match_dp_accounting_every_round():
    task, privacy = _task(), _privacy(rounds=4)
    _, records = run(task, privacy, make_optimizer("dp-sgd"), LocalTraining(), seed=0, eval_every=2)
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4]  # 0: the initial model's evaluation
    for record in records[1:]:
        assert record["epsilon"] == pytest.approx(epsilon(privacy, record["round"]), rel=1e-12)
    assert ["eval_accuracy" in r for r in records] == [True, False, True, False, True]


def test_every_optimizer_family_runs_through_the_engine():
    from fed_dp.context import simulation

    task, privacy = _task(), _privacy(rounds=3)
    for name in ["dp-sgdm", "dp-adambc", "dp-adamw-bc", "dp-adam-ime", "dp-adam-stp", "dp-adagrad-ime"]:
        _, records = run(task, privacy, make_optimizer(name), LocalTraining(), seed=0)
        assert isinstance(records[-1]["epsilon"], float)
        assert [r["round"] for r in records] == [0, 1, 2, 3]  # 0: the initial model's evaluation
        assert all(math.isfinite(r["update_norm"]) for r in records[1:])
    with simulation():
        baseline = make_optimizer("noiseless-adam")
    _, records = run(task, privacy, baseline, LocalTraining(), seed=0)
    assert records[-1]["epsilon"] == "not private" and "nonprivate_alignment_ratio" in records[-1]


def test_population_mismatch_is_refused():
    with pytest.raises(ValueError, match="task has 40 users"):
        run(_task(num_users=40), _privacy(num_users=41), make_optimizer("dp-sgd"), LocalTraining(), seed=0)


def test_local_training_validation():
    for kwargs in ({"epochs": 0}, {"batch_size": 0}, {"lr": -1.0}):
        with pytest.raises(ValueError):
            LocalTraining(**kwargs)


def test_vectorized_engine_run_matches_the_sequential_one():
    task, privacy = _task(), _privacy(rounds=3)
    sequential, records_s = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(batch_size=3),
                                seed=4, training="sequential")
    vectorized, records_v = run(task, privacy, make_optimizer("dp-adam", lr=0.05), LocalTraining(batch_size=3),
                                seed=4, training="vectorized")
    assert {r["nonprivate_vectorized"] for r in records_s[1:]} == {0.0}  # [0]: round 0, the initial evaluation
    assert {r["nonprivate_vectorized"] for r in records_v[1:]} == {1.0}
    torch.testing.assert_close(vectorized.params, sequential.params, rtol=1e-4, atol=1e-5)
    assert [r["epsilon"] for r in records_v] == [r["epsilon"] for r in records_s]


def test_device_is_resolved_with_clear_errors():
    from fed_dp.clients.training import resolve_device

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
    from fed_dp.clients.evaluation import evaluate_params

    task = _task()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    params = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    first, second = (evaluate_params(model, layout, params, task.evaluate) for _ in range(2))
    assert first == second and model.training
    x = torch.cat([task.users[i].fields[0] for i in range(task.num_users)])
    y = torch.cat([task.users[i].fields[1] for i in range(task.num_users)])
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.eval()(x), y)
    assert first["eval_loss"] == pytest.approx(float(expected))


def test_target_epsilon_is_calibrated_in_one_step_and_num_users_comes_from_the_task():
    task = _task()
    privacy = PrivacyConfig(expected_cohort=8, rounds=4, target_epsilon=2.0, delta=1e-4, accountant="rdp")
    result = train(task, privacy, "dp-sgd", LocalTraining(), seed=0)
    assert result.privacy.num_users == 40 and result.privacy.target_epsilon is None
    assert result.epsilon == pytest.approx(epsilon(result.privacy, 4)) and result.epsilon <= 2.0
    assert result.epsilon > 1.99  # the smallest σ that meets the target: ε is at the target, not far below
    assert isinstance(result.model, nn.Linear)
    torch.testing.assert_close(torch.cat([result.model.weight.reshape(-1), result.model.bias]), result.params)


def test_checkpoint_resume_through_the_engine_reaches_the_uninterrupted_model(tmp_path):
    task, privacy = _task(), _privacy(rounds=4)
    straight = train(task, privacy, "dp-adam", LocalTraining(), seed=5)
    partial = train(task, privacy.replace(rounds=4), "dp-adam", LocalTraining(), seed=5,
                    checkpoint_dir=str(tmp_path), on_round=lambda r: None)
    assert torch.equal(partial.params, straight.params)
    # a second run with the same folder resumes at the end: nothing more is trained or accounted
    again = train(task, privacy, "dp-adam", LocalTraining(), seed=5, checkpoint_dir=str(tmp_path))
    assert torch.equal(again.params, straight.params) and [r["round"] for r in again.records] == [0, 1, 2, 3, 4]


def test_bad_task_inputs_get_clear_errors():
    task = _task()
    with pytest.raises(ValueError, match="fed_dp.Task"):
        train("not a task", _privacy(), "dp-sgd")
    regression = Task(name="float-targets", users=Users.in_memory([(torch.randn(3, 6), torch.randn(3))] * 40),
                      model=lambda: nn.Linear(6, 3), loss=losses.classification)
    # Issue 40 item 5: every user fails with the wrong loss, before any release: a configuration error (it was a
    # TrainingStopped, a RuntimeError, which `except ValueError` missed), with the loss's own error as its cause
    with pytest.raises(ValueError, match=r"the task does not train: round 1, user \d+: ValueError: .*regression "
                                         r"target.*users \d+, \d+, \d+ each fail alone.*no privacy budget") as failed:
        train(regression, _privacy(), "dp-sgd", seed=0)  # the first round's users train with the wrong loss
    assert type(failed.value) is ValueError and isinstance(failed.value.__cause__, ValueError)
    assert "regression target" in str(failed.value.__cause__)
    not_a_module = Task(name="x", users=task.users, model=lambda: "model", loss=losses.classification)
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        train(not_a_module, _privacy(), "dp-sgd", seed=0)


def test_a_loss_that_turns_nan_mid_run_raises_naming_the_user_and_leaves_the_checkpoint_intact(tmp_path):
    """The error comes before round 3 is released: the checkpoint still holds round 2, and a run resumed
    from it (with a sane loss) continues the same ledger."""
    from fed_dp.checkpoint import load_checkpoint

    calls = {"n": 0}

    def fragile(model, batch):
        calls["n"] += 1
        value = losses.classification(model, batch)
        return value * float("nan") if calls["n"] > limit else value

    task = _task()
    # one user at a time, so that the loss is called once per user and round (vectorized: once per chunk)
    good = train(task, _privacy(rounds=2), "dp-sgd", LocalTraining(), seed=1, training="sequential")
    limit = sum(r.get("nonprivate_cohort_size", 0) for r in good.records) * 1  # round 0 (initial model): none  # batch 16 > 4 examples: one step per user and round
    bad_task = Task(name="fragile", users=task.users, model=task.model, loss=fragile)
    with pytest.raises(TrainingStopped, match=r"round 3, user \d+: ValueError: .*loss of user \d+ became nan .*round 3") \
            as stopped:
        train(bad_task, _privacy(rounds=4), "dp-sgd", LocalTraining(), seed=1, checkpoint_dir=str(tmp_path),
              training="sequential")
    assert isinstance(stopped.value.__cause__, UserTrainingError)
    assert isinstance(stopped.value.__cause__.__cause__, ValueError)
    saved = load_checkpoint(tmp_path)["state"]
    assert saved["round"] == 2 and len(saved["ledger"]["records"]) == 2
    resumed = train(task, _privacy(rounds=4), "dp-sgd", LocalTraining(), seed=1, checkpoint_dir=str(tmp_path))
    assert [r["round"] for r in resumed.records] == [1, 2, 3, 4]  # the run began without evaluation: no round 0
    assert resumed.epsilon == pytest.approx(epsilon(_privacy(rounds=4), 4))


def test_an_in_process_run_publishes_no_count_or_duration_and_keeps_them_secret(tmp_path):
    """Issue 25 items 3 and 4: on main results.json and checkpoint-<round>.pt of an in-process run held the exact
    counts (nonprivate_cohort_size, ...) and every record round_seconds, a timing channel on the cohort size. Now
    the published files hold neither; secret/diagnostics.jsonl and the secret part keep them, and the records
    returned (and restored by a resume) still hold them for the researcher."""
    import json

    from fed_dp.checkpoint import load_checkpoint, read_diagnostics

    task, privacy = _task(), _privacy()
    result = train(task, privacy, "dp-adam", LocalTraining(), seed=1, eval_every=0, checkpoint_dir=str(tmp_path))
    for published in (json.loads((tmp_path / "results.json").read_text()), load_checkpoint(tmp_path)["extra"]["records"]):
        assert [r["round"] for r in published] == list(range(1, privacy.rounds + 1))  # eval_every=0: no round 0
        assert not {key for r in published for key in r if key.startswith("nonprivate_") or "seconds" in key}
    diagnostics = read_diagnostics(tmp_path)
    assert [d["cohort_size"] for d in diagnostics] == [r["nonprivate_cohort_size"] for r in result.records]
    assert all(d["round_seconds"] == r["nonprivate_round_seconds"] for d, r in zip(diagnostics, result.records))
    assert train(task, privacy, "dp-adam", LocalTraining(), seed=1, eval_every=0,
                 checkpoint_dir=str(tmp_path)).records == result.records  # resumed: the secret part restores them


def _lazy_task(empty: int | None = None, loaded: list[int] | None = None) -> Task:
    """The tiny task's users loaded on demand (each load appended to ``loaded``); user ``empty`` without examples
    (as a user whose folder was left empty)."""
    task = _task()
    data = {i: task.users[i] for i in range(task.num_users)}
    if empty is not None:
        data[empty] = (torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))

    def load(uid: int):
        if loaded is not None:
            loaded.append(uid)
        return data[uid]

    return Task(name="lazy", users=Users(list(range(task.num_users)), load), model=task.model,
                loss=losses.classification)


def test_a_lazily_loaded_user_without_examples_stops_the_run_with_the_model_so_far(tmp_path):
    """Issue 27: such a user stopped the run in the round it was first sampled and returned no model. Now the
    error names that round and the user, nothing of the round is released, the checkpoint holds the last
    released round, and the model after it comes back with the error."""
    from fed_dp.checkpoint import load_checkpoint

    privacy = _privacy(rounds=6, expected_cohort=4)
    loaded: list[int] = []
    healthy = train(_lazy_task(loaded=loaded), privacy, "dp-sgd", LocalTraining(), seed=2).records
    assert len(healthy) == 6  # a healthy run releases every round
    first_round = loaded[:healthy[0]["nonprivate_cohort_size"]]
    empty = next(u for u in loaded if u not in first_round)  # a user first sampled after round 1
    with pytest.raises(TrainingStopped) as stopped:
        train(_lazy_task(empty), privacy, "dp-sgd", LocalTraining(), seed=2, checkpoint_dir=str(tmp_path))
    stop = stopped.value
    failed = stop.failure.round_number
    assert failed > 1 and stop.failure.user == empty
    assert f"round {failed}, user {empty}: ValueError: user {empty} has no examples" in str(stop)
    assert f"The run stopped before releasing round {failed}: nothing of it was released" in str(stop)
    assert f"saved in {tmp_path}" in str(stop)
    result = stop.result
    assert len(result.records) == failed - 1 == stop.state.round
    assert [r["epsilon"] for r in result.records] == [r["epsilon"] for r in healthy[:failed - 1]]
    saved = load_checkpoint(tmp_path)["state"]
    assert saved["round"] == failed - 1
    torch.testing.assert_close(saved["params"], result.params, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in result.model.parameters()]),
                               result.params, rtol=0, atol=0)


def test_a_non_scalar_loss_names_the_round_and_the_user():
    task = _task()
    per_example = Task(name="per-example", users=task.users, model=task.model,
                       loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none"))
    with pytest.raises(ValueError, match=r"round 1, user \d+: ValueError: the loss returned \(4,\) for a minibatch "
                                         r"of user \d+; it must return a scalar") as failed:
        train(per_example, _privacy(), "dp-sgd", LocalTraining(), seed=0, training="sequential")
    assert not isinstance(failed.value, TrainingStopped) and "Nothing was released" in str(failed.value)


def test_users_whose_data_all_fail_to_load_are_a_configuration_error_and_one_users_a_stopped_run():
    """Issue 40 item 5: a loader that fails for every user (a missing folder) is the task's set-up, reported as a
    ValueError before any release; a loader that fails for one user only stops the run (TrainingStopped) in the
    round that samples it, with the model so far."""
    task = _task()

    def missing(uid):
        raise FileNotFoundError(f"users/{uid}.pt")

    broken = Task(name="missing", users=Users(list(range(40)), missing), model=task.model, loss=losses.classification)
    with pytest.raises(ValueError, match=r"the task does not train: .*FileNotFoundError.*the examples of users "
                                         r"\d+, \d+, \d+ all fail to load") as failed:
        train(broken, _privacy(), "dp-sgd", LocalTraining(), seed=0)
    assert isinstance(failed.value.__cause__, ValueError) and isinstance(failed.value.__cause__.__cause__,
                                                                         FileNotFoundError)
    data = {i: task.users[i] for i in range(40)}

    def one_missing(uid):
        if uid == 7:
            raise FileNotFoundError("users/7.pt")
        return data[uid]

    one = Task(name="one-missing", users=Users(list(range(40)), one_missing), model=task.model,
               loss=losses.classification)
    with pytest.raises(TrainingStopped, match=r"round \d+, user 7: ValueError: .*users/7.pt"):
        train(one, _privacy(rounds=20), "dp-sgd", LocalTraining(), seed=0)


def test_a_training_path_that_fails_for_users_together_but_not_alone_is_a_configuration_error():
    """A loss that reads a value in Python (``.item()``) trains each user alone but not vectorized over users
    (client.training = "vectorized"): the training path's failure, a ValueError naming it, before any release."""
    task = _task()

    def reads_a_value(model, batch):
        value = losses.classification(model, batch)
        return value if value.item() < 1e9 else value * 0

    scalar = Task(name="item", users=task.users, model=task.model, loss=reads_a_value)
    assert train(scalar, _privacy(rounds=1), "dp-sgd", LocalTraining(epochs=2), seed=0,
                 training="sequential").records[-1]["round"] == 1
    with pytest.raises(ValueError, match=r"the task does not train: .*only training them together fails \(the "
                                         r"training path: client.training"):
        train(scalar, _privacy(), "dp-sgd", LocalTraining(epochs=2), seed=0, training="vectorized")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_servers_step_runs_on_the_users_device_and_the_result_comes_back_on_the_host():
    """On a GPU the whole round stays there: the server's θ, optimizer state and noise stream are on the device
    (DP-AdamBC's diagnostics included), ε is the CPU run's, and the returned model is on the host."""
    config = PrivacyConfig(expected_cohort=8, rounds=3, noise_multiplier=1.0, clip_norm=0.5, delta=1e-5)
    local = LocalTraining(batch_size=4, lr=0.1)
    on_gpu = train(_task(), config, "dp-adambc", local, seed=3, device="cuda", eval_every=0)
    on_cpu = train(_task(), config, "dp-adambc", local, seed=3, device="cpu", eval_every=0)
    assert on_gpu.state.params.device.type == "cuda" and on_gpu.state.privatizer.device.type == "cuda"
    assert all(v.device.type == "cuda" for v in on_gpu.state.opt_state if isinstance(v, torch.Tensor))
    assert on_gpu.params.device.type == "cpu" and torch.isfinite(on_gpu.params).all()
    assert [r["epsilon"] for r in on_gpu.records] == [r["epsilon"] for r in on_cpu.records]
    assert "nu_hat_median" in on_gpu.records[-1]


def test_train_resolves_the_privacy_configuration_once_and_run_plan_runs_a_resolved_plan(monkeypatch):
    """Issue 41: the keywords become one plan, validated once; σ is calibrated once (resolve_privacy ran twice on
    one path before: the runner's, then train's). run_plan refuses a plan whose privacy is not resolved, or is
    resolved for another population, before any work."""
    import fed_dp.simulations.engine.inprocess as inprocess
    from fed_dp.plan import RunPlan

    calls = []
    resolve = inprocess.resolve_privacy
    monkeypatch.setattr(inprocess, "resolve_privacy", lambda *args: calls.append(args) or resolve(*args))
    task = _task()
    result = train(task, _privacy(num_users=None, noise_multiplier=None, target_epsilon=8.0, rounds=2), "dp-sgd",
                   LocalTraining(), seed=0, eval_every=0)
    assert len(calls) == 1 and result.privacy.num_users == 40 and result.privacy.target_epsilon is None
    plan = RunPlan(privacy=result.privacy, optimizer=make_optimizer("dp-sgd"), local=LocalTraining(), seed=0,
                   noise_source="torch", eval_every=0)
    again = inprocess.run_plan(task, plan)
    assert len(calls) == 1  # a resolved plan is run as it is
    assert torch.equal(again.params, result.params)  # the same run: the plan holds everything train was told
    with pytest.raises(ValueError, match="run_plan needs a resolved PrivacyConfig, but num_users is not set"):
        inprocess.run_plan(task, RunPlan(privacy=result.privacy.replace(num_users=None), optimizer=plan.optimizer,
                                         noise_source="torch"))
    with pytest.raises(ValueError, match="resolved for N = 41 users but the task has 40"):
        inprocess.run_plan(task, RunPlan(privacy=result.privacy.replace(num_users=41), optimizer=plan.optimizer,
                                         noise_source="torch"))
    with pytest.raises(ValueError, match="run_plan needs a fed_dp.plan.RunPlan, got PrivacyConfig"):
        inprocess.run_plan(task, result.privacy)


def test_under_torchrun_only_rank_0_calibrates_the_noise(monkeypatch):
    """σ is calibrated by the process that runs the rounds: a torchrun rank other than 0 only trains its share of the
    cohort and takes rank 0's result, so it neither calibrates (it did, on every rank, once train built a plan;
    before that only rank 0 did) nor needs a resolved plan."""
    import fed_dp.simulations.engine.inprocess as inprocess
    from fed_dp.simulations.engine.distributed import Workers

    def no_calibration(*args):
        raise AssertionError("a rank other than 0 calibrated σ")

    served = []
    monkeypatch.setattr(inprocess, "current_workers", lambda: Workers(1, 2, torch.device("cpu")))
    monkeypatch.setattr(inprocess, "share_seed", lambda workers, seed: seed)
    monkeypatch.setattr(inprocess, "serve_rounds", lambda workers, trainer, params, seed: served.append(seed) or 3)
    monkeypatch.setattr(inprocess, "_worker_result", lambda workers, model, layout, rounds: ("rank 0's", rounds))
    monkeypatch.setattr(inprocess, "resolve_privacy", no_calibration)
    privacy = _privacy(num_users=None, noise_multiplier=None, target_epsilon=8.0, rounds=2)
    assert train(_task(), privacy, "dp-sgd", LocalTraining(), seed=0, eval_every=0) == ("rank 0's", 3)
    assert len(served) == 1
