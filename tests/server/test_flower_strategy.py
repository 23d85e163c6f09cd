"""The Flower adapter without a running Flower: the message protocol both ways, malformed replies, and the
UserLevelDP Strategy driven by an in-process grid whose nodes answer with fed-dp's own client helpers.

Flower's runtime (SuperLink, SuperNodes, Ray) is exercised by test_flower_simulation.py, test_bad_replies.py
and test_deployment.py; here messages are real ``flwr.app.Message`` objects passed by a test grid.
"""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.checkpoint import COMMIT_NAME, RESULTS_NAME, load_checkpoint, read_diagnostics
from fed_dp.clients import protocol
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.replies import hosted_users, query_reply, train_reply
from fed_dp.clients.task import Examples, Task, Users, initial_model
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import make_optimizer
from fed_dp.contribution import UserTrainingError
from fed_dp.round import Contribution, init_server, begin_round
from fed_dp.server.flower_strategy import UserLevelDP, centralized_evaluation, model_arrays
from fed_dp.server.membership import ModelMismatchError, ModelNotReportedError, NoUsersError
from fed_dp.round_loop import NoRepliesError
from fed_dp.simulations.tasks.builtin import heavy_tail_task
from fed_dp.simulations.engine.inprocess import train
from inprocess_grid import Handler, InProcessGrid, server_identity  # noqa: F401 (server_identity: autouse fixture)

TASK = heavy_tail_task()  # 40 users, a linear model (d = 64·7)
MODEL = TASK.build_model()  # what the nodes report in their answer to the user query (query_reply's model=)
LOCAL = LocalTraining(batch_size=2, lr=0.5)
PRIVACY = PrivacyConfig(num_users=40, expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")


def honest_node(node_id: int, parts: int) -> Handler:
    """A node of a Flower simulation with ``parts`` partitions: fed-dp's own client helpers answer."""
    trainer = LocalTrainer(TASK, LOCAL, device="cpu")
    users = hosted_users({"partition-id": node_id - 100, "num-partitions": parts}, TASK.num_users)

    def handle(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, users, model=trainer.model)
        return train_reply(message, trainer, hosted=users)

    return handle


def honest_grid(parts: int = 2) -> InProcessGrid:
    return InProcessGrid({100 + p: honest_node(100 + p, parts) for p in range(parts)})


def _plan(scale: bool = False, squares: bool = False, bits: bool = False):
    optimizer = make_optimizer("dp-adam-stp" if scale else "dp-adam-ime" if squares else "dp-fedavg")
    from fed_dp.adaptive_clipping import AdaptiveClipConfig

    adaptive = AdaptiveClipConfig(bit_noise_std=5.0, initial_clip_norm=1.0) if bits else None
    state = init_server(PRIVACY, optimizer, torch.zeros(6), seed=1, adaptive_clipping=adaptive)
    return begin_round(state)


# --- the protocol, both ways -----------------------------------------------------------------------------


def test_train_message_and_reply_round_trip():
    plan = _plan(scale=True)
    named = {"w": torch.arange(6.0).reshape(2, 3)}
    message = protocol.train_message(plan, 7, [3, 5], named, seed=11, config={"lr": 0.5})
    request = protocol.parse_train_request(message)
    assert (request.round, request.users, request.clip_norm, request.seed) == (0, (3, 5), 1.0, 11)
    assert request.send_squares is False and request.send_clip_bits is False and request.config == {"lr": 0.5}
    assert torch.equal(request.params["w"], named["w"]) and torch.equal(request.scale, plan.scale)
    contribution = Contribution(torch.linspace(-1, 1, 6), 2, scaled=True)
    reply = protocol.make_train_reply(message, request, contribution, {"train_loss": 0.3, "bad": math.nan})
    assert reply.metadata.src_node_id == 7 and dict(reply.content[protocol.METRICS]) == {"train_loss": 0.3}
    parsed = protocol.parse_train_reply(reply, plan, asked=2, dim=6, dtype=torch.float64)
    assert parsed.count == 2 and parsed.scaled and parsed.source == "node 7"
    assert parsed.total.dtype == torch.float64 and torch.allclose(parsed.total, contribution.total.double())


@pytest.mark.parametrize("kind, contribution, message", [
    ("squares", Contribution(torch.zeros(6), 1), "Σu²"),
    ("bits", Contribution(torch.zeros(6), 1), "not clipped"),
    ("scale", Contribution(torch.zeros(6), 1), "s_t"),
    ("plain", Contribution(torch.zeros(6), 3), "3 users; 1 were requested"),
])
def test_a_client_reply_that_does_not_answer_the_request_fails_on_the_client(kind, contribution, message):
    """A custom ClientApp using the parse/reply pair cannot forget s_t, squares or clip bits silently."""
    plan = _plan(scale=kind == "scale", squares=kind == "squares", bits=kind == "bits")
    request = protocol.parse_train_request(protocol.train_message(plan, 7, [3], {"w": torch.zeros(6)}, seed=1))
    with pytest.raises(ValueError, match=message):
        protocol.make_train_reply(Message(RecordDict(), dst_node_id=7, message_type=MessageType.TRAIN), request,
                                  contribution)


def _reply(plan, content: dict, node: int = 7) -> Message:
    request = protocol.train_message(plan, node, [1, 2], {"w": torch.zeros(6)}, seed=1)
    return Message(RecordDict(content), reply_to=request)


@pytest.mark.parametrize("content, reason", [
    ({}, "lacks"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(6)}),
      protocol.REPLY: MetricRecord({"count": 5})}, "reports 5 users but 2 were asked"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.tensor([0.0, math.nan, 0, 0, 0, 0])}),
      protocol.REPLY: MetricRecord({"count": 1})}, "NaN"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(9)}),
      protocol.REPLY: MetricRecord({"count": 1})}, r"shape \(9,\)"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(6, dtype=torch.int64)}),
      protocol.REPLY: MetricRecord({"count": 1})}, "dtype"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"other": torch.zeros(6)}),
      protocol.REPLY: MetricRecord({"count": 1})}, "total is missing"),
    ({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(6)}),
      protocol.REPLY: MetricRecord({"count": 1, "scaled": 1})}, "no s_t was broadcast"),
])
def test_malformed_replies_are_refused_with_the_reason(content, reason):
    with pytest.raises(protocol.ReplyError, match=reason):
        protocol.parse_train_reply(_reply(_plan(), content), _plan(), asked=2, dim=6, dtype=torch.float32)


def test_error_replies_and_missing_clip_bits_are_refused():
    plan = _plan(bits=True)
    request = protocol.train_message(plan, 7, [1], {"w": torch.zeros(6)}, seed=1)
    error = Message(Error(code=3, reason="Traceback ...\nValueError: the disk is full"), reply_to=request)
    with pytest.raises(protocol.ReplyError, match="the disk is full"):
        protocol.parse_train_reply(error, plan, asked=1, dim=6, dtype=torch.float32)
    without_bits = _reply(plan, {protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(6)}),
                                 protocol.REPLY: MetricRecord({"count": 1})})
    with pytest.raises(protocol.ReplyError, match="clip-bit"):
        protocol.parse_train_reply(without_bits, plan, asked=1, dim=6, dtype=torch.float32)


def test_a_node_with_another_model_gets_a_clear_error():
    trainer = LocalTrainer(TASK, LOCAL, device="cpu")
    with pytest.raises(ValueError, match="does not match this node's model"):
        trainer.flat_params({"linear.weight": torch.zeros(3, 3)})


# --- the Strategy --------------------------------------------------------------------------------------------


def test_the_strategy_trains_like_the_in_process_engine_with_the_same_seeds(tmp_path):
    """Two nodes hosting 20 users each: ε every round = dp_accounting's; the final model = fed_dp.train's for
    the same seed (float32 sums added per node first: rtol 1e-5)."""
    model = initial_model(TASK, 7)[0]
    strategy = UserLevelDP(PRIVACY, "dp-adam", seed=7, checkpoint_dir=str(tmp_path), eval_every=1)
    grid = honest_grid()
    result = strategy.start(grid, model_arrays(model), evaluate_fn=None)
    engine = train(TASK, PRIVACY, "dp-adam", LOCAL, seed=7, device="cpu")
    assert [r["round"] for r in engine.records] == [0, 1, 2, 3]  # the engine evaluated the initial model (round 0)
    assert [r["round"] for r in result.records] == [1, 2, 3]  # evaluate_fn=None: no evaluation, no round 0
    assert [r["epsilon"] for r in result.records] == [epsilon(PRIVACY, t) for t in (1, 2, 3)] == \
        [r["epsilon"] for r in engine.records[1:]]
    assert result.epsilon == epsilon(PRIVACY, 3) and result.delta == 1e-5 and result.stopped is None
    counts = read_diagnostics(tmp_path)  # the operator's (secret) diagnostics: nothing of it is in the records
    assert [c["cohort_size"] for c in counts] == [r["nonprivate_cohort_size"] for r in engine.records[1:]]
    assert all(c["replied_users"] == c["cohort_size"] and not c["dropped"] for c in counts)
    published = {key for record in result.records for key in record}
    assert not published & {"cohort_size", "replied_users", "unclipped_users", "reclipped_replies", "dropped",
                            "round_seconds"}  # issue 25 item 3: the duration grows with the cohort
    assert not any(key.startswith("nonprivate") for key in published)
    assert all(c["round_seconds"] > 0 for c in counts)
    final = strategy.layout.flatten(dict(result.arrays.to_torch_state_dict()))
    torch.testing.assert_close(final, engine.params, rtol=1e-5, atol=1e-6)
    assert torch.equal(load_checkpoint(tmp_path)["state"]["params"], strategy.state.params)
    queries = [m for m in grid.sent if m.metadata.message_type == MessageType.QUERY]
    assert len(queries) == 2  # each node is asked once which users it hosts


def test_the_strategy_evaluates_the_initial_model_at_round_0_and_numbers_rounds_from_1():
    """Flower's convention: evaluate_fn(0, initial model) before round 1, then rounds 1 … T; the engine's
    records agree (round 0 the initial evaluation, ε 0), and Flower's per-round metrics use the same numbers."""
    model = initial_model(TASK, 7)[0]
    result = UserLevelDP(PRIVACY, "dp-adam", seed=7, eval_every=2).start(
        honest_grid(), model_arrays(model), evaluate_fn=centralized_evaluation(TASK))
    assert [r["round"] for r in result.records] == [0, 1, 2, 3]
    assert result.records[0]["epsilon"] == 0.0 and "eval_accuracy" in result.records[0]
    assert ["eval_accuracy" in r for r in result.records] == [True, False, True, True]  # 0, t % 2 == 0, last
    assert sorted(result.evaluate_metrics_serverapp) == [0, 2, 3]
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]


def test_blt_noise_through_the_strategy_trains_like_the_engine_and_resumes(tmp_path, monkeypatch):
    """noise = "blt" through the Flower Strategy: same model and ε as the engine, and a run stopped after
    round 2 resumes from its checkpoint (BLT buffers, generator, ledger) to the same final model."""
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "cache"))
    privacy = PRIVACY.replace(sampler="min-sep", noise="blt", buffers=2, rounds=4)
    model = initial_model(TASK, 5)[0]
    engine = train(TASK, privacy, "dp-adambc", LOCAL, seed=5, device="cpu")
    whole = UserLevelDP(privacy, "dp-adambc", seed=5).start(honest_grid(), model_arrays(model))
    assert [r["epsilon"] for r in whole.records] == [epsilon(privacy, t) for t in range(1, 5)] == \
        [r["epsilon"] for r in engine.records[1:]]  # engine.records[0]: round 0, the initial evaluation
    first = UserLevelDP(privacy, "dp-adambc", seed=5, checkpoint_dir=str(tmp_path / "ckpt"))
    first.start(honest_grid(), model_arrays(model), num_rounds=2)
    resumed = UserLevelDP(privacy, "dp-adambc", seed=5, checkpoint_dir=str(tmp_path / "ckpt"))  # the same noise source
    result = resumed.start(honest_grid(), model_arrays(model))
    assert [r["epsilon"] for r in result.records] == [r["epsilon"] for r in whole.records]
    final = resumed.layout.flatten(dict(result.arrays.to_torch_state_dict()))
    whole_params = resumed.layout.flatten(dict(whole.arrays.to_torch_state_dict()))
    # The noise stream resumes bit for bit (tests/fed_dp/test_round.py); the local training of a fresh node
    # object can differ from a reused one in the last float32 bit, hence a tolerance of a few ulps here.
    torch.testing.assert_close(final, whole_params, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(whole_params, engine.params, rtol=1e-5, atol=1e-6)


def test_configure_and_aggregate_train_run_the_same_round_as_start():
    model = initial_model(TASK, 3)[0]
    by_hand = UserLevelDP(PRIVACY, "dp-fedavg", seed=3)
    grid = honest_grid()
    messages = list(by_hand.configure_train(1, model_arrays(model), ConfigRecord(), grid))
    assert {m.metadata.dst_node_id for m in messages} <= {100, 101}
    arrays, metrics = by_hand.aggregate_train(1, grid.send_and_receive(messages))
    assert metrics["epsilon"] == pytest.approx(epsilon(PRIVACY, 1))
    whole = UserLevelDP(PRIVACY, "dp-fedavg", seed=3).start(honest_grid(), model_arrays(model), num_rounds=1)
    assert torch.equal(arrays.to_torch_state_dict()["linear.weight"], whole.arrays.to_torch_state_dict()["linear.weight"])
    with pytest.raises(ValueError, match="without configure_train"):
        by_hand.aggregate_train(2, [])


class WithConfigKey(UserLevelDP):
    """Flower's usual extension: a key added to every round's train config before the base method runs."""

    def configure_train(self, server_round, arrays, config, grid):
        config["user-note"] = f"round {server_round}"
        return super().configure_train(server_round, arrays, config, grid)


class WithMetricsLog(UserLevelDP):
    """Flower's usual extension: the aggregated metrics logged and transformed (a key added, one renamed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, float]] = []

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.seen.append((server_round, metrics["epsilon"]))
        metrics["epsilon-percent-of-budget"] = 100 * metrics["epsilon"] / 4.0
        metrics["eps"] = metrics.pop("epsilon")
        return arrays, metrics


def config_recording_grid(seen: list[dict]) -> InProcessGrid:
    """The honest grid, its nodes recording the config of each TRAIN message they get (what a ClientApp reads)."""
    grid = honest_grid()
    for node_id, handler in list(grid.nodes.items()):
        def recording(message: Message, handler=handler) -> Message:
            if message.metadata.message_type == MessageType.TRAIN:
                seen.append(protocol.parse_train_request(message).config)
            return handler(message)
        grid.nodes[node_id] = recording
    return grid


def test_an_overridden_configure_train_reaches_the_nodes_with_checkpoint_and_evaluation(tmp_path):
    """Issue 27: start goes through configure_train, so a subclass's config key is in every TRAIN message and
    reaches the ClientApp; the checkpoint, the ledger and the evaluation (round 0, then every round) still happen
    once per round, and the model is the one the base strategy trains."""
    seen: list[dict] = []
    model = initial_model(TASK, 8)[0]
    strategy = WithConfigKey(PRIVACY, "dp-fedavg", seed=8, checkpoint_dir=str(tmp_path / "ckpt"))
    result = strategy.start(config_recording_grid(seen), model_arrays(model), evaluate_fn=centralized_evaluation(TASK))
    assert seen and {c["user-note"] for c in seen} == {"round 1", "round 2", "round 3"}
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]
    assert all("eval_accuracy" in record for record in result.records)
    saved = load_checkpoint(tmp_path / "ckpt")["state"]
    assert saved["round"] == 3 and len(saved["ledger"]["records"]) == 3
    assert [r["round"] for r in json.loads((tmp_path / "ckpt" / RESULTS_NAME).read_text())] == [0, 1, 2, 3]
    plain = UserLevelDP(PRIVACY, "dp-fedavg", seed=8).start(honest_grid(), model_arrays(model))
    assert torch.equal(strategy.layout.flatten(dict(result.arrays.to_torch_state_dict())),
                       strategy.layout.flatten(dict(plain.arrays.to_torch_state_dict())))


def test_an_overridden_aggregate_train_shapes_the_result_but_not_the_published_records(tmp_path):
    """Issue 27: start goes through aggregate_train, so a subclass sees every round's metrics and its returned
    metrics are the result's train metrics; the published records and results.json keep the core round's keys,
    and the checkpoint and evaluation still happen."""
    strategy = WithMetricsLog(PRIVACY, "dp-fedavg", seed=9, checkpoint_dir=str(tmp_path))
    result = strategy.start(honest_grid(), model_arrays(initial_model(TASK, 9)[0]),
                            evaluate_fn=centralized_evaluation(TASK))
    assert strategy.seen == [(t, pytest.approx(epsilon(PRIVACY, t))) for t in (1, 2, 3)]
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    for t, metrics in result.train_metrics_clientapp.items():
        assert "epsilon" not in metrics and metrics["eps"] == pytest.approx(epsilon(PRIVACY, t))
        assert metrics["epsilon-percent-of-budget"] == pytest.approx(25 * epsilon(PRIVACY, t))
    published = json.loads((tmp_path / RESULTS_NAME).read_text())
    assert [r["epsilon"] for r in published] == [r["epsilon"] for r in result.records]
    assert not any("eps" in r or "epsilon-percent-of-budget" in r for r in published)
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]
    assert load_checkpoint(tmp_path)["state"]["round"] == 3


def test_overrides_do_not_skip_the_empty_round_stop(tmp_path):
    """Nodes that fail every round: with both methods overridden, the run still stops after max_empty_rounds,
    with exactly those rounds aggregated (noised, in the ledger), seen by the override and checkpointed."""
    class Both(WithConfigKey, WithMetricsLog):
        pass

    def broken(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, range(20) if message.metadata.dst_node_id == 100 else range(20, 40),
                               model=MODEL)
        raise RuntimeError("out of memory")

    strategy = Both(PRIVACY.replace(rounds=5), "dp-fedavg", seed=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(NoRepliesError, match="last 2 rounds.*resume"):
        strategy.start(InProcessGrid({100: broken, 101: broken}), model_arrays(initial_model(TASK, 2)[0]))
    assert [t for t, _ in strategy.seen] == [1, 2] and strategy.state.ledger.rounds == 2
    saved = load_checkpoint(tmp_path)["state"]
    assert saved["round"] == 2 and len(saved["ledger"]["records"]) == 2


class SkipsTheCore(UserLevelDP):
    def aggregate_train(self, server_round, replies):
        return None, MetricRecord({"replies": float(len(list(replies)))})


class ReturnsOwnModel(UserLevelDP):
    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        return ArrayRecord(torch_state_dict={k: v + 1 for k, v in arrays.to_torch_state_dict().items()}), metrics


class SendsOwnMessages(UserLevelDP):
    def configure_train(self, server_round, arrays, config, grid):
        return [Message(RecordDict(), dst_node_id=100, message_type=MessageType.TRAIN)]


class EvaluatesOnClients(UserLevelDP):
    def configure_evaluate(self, server_round, arrays, config, grid):
        return super().configure_evaluate(server_round, arrays, config, grid)


@pytest.mark.parametrize("strategy_class, error, message", [
    (EvaluatesOnClients, ValueError, r"does not run federated evaluation.*EvaluatesOnClients's configure_evaluate "
                                     r"would never run; evaluate centrally with evaluate_fn"),
    (SkipsTheCore, RuntimeError, r"without calling UserLevelDP.aggregate_train.*super\(\).aggregate_train"),
    (ReturnsOwnModel, ValueError, r"not the noised aggregate.*return the arrays of super\(\).aggregate_train"),
    (SendsOwnMessages, RuntimeError, r"without calling UserLevelDP.configure_train.*No noise was drawn"),
])
def test_an_override_cannot_skip_the_noise_or_replace_the_model(tmp_path, strategy_class, error, message):
    """What an override may not change: the core round (sampler, re-clip, noise, ledger) and the model it yields.
    The run stops in round 1 with what to do, and nothing of that round is saved."""
    strategy = strategy_class(PRIVACY, "dp-fedavg", seed=6, checkpoint_dir=str(tmp_path))
    with pytest.raises(error, match=message):
        strategy.start(honest_grid(), model_arrays(initial_model(TASK, 6)[0]))
    assert not (tmp_path / COMMIT_NAME).exists()


def test_nodes_without_a_query_handler_stop_the_run_before_any_budget_is_spent(tmp_path):
    """Like a standard ClientApp without an @app.query() handler: every node answers the user query with an
    error. The run must not release noise-only rounds: NoUsersError names the nodes and why; nothing saved."""
    def no_query(message: Message) -> Message:
        raise ValueError("No query function registered")

    strategy = UserLevelDP(PRIVACY, "dp-fedavg", seed=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(NoUsersError, match=r"node 100: error reply .*No query function registered.*@app.query"):
        strategy.start(InProcessGrid({100: no_query, 101: no_query}), model_arrays(initial_model(TASK, 1)[0]))
    assert strategy.state.ledger.rounds == 0 and not (tmp_path / COMMIT_NAME).exists()


def test_replies_that_stop_coming_end_the_run_after_max_empty_rounds(tmp_path):
    """Nodes answer the query but fail every round: after 2 rounds without a counted user the run stops with
    NoRepliesError pointing to the operator's log, which names the failure; its checkpoint resumable with exactly those 2 rounds in the ledger."""
    def broken(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, range(20) if message.metadata.dst_node_id == 100 else range(20, 40),
                               model=MODEL)
        raise RuntimeError("CUDA out of memory")

    strategy = UserLevelDP(PRIVACY.replace(rounds=5), "dp-fedavg", seed=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(NoRepliesError, match=r"last 2 rounds.*secret/operator.log.*resume") as stopped:
        strategy.start(InProcessGrid({100: broken, 101: broken}), model_arrays(initial_model(TASK, 2)[0]))
    assert "CUDA out of memory" not in str(stopped.value)  # which nodes were asked depends on the sample
    assert "CUDA out of memory" in (tmp_path / "secret" / "operator.log").read_text()
    assert load_checkpoint(tmp_path)["state"]["round"] == 2
    assert len(load_checkpoint(tmp_path)["state"]["ledger"]["records"]) == 2


def test_nodes_whose_users_fail_to_load_say_why_and_the_servers_error_carries_it():
    """Issue 27: without a checkpoint folder NoRepliesError said the reason "is not kept". A node whose users fail
    to load answers with an error naming the round and the user; the server's error carries the first reason and
    how many nodes failed."""
    def missing(uid):
        raise FileNotFoundError(f"users/{uid}.pt")

    lazy = Task(name="lazy", users=Users(list(range(TASK.num_users)), missing), model=TASK.model, loss=TASK.loss)
    trainer = LocalTrainer(lazy, LOCAL, device="cpu")

    def failing(message: Message) -> Message:
        users = range(20) if message.metadata.dst_node_id == 100 else range(20, 40)
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, users, model=trainer.model)
        return train_reply(message, trainer, hosted=users)

    strategy = UserLevelDP(PRIVACY.replace(rounds=5), "dp-fedavg", seed=2)
    with pytest.raises(NoRepliesError) as stopped:
        strategy.start(InProcessGrid({100: failing, 101: failing}), model_arrays(initial_model(TASK, 2)[0]))
    message = str(stopped.value)
    assert "is not kept" not in message
    assert re.search(r"Why: the first of 2 failure\(s\) of the last round: node 'users (0-19|20-39)' \(id 10[01]\): "
                     r"error reply \(\d+\): UserTrainingError: round 2, user <sampled>: ValueError: loading the examples "
                     r"of user <sampled> failed: FileNotFoundError: users/<sampled>\.pt",
                     message), message
    # which user was sampled is the secret sampling keeps: no user id reaches the error's (public) text
    assert not re.search(r"user \d|users/\d", message), message


def test_a_node_with_another_model_is_refused_before_round_1_naming_it_and_the_shapes(tmp_path):
    """Issue 27: a node whose model differs from the server's cost rounds of pure noise before the run stopped.
    Its query reply now names its model; the server refuses it before any round, with no budget spent."""
    other = heavy_tail_task(dim=5)
    good, bad = LocalTrainer(TASK, LOCAL, device="cpu"), LocalTrainer(other, LOCAL, device="cpu")

    def answering(trainer: LocalTrainer, users: range) -> Handler:
        return lambda message: (query_reply(message, users, name=f"silo-{users[0]}", model=trainer.model)
                                if message.metadata.message_type == MessageType.QUERY
                                else train_reply(message, trainer, hosted=users))

    grid = InProcessGrid({100: answering(good, range(20)), 101: answering(bad, range(20, 40))})
    strategy = UserLevelDP(PRIVACY, "dp-fedavg", seed=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ModelMismatchError) as refused:
        strategy.start(grid, model_arrays(initial_model(TASK, 1)[0]))
    ((name, weight),) = TASK.build_model().named_parameters()
    rows, columns = weight.shape
    assert str(refused.value) == (
        f"node id 101 (silo-20) trains another model than the server's: parameter #1 is '{name}' of shape ({rows}, "
        f"5) on the node but '{name}' of shape ({rows}, {columns}) on the server (the node's model has 1 parameter "
        "tensors, the server's 1). The ClientApp and the ServerApp must build the same model (the Strategy's "
        "initial arrays are its named parameters); no round was sampled and no privacy budget was spent. No round "
        f"is committed in {tmp_path}: fix the cause, then submit the run again with the same run config (fed-dp "
        f"submit <federation> --run-config \"... server.checkpoint-dir='{tmp_path}'\", or flwr run . <federation> "
        "with the same overrides); it starts at round 1")
    assert strategy.state.ledger.rounds == 0 and not (tmp_path / COMMIT_NAME).exists()
    assert all(m.metadata.message_type == MessageType.QUERY for m in grid.sent)  # no TRAIN message went out


def test_model_fingerprints_name_the_first_difference():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    mine = protocol.model_fingerprint(model)
    assert mine == ["0.weight:2x3", "0.bias:2", "1.weight:1x2", "1.bias:1"]
    assert protocol.model_fingerprint(dict(model.named_parameters())) == mine
    assert protocol.fingerprint_mismatch(mine, mine) is None
    assert protocol.fingerprint_mismatch(mine, mine[:3]) == (
        "parameter #4 is nothing (no parameter there) on the node but '1.bias' of shape (1) on the server (the "
        "node's model has 3 parameter tensors, the server's 4)")
    assert "parameter #2 is 'bias' of shape (2) on the node but '0.bias'" in protocol.fingerprint_mismatch(
        mine, ["0.weight:2x3", "bias:2", "1.weight:1x2", "1.bias:1"])


def test_a_reply_for_foreign_users_and_a_malformed_reply_drop_only_that_nodes_users(tmp_path):
    def foreign(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, range(20, 40), model=MODEL)
        request = protocol.parse_train_request(message)
        return Message(RecordDict({protocol.UPDATE: ArrayRecord(torch_state_dict={"total": torch.zeros(3)}),
                                   protocol.REPLY: MetricRecord({"count": len(request.users)})}), reply_to=message)

    grid = InProcessGrid({100: honest_node(100, 2), 101: foreign})
    grid.nodes[100] = lambda m: (query_reply(m, range(20), model=MODEL) if m.metadata.message_type == MessageType.QUERY
                                 else honest_node(100, 1)(m))
    UserLevelDP(PRIVACY, "dp-fedavg", seed=4, checkpoint_dir=str(tmp_path)).start(
        grid, model_arrays(initial_model(TASK, 4)[0]))
    counts = read_diagnostics(tmp_path)
    for record in counts:
        assert all("node 'users 20-39' (id 101): total has shape (3,)" in p for p in record["dropped"])
        assert record["replied_users"] + record["dropped_users"] == record["cohort_size"]
    assert any(r["dropped"] for r in counts)


def simulation_built(name: str):
    with simulation():
        return make_optimizer(name)


@pytest.mark.parametrize("build, message", [
    (lambda: UserLevelDP(PRIVACY.replace(num_users=None), "dp-adam"), "num_users must be set"),
    (lambda: UserLevelDP(PRIVACY, "noiseless-adam"), "NOT differentially private"),
    (lambda: UserLevelDP(PRIVACY, simulation_built("noiseless-adam")), "not private"),
    (lambda: UserLevelDP(PRIVACY, "dp-lion"), "unknown optimizer"),
    (lambda: UserLevelDP("epsilon 3", "dp-adam"), "PrivacyConfig"),
])
def test_misconfigured_strategies_are_refused(build, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        build()


def test_the_noiseless_baseline_is_allowed_in_a_simulation_only():
    with simulation():
        assert not UserLevelDP(PRIVACY, make_optimizer("noiseless-adam")).optimizer.private


def test_integer_initial_arrays_are_refused_with_what_to_pass():
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(3), "num_batches_tracked": torch.zeros((), dtype=torch.long)})
    with pytest.raises(ValueError, match="model_arrays"):
        UserLevelDP(PRIVACY, "dp-adam").start(honest_grid(), arrays)


def test_target_epsilon_is_calibrated_when_the_run_starts():
    privacy = PRIVACY.replace(noise_multiplier=None, target_epsilon=4.0)
    result = UserLevelDP(privacy, "dp-fedavg", seed=5).start(honest_grid(), model_arrays(initial_model(TASK, 5)[0]))
    assert result.privacy.noise_multiplier is not None and result.epsilon <= 4.0
    assert result.epsilon == pytest.approx(epsilon(result.privacy, 3))


def test_run_seed_reaches_every_client_so_the_server_app_never_seeds_the_sampler_or_the_noise_with_it():
    """Issue 25 item 5: run.seed is in the run config every ClientApp receives. On main the ServerApp seeded the
    sampler and the noise with it, so a client could rebuild the server's secret state (every cohort, every noise
    vector) with init_server(seed=run.seed). Now run.seed seeds the clients' local training only, the noise is
    secure, and only FED_DP_SERVER_SEED, in the server's own environment, makes a research run reproducible."""
    from fed_dp.randomness import derive_seed
    from fed_dp.run_config import RunConfig
    from fed_dp.server.app import SERVER_SEED_VARIABLE

    run = RunConfig.from_flat({"run.seed": 5, "privacy.rounds": 3, "privacy.accountant": "rdp"})
    model, _, params = initial_model(TASK, 5)

    def secret_state(environ):
        strategy = UserLevelDP.from_run_config(run, TASK.num_users, environ=environ)
        strategy._initialize(model_arrays(model))
        return strategy, strategy.state.secret_state_dict()

    privacy = resolve_privacy(run.privacy, TASK.num_users)
    rebuilt = init_server(privacy, run.optimizer.build(), params, seed=5).secret_state_dict()  # what a client can do
    strategy, secret = secret_state({})
    assert strategy.client_seed == derive_seed(5, "local-training")  # local training stays reproducible
    assert strategy.local == run.local and strategy.training_seed == 5  # recorded with a checkpoint (issue 40)
    assert secret["privatizer"]["source"]["kind"] == "secure"
    assert not torch.equal(secret["sampler"]["generator_state"], rebuilt["sampler"]["generator_state"])
    _, research = secret_state({SERVER_SEED_VARIABLE: "5"})  # the server's own seed: the engine's research run
    assert torch.equal(research["sampler"]["generator_state"], rebuilt["sampler"]["generator_state"])
    with pytest.raises(ValueError, match=SERVER_SEED_VARIABLE):
        UserLevelDP.from_run_config(run, TASK.num_users, environ={SERVER_SEED_VARIABLE: "five"})


def test_one_users_bad_data_moves_a_nodes_reply_by_at_most_its_own_update(tmp_path):
    """A deployed node hosting many users: one whose data make training fail (NaN inputs, or examples that fail to
    load) is sent as a zero update and the others' sum goes out, so the reply with that user differs from the reply
    without it by nothing (≤ ζ: it was dropping the whole reply, every user's update). The node's log names the
    user; the server's operator log says how many users of that node went as zeros; the round is released."""
    def load(uid):
        x, y = TASK.users[uid].fields
        if uid == 3:
            return Examples((torch.full_like(x, float("nan")), y))
        if uid == 5:
            raise FileNotFoundError(f"users/{uid}.pt")
        return Examples((x, y))

    bad = Task(name="bad", users=Users(list(range(TASK.num_users)), load), model=TASK.model, loss=TASK.loss)
    trainer, clean = LocalTrainer(bad, LOCAL, device="cpu"), LocalTrainer(TASK, LOCAL, device="cpu")
    with simulation():
        state = init_server(PRIVACY, make_optimizer("dp-fedavg"), initial_model(TASK, 0)[2], seed=0)
    plan = begin_round(state)
    users = [0, 1, 2, 3, 4, 5, 6]
    result, metrics, _ = trainer.contribution(plan, users, seed=1, failures="zero")
    without, _, _ = clean.contribution(plan, [0, 1, 2, 4, 6], seed=1)
    assert torch.equal(result.total, without.total) and result.count == 7 and metrics["failed_users"] == 2.0
    with pytest.raises(UserTrainingError):
        trainer.contribution(plan, users, seed=1)  # the in-process engine's default: stop, naming the user
    with pytest.raises(UserTrainingError):
        trainer.contribution(plan, [3, 5], seed=1, failures="zero")  # every user failed: the node's error

    def handler(message: Message) -> Message:
        hosted = range(20) if message.metadata.dst_node_id == 100 else range(20, 40)
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, hosted, model=trainer.model)
        return train_reply(message, trainer, hosted=hosted)

    strategy = UserLevelDP(PRIVACY.replace(rounds=3), "dp-fedavg", seed=2, checkpoint_dir=str(tmp_path))
    strategy.start(InProcessGrid({100: handler, 101: handler}), model_arrays(initial_model(TASK, 2)[0]))
    assert load_checkpoint(tmp_path)["state"]["round"] == 3
    log = (tmp_path / "secret" / "operator.log").read_text()
    assert "failed to load or train and were sent as zero updates" in log


def test_a_flower_resume_with_another_local_training_or_run_seed_is_refused_before_round_1(tmp_path):
    """Issue 40 item 11 on the Flower path: the ServerApp gives the strategy the run config's [local] and run.seed,
    which the ClientApps read; they are recorded with the checkpoint, and a resume that changes them is refused
    before any TRAIN message is sent, naming each change. The same configuration resumes."""
    model = initial_model(TASK, 5)[0]
    folder = str(tmp_path / "ckpt")
    UserLevelDP(PRIVACY, "dp-fedavg", seed=5, training_seed=5, local=LOCAL, checkpoint_dir=folder).start(
        honest_grid(), model_arrays(model), num_rounds=1)
    changed = UserLevelDP(PRIVACY, "dp-fedavg", seed=5, training_seed=6, checkpoint_dir=folder,
                          local=LocalTraining(batch_size=2, lr=0.1))
    grid = honest_grid()
    with pytest.raises(ValueError, match=r"local.lr: recorded 0.5, now 0.1; run.seed: recorded 5, now 6"):
        changed.start(grid, model_arrays(model))
    assert not [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    result = UserLevelDP(PRIVACY, "dp-fedavg", seed=5, training_seed=5, local=LOCAL, checkpoint_dir=folder).start(
        honest_grid(), model_arrays(model))
    assert [r["round"] for r in result.records] == [1, 2, 3]


def _earlier_docs_node(users: range) -> Handler:
    """A ClientApp written to the earlier docs: its user query answers without the node's model (no model=)."""
    trainer = LocalTrainer(TASK, LOCAL, device="cpu")

    def handle(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, users)
        return train_reply(message, trainer, hosted=users)

    return handle


def test_a_node_that_does_not_report_its_model_is_refused_before_round_1_unless_the_operator_allows_it(tmp_path):
    """Issue 40 item 8: such a node was accepted with a warning, and with another model it cost two rounds of noise
    alone (ε 1.57) before the run stopped. Now it is refused before any round is sampled, with what to pass and the
    flag that allows it; with allow_unreported_model=True (run config server.allow-unreported-model) it is used
    unchecked, with one warning."""
    def grid() -> InProcessGrid:
        return InProcessGrid({100: _earlier_docs_node(range(20)), 101: _earlier_docs_node(range(20, 40))})

    refused = UserLevelDP(PRIVACY, "dp-fedavg", seed=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ModelNotReportedError, match=r"node id 10[01] \(users (0-19|20-39)\) did not report its model.*"
                       r"query_reply\(msg, users, model=trainer.model\).*allow_unreported_model=True.*"
                       r"server.allow-unreported-model = true.*no round was sampled and no privacy budget was spent"):
        refused.start(grid(), model_arrays(initial_model(TASK, 1)[0]))
    assert refused.state.ledger.rounds == 0 and not (tmp_path / COMMIT_NAME).exists()
    assert refused.membership is None  # refused while the nodes were being discovered
    from fed_dp.run_config import RunConfig

    run = RunConfig.from_flat({"server.allow-unreported-model": True, "privacy.rounds": 3, "privacy.accountant": "rdp",
                               "optimizer.name": "dp-fedavg"})
    allowed = UserLevelDP.from_run_config(run, TASK.num_users)
    assert allowed.allow_unreported_model and not UserLevelDP(PRIVACY).allow_unreported_model
    warned: list[str] = []

    class Keep(logging.Handler):  # the fed_dp logger does not propagate to the root logger caplog reads
        def emit(self, record):
            warned.append(record.getMessage())

    keep = Keep(level=logging.WARNING)
    logging.getLogger("fed_dp.server").addHandler(keep)
    try:
        result = allowed.start(grid(), model_arrays(initial_model(TASK, 1)[0]))
    finally:
        logging.getLogger("fed_dp.server").removeHandler(keep)
    assert [r["round"] for r in result.records] == [1, 2, 3]
    assert len([m for m in warned if "used unchecked (allow_unreported_model)" in m]) == 1


def test_the_strategy_takes_one_built_plan_or_its_parts_not_both():
    """Issue 41: UserLevelDP's keywords and its run configuration both become one fed_dp RunPlan (validated there,
    once); a plan can be given directly, and a plan with one of its parts as well is refused, naming the part."""
    from fed_dp.plan import RunPlan
    from fed_dp.run_config import RunConfig

    strategy = UserLevelDP(PRIVACY, "dp-sgd", seed=3, eval_every=2, checkpoint_dir=None, local=LocalTraining(lr=0.3))
    plan = strategy.plan
    assert (plan.privacy, plan.seed, plan.eval_every, plan.local, plan.noise_source) == (
        PRIVACY, 3, 2, LocalTraining(lr=0.3), "torch")  # a seeded research run: torch noise, as before
    same = UserLevelDP(plan=plan, min_nodes=2)
    assert same.plan is plan and same.min_nodes == 2 and (same.seed, same.privacy, same.optimizer) == (
        3, PRIVACY, plan.optimizer) and same.client_seed == strategy.client_seed
    for parts, named in (({"seed": 4}, "seed is"), ({"privacy": PRIVACY, "eval_every": 0}, "privacy, eval_every are")):
        with pytest.raises(ValueError, match=f"give a plan or its parts, not both: {named} in the plan already"):
            UserLevelDP(plan=plan, **parts)
    with pytest.raises(ValueError, match="plan must be a fed_dp.plan.RunPlan, got PrivacyConfig"):
        UserLevelDP(plan=PRIVACY)
    with pytest.raises(ValueError, match="eval_every must be an integer >= 0, got -1"):
        UserLevelDP(PRIVACY, "dp-sgd", eval_every=-1)
    run = RunConfig.from_flat({"privacy.rounds": 3, "privacy.accountant": "rdp", "run.eval-every": 2,
                               "server.min-nodes": 2, "server.max-empty-rounds": 4})
    built = UserLevelDP.from_run_config(run, TASK.num_users, environ={})
    assert isinstance(built.plan, RunPlan) and built.plan.privacy.num_users == TASK.num_users
    assert (built.eval_every, built.max_empty_rounds, built.min_nodes, built.noise_source) == (2, 4, 2, "secure")


@pytest.mark.parametrize("min_nodes", [0, -1, True, 1.5, "2"])
def test_min_nodes_must_be_an_integer_of_at_least_one(min_nodes):
    """min_nodes is the Flower run's own keyword (not part of a plan): checked by the strategy, with the message of
    the project's other integer arguments."""
    with pytest.raises(ValueError, match=r"min_nodes must be an integer >= 1, got "):
        UserLevelDP(PRIVACY, "dp-sgd", min_nodes=min_nodes)
