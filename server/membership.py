"""Which node hosts which users: wait for the nodes, ask each once, and refuse to start without users.

A node may host one user or many (a data silo). The sampler draws user indices 0..N−1 from the whole
population whatever the nodes; a sampled user that no connected node hosts counts as dropped (the round still
releases with the fixed denominator B), so membership never changes the accounting.
"""

from __future__ import annotations

import logging
import time

from flwr.serverapp import Grid

from fed_dp.clients import protocol

log = logging.getLogger("fed_dp.server")


class NoUsersError(RuntimeError):
    """No connected node hosts any user: a run would spend its budget on noise alone."""


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float) -> list[int]:
    """Node ids once at least ``min_nodes`` are connected; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} SuperNode(s) connected after {timeout:.0f} s; {min_nodes} needed "
                               "(server.min-nodes). Start the SuperNodes, or lower server.min-nodes")
        time.sleep(0.5)


def discover_users(grid: Grid, nodes: list[int], num_users: int, timeout: float) -> dict[int, int]:
    """user index → node id, from each node's answer to fed-dp's user query.

    A node that fails to answer is logged with its reason and hosts nobody; a user on two nodes, or outside
    0..N−1, is an error. If no node hosts any user, :class:`NoUsersError` says which nodes failed and why
    (typically a ClientApp without an ``@app.query()`` handler answering with ``fed_dp.query_reply``).
    """
    owner: dict[int, int] = {}
    failures: list[str] = []
    replies = list(grid.send_and_receive([protocol.users_query(n) for n in nodes], timeout=timeout))
    answered = set()
    for reply in replies:
        node = reply.metadata.src_node_id
        answered.add(node)
        try:
            users = protocol.parse_users_reply(reply, num_users)
        except protocol.ReplyError as error:
            failures.append(f"node {node}: {error}")
            log.warning("user discovery: node %s hosts no users: %s", node, error)
            continue
        for user in users:
            if user in owner:
                raise ValueError(f"user {user} is hosted by two nodes ({owner[user]} and {node}); give every "
                                 "SuperNode a disjoint 'users' range")
            owner[user] = node
    for node in sorted(set(nodes) - answered):
        failures.append(f"node {node}: no answer within {timeout:.0f} s")
    if not owner:
        raise NoUsersError(
            f"none of the {len(nodes)} connected node(s) hosts any user, so every round would release noise "
            "only; nothing was trained and no privacy budget was spent. "
            + ("; ".join(failures) if failures else "every node answered with an empty user list")
            + ". Each ClientApp needs an @app.query() handler that answers fed_dp.query_reply(msg, users)")
    return owner
