"""Issue 38 item 1 on Flower's message path (a real Strategy and real Messages, an in-process transport): frozen
parameters never travel, the Flower strategy trains what the in-process engine trains, and a node whose trainable
set or frozen values differ from the server's is refused before round 1 (no TRAIN message, no budget spent)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message, MessageType
from torch import nn

from fed_dp.checkpoint import COMMIT_NAME
from fed_dp.clients import protocol
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.replies import query_reply, train_reply
from fed_dp.clients.task import Task, frozen_parameters, initial_model
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.server.flower_strategy import UserLevelDP, centralized_evaluation, model_arrays
from fed_dp.server.membership import ModelMismatchError
from fed_dp.simulations.engine.inprocess import train
from inprocess_grid import Handler, InProcessGrid, server_identity  # noqa: F401 (server_identity: autouse fixture)
from frozen_task import frozen_task

PRIVACY = PrivacyConfig(num_users=24, expected_cohort=6, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(epochs=2, batch_size=2, lr=0.5)
SEED = 4


def _node(task: Task, users: range, seed: int | None) -> Handler:
    trainer = LocalTrainer(task, LOCAL, device="cpu", seed=seed)
    return lambda message: (query_reply(message, users, name=f"silo-{users[0]}", model=trainer.model)
                            if message.metadata.message_type == MessageType.QUERY
                            else train_reply(message, trainer, hosted=users))


def _strategy(tmp_path, model: nn.Module) -> UserLevelDP:
    return UserLevelDP(PRIVACY, "dp-adam", seed=SEED, checkpoint_dir=str(tmp_path), eval_every=0, frozen=model)


def test_only_trainable_arrays_travel_and_the_strategy_trains_what_the_engine_trains(tmp_path):
    task = frozen_task()
    model = initial_model(task, SEED)[0]
    grid = InProcessGrid({100: _node(task, range(12), SEED), 101: _node(task, range(12, 24), SEED)})
    result = _strategy(tmp_path, model).start(grid, model_arrays(model), timeout=5.0,
                                              evaluate_fn=centralized_evaluation(task, model))
    trained = ["embed.weight", "head.weight", "head.bias"]
    sent = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert sent and all(list(m.content[protocol.MODEL].keys()) == trained for m in sent)
    assert list(result.arrays.keys()) == trained
    engine = train(task, PRIVACY, "dp-adam", LOCAL, seed=SEED, device="cpu", eval_every=0)
    flower = torch.cat([t.reshape(-1) for t in result.arrays.to_torch_state_dict().values()])
    torch.testing.assert_close(flower, engine.params, rtol=1e-5, atol=1e-6)
    # the server's evaluation kept the run's frozen parameters; the caller's model was not changed
    assert all(torch.equal(p, q) for p, q in zip(frozen_parameters(model).values(),
                                                   frozen_parameters(engine.model).values()))


@pytest.mark.parametrize("case", ["trainable set", "frozen values"])
def test_a_node_with_another_trainable_set_or_other_frozen_values_is_refused_before_round_1(tmp_path, case):
    task = frozen_task()
    model = initial_model(task, SEED)[0]
    if case == "trainable set":
        other = frozen_task(train_body=True)  # the body trainable on this node
        bad, expected = _node(other, range(12, 24), SEED), (
            r"parameter #2 is trainable 'body.weight' of shape \(16, 16\) on the node but trainable 'head.weight' of "
            r"shape \(3, 16\) on the server \(the node's model has 5 trainable and 2 frozen parameter tensors, the "
            r"server's 3 and 4\)")
    else:
        bad, expected = _node(task, range(12, 24), SEED + 1), (  # initialized from another seed
            r"frozen parameter 'body.weight' holds other values on the node than on the server \(digest [0-9a-f]{16} "
            r"against [0-9a-f]{16}\)\. Frozen parameters are never sent")
    grid = InProcessGrid({100: _node(task, range(12), SEED), 101: bad})
    strategy = _strategy(tmp_path, model)
    with pytest.raises(ModelMismatchError, match=r"node id 101 \(silo-12\) trains another model than the server's: "
                       + expected) as refused:
        strategy.start(grid, model_arrays(model), timeout=5.0)
    assert "no round was sampled and no privacy budget was spent" in str(refused.value)
    assert strategy.state.ledger.rounds == 0 and not (tmp_path / COMMIT_NAME).exists()
    assert all(m.metadata.message_type == MessageType.QUERY for m in grid.sent)


def test_a_server_not_told_of_the_frozen_part_refuses_nodes_that_have_one(tmp_path):
    task = frozen_task()
    model = initial_model(task, SEED)[0]
    grid = InProcessGrid({100: _node(task, range(24), SEED)})
    strategy = UserLevelDP(PRIVACY, "dp-adam", seed=SEED, checkpoint_dir=str(tmp_path))  # no frozen=
    with pytest.raises(ModelMismatchError, match=r"parameter #4 is frozen 'body.weight' of shape \(16, 16\) on the "
                       r"node but nothing \(no parameter there\) on the server"):
        strategy.start(grid, model_arrays(model), timeout=5.0)
