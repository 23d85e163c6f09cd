"""Membership that follows the nodes, through the UserLevelDP Strategy on an in-process grid whose node set
changes between and during rounds: a node leaves and returns under a new id (its users are served again), a
restarted node replaces its old id, late and gone nodes are told apart, and too few nodes stop the run before any
budget is spent on them, resumably. Sampling and accounting never change. The same behaviours with real
SuperLink and SuperNode processes: test_faults.py."""

from __future__ import annotations

import json
import random

import pytest
import torch
from flwr.app import Message, MessageType

from fed_dp.accounting import epsilon
from fed_dp.checkpoint import load_checkpoint, read_diagnostics
from fed_dp.clients import protocol
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.replies import hosted_users, parse_users, query_reply, train_reply
from fed_dp.clients.protocol import VirtualNodeUsers
from fed_dp.clients.task import initial_model
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.round import begin_round, finish_round, init_server
from fed_dp.optimizers import make_optimizer
from fed_dp.server.flower_strategy import UserLevelDP, model_arrays
from fed_dp.server.membership import Membership, NoUsersError, NotEnoughNodesError, format_users
from fed_dp.round_loop import NoRepliesError
from fed_dp.simulations.tasks.builtin import heavy_tail_task
from inprocess_grid import Handler, InProcessGrid, server_identity  # noqa: F401 (server_identity: autouse fixture)

TASK = heavy_tail_task()  # 40 users
LOCAL = LocalTraining(batch_size=2, lr=0.5)
PRIVACY = PrivacyConfig(num_users=40, expected_cohort=10, rounds=4, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
FIRST, SECOND = list(range(20)), list(range(20, 40))


def node(users: list[int], name: str | None = None, late: bool = False) -> Handler:
    """A node hosting ``users`` that answers with fed-dp's client helpers (``late``: never replies to TRAIN)."""
    trainer = LocalTrainer(TASK, LOCAL, device="cpu")

    def handle(message: Message) -> Message | None:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, users, name=name, model=trainer.model)
        return None if late else train_reply(message, trainer, hosted=users)

    return handle


def cohorts(privacy: PrivacyConfig, seed: int) -> list[set[int]]:
    """The users an uninterrupted run samples each round (fed_dp alone; replies do not change them)."""
    state = init_server(privacy, make_optimizer("dp-fedavg"), initial_model(TASK, seed)[2], seed=seed)
    drawn = []
    for _ in range(privacy.rounds):
        plan = begin_round(state)
        drawn.append(set(plan.cohort.tolist()))
        state, _ = finish_round(state, plan, [])
    return drawn


def start(grid: InProcessGrid, folder, seed: int, on_round=None, **options):
    strategy = UserLevelDP(PRIVACY, "dp-fedavg", seed=seed, checkpoint_dir=str(folder), on_round=on_round, **options)
    return strategy, strategy.start(grid, model_arrays(initial_model(TASK, seed)[0]), timeout=5.0)


def test_format_users_inverts_parse_users():
    rng = random.Random(0)
    for _ in range(200):
        users = sorted(rng.sample(range(60), rng.randint(1, 30)))
        assert parse_users(format_users(users)) == users
    assert format_users([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("returning_id", [102, 101])  # a new id; the same id (SuperNode authentication)
def test_a_node_that_leaves_and_returns_is_served_again(tmp_path, server_log, returning_id):
    """Node 101 (users 20-39) leaves after round 1 and returns after round 2, as node 102 or, as a SuperNode with
    an authentication key does, as node 101 again: in round 2 its sampled users are dropped (the denominator
    stays B); from round 3 on they are asked and counted again. The departure and the return are logged once
    each, naming the node; the sampling and ε are those of an uninterrupted run."""
    grid = InProcessGrid({100: node(FIRST), 101: node(SECOND)})

    def churn(record):
        if record["round"] == 1:  # after round 1 (rounds are numbered 1 … T)
            del grid.nodes[101]
        elif record["round"] == 2:
            grid.nodes[returning_id] = node(SECOND)

    _, result = start(grid, tmp_path, seed=11, on_round=churn)
    drawn = cohorts(PRIVACY, 11)
    assert [r["epsilon"] for r in result.records] == [epsilon(PRIVACY, t) for t in (1, 2, 3, 4)]
    counts = read_diagnostics(tmp_path)
    assert [c["cohort_size"] for c in counts] == [len(c) for c in drawn]
    lost = len(drawn[1] & set(SECOND))
    assert lost > 0, "the test needs a round-2 cohort with users of the node that left; change the seed"
    assert counts[1]["dropped_users"] == lost and counts[1]["replied_users"] == len(drawn[1]) - lost
    for t in (0, 2, 3):
        assert counts[t]["replied_users"] == counts[t]["cohort_size"] and not counts[t]["dropped"], counts[t]
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert {m.metadata.dst_node_id for m in trains if m.content["fed-dp.round"]["round"] >= 2} <= {100, returning_id}
    assert returning_id in {m.metadata.dst_node_id for m in trains if m.content["fed-dp.round"]["round"] >= 2}
    queries = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == MessageType.QUERY]
    assert sorted(queries) == sorted([100, 101, returning_id])  # asked on arrival and on return, not every round
    left = [m for m in server_log if " left:" in m]
    back = [m for m in server_log if "is back" in m]
    assert left == ["node 'users 20-39' (node id 101) left: its 20 user(s) count as dropped when sampled, until it "
                    "returns"]
    assert len(back) == 1 and back[0].startswith(f"node 'users 20-39' is back as node id {returning_id} (it had left)")


def test_a_restarted_node_replaces_its_old_id_before_that_one_times_out(tmp_path, server_log):
    """A SuperNode killed and restarted at once: its new id connects while the SuperLink still lists the old
    one. The node's name (node config ``name``) says it is the same node: the new id serves its users."""
    grid = InProcessGrid({100: node(FIRST, "silo-a"), 101: node(SECOND, "silo-b")})

    def restart(record):
        if record["round"] == 1:  # after round 1 (rounds are numbered 1 … T)
            grid.nodes[101] = lambda message: None  # the old id: listed, never answers
            grid.nodes[105] = node(SECOND, "silo-b")

    start(grid, tmp_path, seed=11, on_round=restart)
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert all(m.metadata.dst_node_id != 101 for m in trains if m.content["fed-dp.round"]["round"] >= 1)
    assert all(c["replied_users"] == c["cohort_size"] for c in read_diagnostics(tmp_path))
    assert any(m.startswith("node 'silo-b' is back as node id 105 (was node id 101)") for m in server_log)


def test_a_late_node_is_told_apart_from_a_gone_node(tmp_path):
    """No reply from a node that is still connected: a warning that names it and says to raise
    server.reply-timeout. No reply from a node that disconnected during the round: it is named as gone. Both
    are operator-only (secret/diagnostics.jsonl and secret/operator.log), never in the published records."""
    grid = InProcessGrid({100: node(FIRST, late=True), 101: node(SECOND)})
    gone = node(SECOND)

    def vanish(message: Message) -> Message | None:
        if message.metadata.message_type == MessageType.QUERY:
            return gone(message)
        del grid.nodes[101]  # disconnects while it should be training
        return None

    grid.nodes[101] = vanish
    with pytest.raises(NoRepliesError, match=r"Why, per node and round: .*secret/operator.log"):  # stops at round 4
        start(grid, tmp_path, seed=11, max_empty_rounds=4)
    first = next(c for c in read_diagnostics(tmp_path) if c["cohort_size"])
    late = [p for p in first["dropped"] if p.startswith("node 'users 0-19' (id 100): connected, but its reply missed "
                                                         "the deadline (server.reply-timeout = 5 s)")]
    assert late and "raise server.reply-timeout" in late[0]
    operator_log = (tmp_path / "secret" / "operator.log").read_text()
    assert "node 'users 0-19' (id 100): connected, but its reply missed the deadline" in operator_log
    assert (tmp_path / "secret" / "operator.log").stat().st_mode & 0o777 == 0o600
    gone_lines = [p for c in read_diagnostics(tmp_path) for p in c["dropped"]
                  if p.startswith("node 'users 20-39' (id 101): no reply, and it is no longer connected")]
    assert gone_lines, read_diagnostics(tmp_path)
    published = {key for record in json.loads((tmp_path / "results.json").read_text()) for key in record}
    assert len(load_checkpoint(tmp_path)["state"]["ledger"]["records"]) == 4
    assert not published & {"dropped", "failures", "dropped_users"}


def test_too_few_nodes_stop_the_run_without_releasing_a_round_and_it_resumes(tmp_path):
    """min_nodes = 2: node 101 leaves after round 1 and nothing replaces it within node_wait. The run stops with
    NotEnoughNodesError before round 2 is released (ledger: 1 round); submitted again with both nodes back
    (new ids), it resumes and ends with the ledger and model of an uninterrupted run."""
    grid = InProcessGrid({100: node(FIRST), 101: node(SECOND)})

    def leave(record):
        if record["round"] == 1:  # after round 1 (rounds are numbered 1 … T)
            del grid.nodes[101]

    stop = r"only 1 node\(s\).*server.min-nodes.*'users 20-39'.*rounds released so far: 1\).*resume"
    with pytest.raises(NotEnoughNodesError, match=stop):
        start(grid, tmp_path, seed=12, on_round=leave, min_nodes=2, node_wait=0.5)
    assert load_checkpoint(tmp_path)["state"]["round"] == 1
    assert len(load_checkpoint(tmp_path)["state"]["ledger"]["records"]) == 1

    _, resumed = start(InProcessGrid({200: node(FIRST), 201: node(SECOND)}), tmp_path, seed=12, min_nodes=2)
    _, whole = start(InProcessGrid({100: node(FIRST), 101: node(SECOND)}), tmp_path / "whole", seed=12, min_nodes=2)
    assert [r["epsilon"] for r in resumed.records] == [r["epsilon"] for r in whole.records]
    final = lambda result: torch.cat([v.flatten() for v in result.arrays.to_torch_state_dict().values()])  # noqa: E731
    torch.testing.assert_close(final(resumed), final(whole), rtol=1e-5, atol=1e-6)


def test_every_node_gone_stops_the_run_before_it_spends_more(tmp_path):
    """Every node disconnects after round 1 (min_nodes = 1): the run stops before round 2 instead of releasing
    noise-only rounds."""
    grid = InProcessGrid({100: node(FIRST), 101: node(SECOND)})
    with pytest.raises(NotEnoughNodesError, match=r"only 0 node\(s\)"):
        start(grid, tmp_path, seed=13, on_round=lambda record: grid.nodes.clear(), node_wait=0.2)
    assert len(load_checkpoint(tmp_path)["state"]["ledger"]["records"]) == 1


def test_a_new_node_claiming_another_nodes_users_is_not_used(tmp_path, server_log):
    grid = InProcessGrid({100: node(FIRST), 101: node(SECOND)})

    def intruder(record):
        if record["round"] == 1:  # after round 1 (rounds are numbered 1 … T)
            grid.nodes[107] = node(list(range(15, 25)))

    start(grid, tmp_path, seed=11, on_round=intruder)
    assert not any(m.metadata.dst_node_id == 107 for m in grid.sent if m.metadata.message_type == MessageType.TRAIN)
    assert any("hosts users that other nodes host (15-19 of node 'users 0-19', 20-24 of node 'users 20-39')" in m
               and "not used" in m for m in server_log), server_log


def test_membership_refreshes_with_one_call_when_nothing_changed():
    calls = []

    class Counting(InProcessGrid):
        def get_node_ids(self):
            calls.append("get_node_ids")
            return super().get_node_ids()

    grid = Counting({100: node(FIRST), 101: node(SECOND)})
    membership = Membership(40, query_timeout=1.0)
    membership.start(grid, min_nodes=2, wait=1.0)
    sent, calls[:] = len(grid.sent), []
    membership.refresh(grid)
    assert calls == ["get_node_ids"] and len(grid.sent) == sent
    assert membership.node_of(25) == 101 and membership.hosted_users() == 40


# --- virtual nodes of Flower's simulation engine -------------------------------------------------------------


def virtual_node(nodes: int, num_users: int = 40, partition: int = 0) -> Handler:
    """A virtual SuperNode as the project's ClientApp is one under Flower's simulation engine: its users come
    from hosted_users with the engine's node config (partition-id, num-partitions)."""
    trainer = LocalTrainer(TASK, LOCAL, device="cpu")
    users = hosted_users({"partition-id": partition, "num-partitions": nodes}, num_users)

    def handle(message: Message) -> Message:
        if message.metadata.message_type == MessageType.QUERY:
            return query_reply(message, users, model=trainer.model)
        return train_reply(message, trainer, hosted=users)

    return handle


def queries(grid: InProcessGrid) -> list[int]:
    return [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == MessageType.QUERY]


def test_a_virtual_node_hosts_any_user_and_says_so_in_one_short_answer():
    users = hosted_users({"partition-id": 3, "num-partitions": 6}, 40)
    assert isinstance(users, VirtualNodeUsers) and list(users) == list(range(40)) and users.nodes == 6
    answer = query_reply(protocol.users_query(5), users).content[protocol.USERS]
    assert list(answer["users"]) == [] and answer["virtual-nodes"] == 6 and answer["num-users"] == 40
    with pytest.raises(ValueError, match="virtual nodes must be an integer >= 1"):
        VirtualNodeUsers(40, 0)


@pytest.mark.parametrize("probe", [0, 2])
def test_virtual_nodes_get_users_assigned_after_a_probe_of_a_few(probe, server_log):
    """Six virtual nodes (ids given out of order): with a probe of 2 only those two are asked, without one all
    six; either way user u goes to the (u mod 6)-th node id in sorted order."""
    ids = [130, 100, 125, 101, 140, 110]
    grid = InProcessGrid({node_id: virtual_node(6, partition=k) for k, node_id in enumerate(ids)})
    membership = Membership(40, query_timeout=1.0)
    membership.start(grid, min_nodes=1, wait=1.0, probe=probe)
    assert queries(grid) == (sorted(ids)[:2] if probe else sorted(ids))
    assert membership.virtual == 6 and membership.hosted_users() == 40
    assert all(membership.node_of(u) == sorted(ids)[u % 6] for u in range(40))
    assert any(f"the 40 users assigned to its 6 virtual SuperNodes (user u to the (u mod 6)-th), after asking "
               f"{probe or 6} of them" in message for message in server_log), server_log


def test_virtual_nodes_train_the_assigned_users_like_nodes_with_users_of_their_own(tmp_path):
    """The same run through 4 virtual nodes (users assigned) and through 2 nodes hosting 20 users each: the same
    cohorts, ε and final model up to float32 summation order; every sampled user replied."""
    finals = {}
    for kind, nodes in (("virtual", {100 + k: virtual_node(4, partition=k) for k in range(4)}),
                        ("own", {100: node(FIRST), 101: node(SECOND)})):
        folder = tmp_path / kind
        start(InProcessGrid(nodes), folder, seed=5)
        assert all(c["replied_users"] == c["cohort_size"] for c in read_diagnostics(folder))
        finals[kind] = (load_checkpoint(folder)["state"]["params"],
                        [r["epsilon"] for r in json.loads((folder / "results.json").read_text())])
    torch.testing.assert_close(finals["virtual"][0], finals["own"][0], rtol=1e-5, atol=1e-6)
    assert finals["virtual"][1] == finals["own"][1]


def test_a_probe_answered_by_nodes_with_users_of_their_own_asks_the_rest():
    grid = InProcessGrid({100: node(list(range(10))), 101: node(list(range(10, 20))), 102: node(list(range(20, 40)))})
    membership = Membership(40, query_timeout=1.0)
    membership.start(grid, min_nodes=3, wait=1.0, probe=1)
    assert queries(grid) == [100, 101, 102] and membership.virtual is None
    assert membership.node_of(5) == 100 and membership.node_of(15) == 101 and membership.node_of(39) == 102


def test_virtual_nodes_mixed_with_nodes_of_their_own_are_refused():
    grid = InProcessGrid({100: virtual_node(2), 101: node(SECOND)})
    with pytest.raises(ValueError, match="answered the user query as a node with users of its own"):
        Membership(40, query_timeout=1.0).start(grid, min_nodes=2, wait=1.0)
    grid = InProcessGrid({100: node(FIRST), 101: virtual_node(2)})
    with pytest.raises(ValueError, match="answered the user query as one of 2 virtual nodes"):
        Membership(40, query_timeout=1.0).start(grid, min_nodes=2, wait=1.0)


def test_a_virtual_node_of_another_population_is_refused_with_the_reason():
    grid = InProcessGrid({100: virtual_node(1, num_users=30)})
    with pytest.raises(NoUsersError, match="task with N = 30 users, but the server's population has N = 40"):
        Membership(40, query_timeout=1.0).start(grid, min_nodes=1, wait=1.0)


def test_fewer_connected_nodes_than_the_virtual_nodes_say_is_an_error_after_the_wait():
    grid = InProcessGrid({100: virtual_node(3), 101: virtual_node(3)})
    with pytest.raises(RuntimeError, match="2 SuperNode.s. connected after 1 s; 3 needed .a virtual node says the "
                                           "simulation has 3"):
        Membership(40, query_timeout=1.0).start(grid, min_nodes=1, wait=1.0, probe=1)
