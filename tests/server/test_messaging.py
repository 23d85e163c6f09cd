"""fed_dp.server.messaging.send_and_receive: push a round's messages, pull until each has its reply or the
timeout; every reply once, replies to other messages ignored, what came before the timeout kept."""

from __future__ import annotations

from flwr.app import Message, MessageType, RecordDict
from inprocess_grid import InProcessGrid, server_identity  # noqa: F401 (server_identity: autouse fixture)

from fed_dp.server.messaging import send_and_receive


def _reply(message: Message) -> Message:
    return Message(RecordDict(), reply_to=message)


class LateGrid(InProcessGrid):
    """Replies become visible only after ``late`` pulls; the first pull also returns a reply to a message that
    is not asked about and, later, a duplicate of one already returned."""

    def __init__(self, nodes, late: int) -> None:
        super().__init__(nodes)
        self.late, self.pulls = late, 0
        self.returned: list[Message] = []

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pulls <= self.late:
            return []
        replies = super().pull_messages(message_ids)
        extra = self.returned[:1]  # already returned once: must not be counted again
        self.returned += replies
        return replies + extra


def _messages(nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN) for n in nodes]


def test_every_reply_is_collected_once_after_polling():
    grid = LateGrid({1: _reply, 2: _reply, 3: _reply}, late=3)
    messages = _messages([1, 2, 3])
    replies = send_and_receive(grid, messages, timeout=30, poll=0.01)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted(m.metadata.message_id for m in messages)
    assert grid.pulls == 4  # three empty pulls, then all three replies


def test_the_timeout_keeps_what_came_and_stops_polling():
    grid = LateGrid({1: _reply, 2: lambda m: None}, late=0)  # node 2 never answers
    messages = _messages([1, 2])
    replies = send_and_receive(grid, messages, timeout=0.3, poll=0.05)  # returns: it stopped at the timeout
    assert [r.metadata.reply_to_message_id for r in replies] == [messages[0].metadata.message_id]
    assert grid.pulls >= 2


def test_nothing_to_send_sends_nothing():
    grid = InProcessGrid({})
    assert send_and_receive(grid, [], timeout=1) == [] and grid.sent == []


class RefusingGrid(InProcessGrid):
    """As flwr's HttpGrid when the SuperLink refuses a message (its node has just gone): None for its id."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        return [None if m.metadata.dst_node_id == 2 else i for m, i in zip(messages, ids, strict=True)]


def test_a_message_the_superlink_refused_gets_no_reply_and_breaks_nothing():
    grid = RefusingGrid({1: _reply, 2: _reply})
    messages = _messages([1, 2])
    replies = send_and_receive(grid, messages, timeout=0.3, poll=0.05)
    assert [r.metadata.reply_to_message_id for r in replies] == [messages[0].metadata.message_id]
