"""The server side of a Flower run: a thin adapter between Flower messages and ``fed_dp.round``.

    discover_users     ask every node which user ids it hosts (a node may host many users: a data silo)
    train_messages     one TRAIN message per node that hosts sampled users: θ_{t−1}, s_t, the user ids
    contributions      replies → fed_dp.round.Contribution (conversion errors and oversized counts rejected)
    run                the loop: begin_round → send/receive → finish_round → checkpoint → log ε

All DP math (sampling, re-clipping, noise, denominator, optimizer, accounting) is in ``fed_dp``: users are
sampled with the fed_dp sampler (never Flower's fraction sampling), and a missing or rejected reply counts
as dropped users while the round still releases.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fed_dp.accounting import BudgetExceededError
from fed_dp.checkpoint import resume, save_checkpoint
from fed_dp.round import Contribution, RoundPlan, ServerState, begin_round, finish_round

log = logging.getLogger("fed_dp.server")


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float) -> list[int]:
    """Node ids once at least ``min_nodes`` are connected; raises after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} SuperNode(s) connected after {timeout:.0f} s; {min_nodes} needed")
        time.sleep(0.5)


def discover_users(grid: Grid, nodes: list[int], num_users: int, timeout: float) -> dict[int, int]:
    """user id → node id, from each node's answer to a QUERY. Users outside 0..N−1 or on two nodes are errors."""
    queries = [Message(content=RecordDict({"query": ConfigRecord({"what": "users"})}), dst_node_id=n,
                       message_type=MessageType.QUERY) for n in nodes]
    owner: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error():
            log.warning("user discovery: a node failed (%s): %s", reply.error.code, reply.error.reason)
            continue
        node = reply.metadata.src_node_id
        for user in reply.content["users"]["users"]:
            if not 0 <= int(user) < num_users:
                raise ValueError(f"node {node} hosts user {user}, outside 0..{num_users - 1} (task.users = {num_users})")
            if int(user) in owner:
                raise ValueError(f"user {user} is hosted by two nodes ({owner[int(user)]} and {node}); "
                                 "give every SuperNode a disjoint 'users' range")
            owner[int(user)] = node
    return owner


def train_messages(plan: RoundPlan, owner: dict[int, int], seed: int) -> tuple[list[Message], dict[int, list[int]], list[int]]:
    """Messages to the nodes hosting sampled users; also (node → its users) and the unreachable users."""
    by_node: dict[int, list[int]] = defaultdict(list)
    unreachable = []
    for user in plan.cohort.tolist():
        (by_node[owner[user]].append(user) if user in owner else unreachable.append(user))
    arrays = [plan.params.detach().cpu().numpy().astype(np.float32)]
    if plan.scale is not None:
        arrays.append(plan.scale.detach().cpu().numpy().astype(np.float32))
    messages = []
    for node, users in sorted(by_node.items()):
        config = ConfigRecord({"round": plan.round, "users": users, "clip-norm": float(plan.clip_norm),
                               "send-squares": plan.send_squares, "seed": seed})
        messages.append(Message(content=RecordDict({"model": ArrayRecord(arrays), "config": config}),
                                dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(plan.round)))
    return messages, dict(by_node), unreachable


def contributions(replies: list[Message], by_node: dict[int, list[int]], dtype: torch.dtype) -> tuple[list[Contribution], list[str]]:
    """Replies → Contributions; a reply that cannot even be read is rejected here with its reason."""
    result, problems = [], []
    answered = set()
    for reply in replies:
        if reply.has_error():
            problems.append(f"error reply ({reply.error.code}): {reply.error.reason.splitlines()[0] if reply.error.reason else ''}")
            continue
        node = reply.metadata.src_node_id
        answered.add(node)
        try:
            arrays = reply.content["update"].to_numpy_ndarrays()
            count = int(reply.content["metrics"]["count"])
        except Exception as error:  # malformed reply: counts as dropped users, the round goes on
            problems.append(f"node {node}: unreadable reply ({type(error).__name__}: {error})")
            continue
        if count > len(by_node.get(node, [])):
            problems.append(f"node {node}: reports {count} users but was asked for {len(by_node.get(node, []))}")
            continue
        total = torch.from_numpy(np.array(arrays[0], copy=True)) if arrays else None
        squares = torch.from_numpy(np.array(arrays[1], copy=True)) if len(arrays) > 1 else None
        if total is not None and total.dtype.is_floating_point:
            total = total.to(dtype)
        if squares is not None and squares.dtype.is_floating_point:
            squares = squares.to(dtype)
        unclipped = reply.content["metrics"].get("unclipped")
        result.append(Contribution(total, count, squares, source=f"node {node}",
                                   unclipped=None if unclipped is None else int(unclipped)))
    for node in sorted(set(by_node) - answered):
        problems.append(f"node {node}: no usable reply ({len(by_node[node])} sampled users dropped)")
    return result, problems


def run(
    grid: Grid,
    state: ServerState,
    *,
    seed: int,
    checkpoint_dir: str,
    reply_timeout: float,
    owner: dict[int, int],
    evaluate: Callable[[torch.Tensor], dict[str, float]] | None = None,
) -> tuple[ServerState, list[dict[str, Any]]]:
    """Run the remaining rounds (resuming from ``checkpoint_dir`` when it holds a checkpoint)."""
    records: list[dict[str, Any]] = []
    if checkpoint_dir:
        extra = resume(state, checkpoint_dir)
        if extra is not None:
            records = list(extra.get("records", []))
            log.info("resumed from %s at round %d (ε so far %.4g)", checkpoint_dir, state.round, state.ledger.epsilon)
    while state.round < state.config.rounds:
        started = time.perf_counter()
        try:
            plan = begin_round(state)  # refuses, before sampling, a round that would exceed the budget
        except BudgetExceededError as refusal:
            log.error("fed-dp stopped before round %d: %s", state.round + 1, refusal)
            break
        messages, by_node, unreachable = train_messages(plan, owner, seed)
        replies = list(grid.send_and_receive(messages, timeout=reply_timeout)) if messages else []
        received, problems = contributions(replies, by_node, state.params.dtype)
        if unreachable:
            problems.append(f"{len(unreachable)} sampled users are on no connected node")
        state, metrics = finish_round(state, plan, received)
        metrics["round_seconds"] = time.perf_counter() - started  # broadcast, local training, replies, round
        metrics["dropped"] = problems + list(metrics.pop("rejected_replies"))
        if evaluate is not None:
            metrics.update(evaluate(state.params))
        records.append(metrics)
        eps = metrics["epsilon"]
        log.info("round %d/%d: cohort %d, replied %d, epsilon %s, delta %g%s", plan.round + 1, state.config.rounds,
                 metrics["cohort_size"], metrics["replied_users"], eps if isinstance(eps, str) else f"{eps:.4f}",
                 metrics["delta"], "".join(f"\n  dropped: {p}" for p in metrics["dropped"]))
        if checkpoint_dir:
            save_checkpoint(state, checkpoint_dir, extra={"records": records})
    if checkpoint_dir:
        Path(checkpoint_dir, "results.json").write_text(json.dumps(records, indent=1, default=str))
    return state, records
