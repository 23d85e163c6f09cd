"""A Flower ``Grid`` in this process for the Strategy's tests: each message goes to its node's handler.

Messages are real ``flwr.app.Message`` objects; only the transport is replaced. ``nodes`` may change between or
during rounds (a node leaves: remove it; a node restarts: add its handler under a new id). A handler that raises
gives an error reply, as Flower does for a ClientApp that raises; one that returns None gives no reply (as a
node that misses the deadline).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
from flwr.app import Error, Message
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

Handler = Callable[[Message], Message | None]


@pytest.fixture(autouse=True)
def server_identity():
    """What a ServerApp process has when Flower runs it (instruction messages carry it)."""
    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before


class InProcessGrid(Grid):
    """Delivers each message to its node's handler (module docstring); ``sent`` keeps every message."""

    def __init__(self, nodes: dict[int, Handler]) -> None:
        self.nodes = nodes
        self.sent: list[Message] = []

    def set_run(self, run):  # pragma: no cover - not used by the strategy
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            handler = self.nodes.get(message.metadata.dst_node_id)
            if handler is None:  # the node is gone: no reply
                continue
            try:
                reply = handler(message)
            except Exception as error:  # what Flower does with a ClientApp that raises
                reply = Message(Error(code=1, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            if reply is not None:
                replies.append(reply)
        return replies
