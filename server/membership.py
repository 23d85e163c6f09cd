"""Which node hosts which users, followed round by round as nodes leave, restart and return.

A node may host one user or many (a data silo). It is known by a **stable name** — its node config's ``name``,
else its user ranges ("users 0-13") — not by the node id Flower gives it, which changes when a SuperNode
without an authentication key restarts. Before every round :meth:`Membership.refresh` asks the SuperLink which node ids are connected (one
cheap call, ``grid.get_node_ids()``, which lists only nodes whose heartbeat is current) and sends the user query
only to ids it has not seen before:

    a known id is missing        → its node is down: logged once, naming it; its users count as dropped
    a new id (or an id that had gone: with SuperNode authentication a restarted node keeps its id) answers
        with a name
        that is known            → the node is back (restarted): logged once; its users are served again
        that is new              → a node joined; its users must not overlap another node's
    a new id does not answer     → asked again at the next refresh

The sampler draws user indices 0..N−1 from the whole population whatever the nodes; a sampled user whose node
is down counts as dropped (the round still releases with the fixed denominator B), so membership never changes
the sampling or the accounting. Nothing here depends on who was sampled, so these events are public.

Under Flower's simulation engine the nodes are P virtual SuperNodes that each build the whole task, and asking
every one of them costs a message each (about 20 ms apiece on 2 cores, seconds for hundreds of nodes). There the
server asks a few nodes first (:func:`probe_size`: one per core, so that each of the engine's workers loads the
ClientApp now, in parallel, rather than in the first round); when they answer as virtual nodes
(``fed_dp.clients.protocol.VirtualNodeUsers``), the server assigns user u to the (u mod P)-th virtual node id itself
and asks no other. Which virtual node trains a user changes nothing in what is computed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid

from fed_dp.clients import protocol
from fed_dp.server.messaging import receive, send_and_receive, unwrapped

log = logging.getLogger("fed_dp.server")


class NoUsersError(RuntimeError):
    """No connected node hosts any user: a run would spend its budget on noise alone."""


class ModelMismatchError(ValueError):
    """A node trains another model than the server's (parameter names or shapes differ): refused before round 1,
    so no round is sampled and no budget spent."""


class ModelNotReportedError(ModelMismatchError):
    """A node answered the user query without its model (``fed_dp.query_reply`` without ``model=``), so the server
    cannot check that it trains the server's model: refused before round 1 unless the strategy allows it
    (``allow_unreported_model``)."""


#: What Flower's ClientApp says when a message's type has no handler (flwr 1.41, 1.42): for the user query, a
#: ClientApp without ``@app.query()``.
_NO_HANDLER = "No query function registered"


def _seconds(values: Iterable[float]) -> str:
    """"41 s", "38-47 s" or "1.2-1.4 s" (tenths below 10 s)."""
    low, high = min(values), max(values)
    digits = 1 if high < 10 else 0
    low_text, high_text = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return f"{high_text} s" if low_text == high_text else f"{low_text}-{high_text} s"


class NotEnoughNodesError(RuntimeError):
    """Fewer than ``server.min-nodes`` nodes stayed connected for longer than ``server.node-wait``."""


@dataclass
class Node:
    """One hosting node: its stable ``name``, its ``users`` and its current node id (None while it is down)."""

    name: str
    users: tuple[int, ...]
    node_id: int | None


def format_users(users: Sequence[int]) -> str:
    """Sorted user indices → "0-13,20,22-25" (the inverse of ``fed_dp.clients.replies.parse_users``)."""
    parts: list[str] = []
    ordered = sorted(users)
    start = previous = None
    for user in [*ordered, None]:
        if start is not None and (user is None or user != previous + 1):
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if user is not None and start is None:
            start = user
        previous = user
    return ",".join(parts)


def probe_size(grid: Grid) -> int:
    """How many nodes the user query asks before the others (module docstring): 0, none apart, in a deployment;
    under Flower's simulation engine (its in-memory grid: ``flwr run`` on a simulation federation,
    ``flwr.simulation.run_simulation``), which runs in this process, one per core this process may use (the
    engine runs at most about that many ClientApps at once)."""
    try:
        from flwr.superlink.grid import InMemoryGrid
    except ImportError:  # another flwr layout: ask every node at once, as in a deployment
        return 0
    return len(os.sched_getaffinity(0)) if isinstance(unwrapped(grid), InMemoryGrid) else 0


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float, *,
                   why: str = "server.min-nodes). Start the SuperNodes, or lower server.min-nodes") -> list[int]:
    """Node ids once at least ``min_nodes`` are connected; RuntimeError after ``timeout`` seconds, saying ``why``
    that many were needed."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} SuperNode(s) connected after {timeout:.0f} s; {min_nodes} needed "
                               f"({why}")
        time.sleep(0.5)


class Membership:
    """The user → node map of a run, refreshed before every round (module docstring).

    ``num_users``: N (answers must name users in 0..N−1); ``query_timeout``: seconds to wait for answers to
    the user query; ``model``: the server's model fingerprint (``protocol.model_fingerprint``): a node that
    reports another is refused (:meth:`_check_model`), and so is a node that reports none unless
    ``allow_unreported`` (then it is used unchecked, with a warning).
    """

    def __init__(self, num_users: int, query_timeout: float, model: Sequence[str] | None = None, *,
                 allow_unreported: bool = False) -> None:
        self.num_users, self.query_timeout = num_users, query_timeout
        self.model = None if model is None else list(model)
        self.allow_unreported = allow_unreported
        self._unchecked = False  # a node answered without its model fingerprint (warned once)
        self.nodes: dict[str, Node] = {}
        self.owner: dict[int, str] = {}  # user → node name
        self._seen: set[int] = set()  # node ids that answered the user query (used, replaced or refused)
        self._silent: set[int] = set()  # node ids that did not answer yet (logged once, asked again)
        self.virtual: int | None = None  # P, once a node answered as one of P virtual nodes (simulation engine)
        self._waiting: dict[int, str] = {}  # node id → its unanswered user query's message id, of the last ask
        self._asked_at = 0.0  # time.monotonic() of the last ask

    # --- reading ---------------------------------------------------------------------------------------------
    def node_of(self, user: int) -> int | None:
        """The node id serving ``user`` now; None if no connected node hosts it."""
        name = self.owner.get(user)
        return self.nodes[name].node_id if name is not None else None

    def name_of(self, node_id: int) -> str:
        """The stable name of a node id (the id itself when it is nobody's)."""
        return next((node.name for node in self.nodes.values() if node.node_id == node_id), f"id {node_id}")

    def connected(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.node_id is not None]

    def hosted_users(self) -> int:
        """Users on a connected node."""
        return sum(len(node.users) for node in self.connected())

    # --- discovery -----------------------------------------------------------------------------------------------
    def start(self, grid: Grid, min_nodes: int, wait: float, *, probe: int = 0) -> None:
        """Wait for ``min_nodes`` nodes, ask each once; :class:`NoUsersError` if none hosts a user. With
        ``probe`` > 0 (Flower's simulation engine, :func:`probe_size`), ask that many nodes first: if they are
        virtual nodes, assign the users to the virtual nodes without asking the others (module docstring).

        The error tells the causes apart (:meth:`_no_users`): nodes that answered nothing within the query timeout
        (``server.reply-timeout``) are connected, so their ClientApps are slow to start; the server then listens
        as long again, only to measure when they do answer, and names that time. Nodes whose ClientApp answered
        without fed-dp's user query (no ``@app.query()`` handler) are named as such."""
        nodes = wait_for_nodes(grid, min_nodes, wait)
        self._waiting = {}
        asked = nodes[:probe] if 0 < probe < len(nodes) else nodes
        failures = self._ask(grid, asked, at_start=True)
        if self.virtual is None and len(asked) < len(nodes):  # the probe found nodes with users of their own
            failures += self._ask(grid, nodes[len(asked):], at_start=True)
            asked = nodes
        if self.virtual is not None:
            self._assign_virtual(grid, wait, asked=len(asked))
        if not self.owner:
            raise self._no_users(grid, len(nodes), failures)
        log.info("%d SuperNode(s) host %d of the %d users", len(self.connected()), len(self.owner), self.num_users)

    def _no_users(self, grid: Grid, connected: int, failures: list[str]) -> NoUsersError:
        """The :class:`NoUsersError` of a start at which no node hosts a user, saying what was observed: nodes
        silent within the query timeout (listened to as long again, to say when they answer: a slow start), nodes
        without a user-query handler, other failures."""
        silent = sorted(self._waiting)
        late: dict[int, float] = {}
        if silent:
            arrived: dict[str, float] = {}
            by_message = {message: node for node, message in self._waiting.items()}
            receive(grid, list(by_message), self.query_timeout, arrived=arrived)
            late = {by_message[m]: at - self._asked_at for m, at in arrived.items()}
        missing = [f for f in failures if _NO_HANDLER in f or "has no 'fed-dp.users' record" in f]
        other = [f for f in failures if f not in missing and "no answer within" not in f]
        parts = [f"none of the {connected} connected node(s) hosts any user, so every round would release noise "
                 "only; nothing was trained and no privacy budget was spent"]
        if silent:
            heard = (f"{len(late)} of them answered later, after {_seconds(late.values())}: their ClientApps are "
                     f"slow to start. Raise server.reply-timeout well above that (e.g. to "
                     f"{math.ceil(2 * max(late.values()) / 10) * 10:.0f} s)" if late else
                     f"none answered within {2 * self.query_timeout:g} s either: their ClientApps are stuck "
                     "starting or very slow (their SuperNodes' logs say which). Raise server.reply-timeout well "
                     "above the time a ClientApp takes to start there")
            parts.append(f"{len(silent)} connected node(s) answered nothing within server.reply-timeout = "
                         f"{self.query_timeout:g} s (node id(s) {', '.join(map(str, silent))}); {heard}, or run a "
                         "node service beside each SuperNode (fed-dp node-service: the task stays loaded, so a "
                         "message does not wait for a fresh ClientApp process to import torch and build the task). "
                         "Every round waits server.reply-timeout for replies too")
        if missing:
            parts.append("; ".join(missing) + ". Each ClientApp needs an @app.query() handler that answers "
                         "fed_dp.query_reply(msg, users)")
        if other:
            parts.append("; ".join(other))
        if not silent and not missing and not other:
            parts.append("every node answered with an empty user list")
        return NoUsersError(". ".join(parts))

    def refresh(self, grid: Grid) -> None:
        """Follow the connected node ids (module docstring); logs departures, returns and joins once each."""
        online = set(grid.get_node_ids())
        for node in self.nodes.values():
            if node.node_id is not None and node.node_id not in online:
                log.warning("node '%s' (node id %d) left: its %d user(s) count as dropped when sampled, until it "
                            "returns", node.name, node.node_id, len(node.users))
                node.node_id = None
        # An id that went away is asked again if it returns: with SuperNode authentication a restarted node keeps
        # its id, and what it hosts may have changed.
        self._seen &= online
        self._silent &= online
        new = sorted(online - self._seen)
        if new:
            self._ask(grid, new, at_start=False)

    def _ask(self, grid: Grid, node_ids: Sequence[int], *, at_start: bool) -> list[str]:
        """Send the user query to ``node_ids``; record each answer. Returns the failures, one line each."""
        failures: list[str] = []
        answered: set[int] = set()
        queries = [protocol.users_query(n) for n in node_ids]
        self._asked_at = time.monotonic()
        replies = send_and_receive(grid, queries, self.query_timeout)
        sent_to = protocol.destinations(queries)
        for node_id, reply in sorted(((protocol.replying_node(r, sent_to), r) for r in replies), key=lambda p: p[0]):
            if node_id not in node_ids or node_id in answered:
                continue
            answered.add(node_id)
            try:
                virtual = protocol.virtual_nodes(reply, self.num_users)
                hosted = protocol.parse_users_reply(reply, self.num_users)
            except protocol.ReplyError as error:
                failures.append(f"node {node_id}: {error}")
                log.warning("user query: node %s hosts no users: %s", node_id, error)
                self._seen.add(node_id)
                continue
            self._seen.add(node_id)
            self._silent.discard(node_id)
            if not self._check_model(node_id, reply, hosted, at_start=at_start):
                continue
            if virtual is not None or self.virtual is not None:
                self._note_virtual(node_id, virtual, at_start=at_start)
                continue
            name = protocol.node_name(reply) or f"users {format_users(hosted)}"
            self._place(name, tuple(sorted(hosted)), node_id, at_start=at_start)
        by_node = {node: message for message, node in sent_to.items()}
        self._waiting.update({node: by_node[node] for node in set(node_ids) - answered if node in by_node})
        for node_id in sorted(set(node_ids) - answered):
            failures.append(f"node {node_id}: no answer within {self.query_timeout:.0f} s")
            if node_id not in self._silent:
                self._silent.add(node_id)
                log.warning("node id %d is connected but did not answer the user query within %.0f s "
                            "(server.reply-timeout; a ClientApp slow to start?); it is asked again before the next "
                            "round", node_id, self.query_timeout)
        return failures

    def _check_model(self, node_id: int, reply: Message, hosted: Sequence[int], *, at_start: bool) -> bool:
        """Whether the node's model (its fingerprint in the reply) is the server's. A mismatch raises
        :class:`ModelMismatchError` at the start (before any round: no budget spent), naming the node and the first
        parameter that differs; later the node is logged and not used. A reply without a fingerprint (a ClientApp
        that does not pass ``model`` to ``query_reply``) is refused the same way (:class:`ModelNotReportedError`),
        unless ``allow_unreported``: then it is accepted, with a warning once."""
        if self.model is None:
            return True
        fingerprint = protocol.node_fingerprint(reply)
        name = protocol.node_name(reply) or (f"users {format_users(hosted)}" if hosted else "a virtual node")
        if fingerprint is None and self.allow_unreported:
            if not self._unchecked:
                self._unchecked = True
                log.warning("node id %d did not report its model in its answer to the user query; it is used "
                            "unchecked (allow_unreported_model), so a node that trains another model would spend "
                            "rounds of budget on noise alone", node_id)
            return True
        if fingerprint is None:
            error: ModelMismatchError = ModelNotReportedError(
                f"node id {node_id} ({name}) did not report its model in its answer to the user query (its ClientApp "
                "calls fed_dp.query_reply without model=), so the server cannot check that it trains the server's "
                "model: a node with another model would spend rounds of budget on noise alone. Pass the node's "
                "model to query_reply (query_reply(msg, users, model=trainer.model); fed-dp's own ClientApp does), or "
                "run such nodes unchecked with UserLevelDP(..., allow_unreported_model=True) (run config: "
                "server.allow-unreported-model = true)")
        else:
            why = protocol.fingerprint_mismatch(self.model, fingerprint)
            if why is None:
                return True
            error = ModelMismatchError(
                f"node id {node_id} ({name}) trains another model than the server's: {why}. The ClientApp and the "
                "ServerApp must build the same model (the Strategy's initial arrays are its named parameters)")
        if at_start:
            raise type(error)(f"{error}; no round was sampled and no privacy budget was spent")
        log.error("%s; it is not used", error)
        return False

    def _note_virtual(self, node_id: int, nodes: int | None, *, at_start: bool) -> None:
        """Record that ``node_id`` answered as one of ``nodes`` virtual nodes. Refused (an error at the start, else
        logged and the node not used): a node with users of its own (``nodes`` None) once virtual nodes answered,
        a virtual node among nodes with users of their own or after the start, another number of virtual nodes."""
        if at_start and nodes is not None and not self.nodes and self.virtual in (None, nodes):
            self.virtual = nodes
            return
        message = (f"node id {node_id} answered the user query as "
                   + ("a node with users of its own" if nodes is None else f"one of {nodes} virtual nodes")
                   + f" but {len(self.nodes)} node(s) answered with users of their own and the virtual nodes "
                   f"said {self.virtual}: every node must run the same ClientApp, in one kind of federation")
        if at_start:
            raise ValueError(message)
        log.error("%s; it is not used", message)

    def _assign_virtual(self, grid: Grid, wait: float, asked: int) -> None:
        """All P virtual nodes connected (waiting up to ``wait`` s), sorted by id: the k-th hosts users k, k + P,
        k + 2P, ... (module docstring); ``asked``: how many of them were asked (for the log)."""
        nodes = self.virtual
        ids = wait_for_nodes(grid, nodes, wait, why=f"a virtual node says the simulation has {nodes})")
        if len(ids) != nodes:
            raise ValueError(f"{len(ids)} nodes are connected but a virtual node of Flower's simulation engine says "
                             f"there are {nodes}: every node must run the same ClientApp in one federation")
        for k, node_id in enumerate(ids):
            self._seen.add(node_id)
            if k < self.num_users:
                self._place(f"virtual node {k}", tuple(range(k, self.num_users, nodes)), node_id, at_start=True)
        log.info("Flower's simulation engine: the %d users assigned to its %d virtual SuperNodes (user u to the "
                 "(u mod %d)-th), after asking %d of them", self.num_users, nodes, nodes, asked)

    def _place(self, name: str, users: tuple[int, ...], node_id: int, *, at_start: bool) -> None:
        """Record that ``node_id`` is the node ``name`` hosting ``users``."""
        known = self.nodes.get(name)
        if known is not None:
            if known.users != users:
                log.error("node id %d says it is node '%s' but hosts other users than that node did (%s, not %s); "
                          "it is not used. Give each SuperNode its own name and user range", node_id, name,
                          format_users(users), format_users(known.users))
                return
            if at_start:
                raise ValueError(f"node '{name}' is connected twice (node ids {known.node_id} and {node_id}): "
                                 "give every SuperNode a disjoint 'users' range and its own name")
            was = f"was node id {known.node_id}" if known.node_id is not None else "it had left"
            log.warning("node '%s' is back as node id %d (%s): its %d user(s) are served again", name, node_id, was,
                        len(users))
            known.node_id = node_id
            return
        taken: dict[str, list[int]] = {}
        for user in users:
            if user in self.owner:
                taken.setdefault(self.owner[user], []).append(user)
        if taken:
            overlap = ", ".join(f"{format_users(shared)} of node '{other}'" for other, shared in sorted(taken.items()))
            message = (f"node '{name}' (node id {node_id}) hosts users that other nodes host ({overlap}); give "
                       "every SuperNode a disjoint 'users' range")
            if at_start:
                raise ValueError(message)
            log.error("%s; it is not used", message)
            return
        self.nodes[name] = Node(name, users, node_id)
        self.owner.update({user: name for user in users})
        if not at_start and users:
            log.warning("node '%s' joined as node id %d with %d user(s)", name, node_id, len(users))

