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

Handler = Callable[[Message], Message | None]


@pytest.fixture(autouse=True)
def server_identity(server_identity):
    """Autouse in the modules that import it: their messages are created as a ServerApp creates them."""
    yield


class InProcessGrid(Grid):
    """Delivers each message to its node's handler (module docstring); ``sent`` keeps every message."""

    def __init__(self, nodes: dict[int, Handler]) -> None:
        self.nodes = nodes
        self.sent: list[Message] = []
        self._replies: dict[str, Message] = {}  # message id → its reply, until pulled

    def set_run(self, run):  # pragma: no cover - not used by the strategy
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Each message gets an id (as the SuperLink gives it) and its node's reply, if any, is kept for a pull."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(message)
            ids.append(message.metadata.message_id)
            handler = self.nodes.get(message.metadata.dst_node_id)
            if handler is None:  # the node is gone: no reply
                continue
            try:
                reply = handler(message)
            except Exception as error:  # what Flower does with a ClientApp that raises
                reply = Message(Error(code=1, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            if reply is not None:
                self._replies[message.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
