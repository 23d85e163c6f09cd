"""Sending a round's messages and collecting the replies, without Flower's 3-second wait under a deployment.

Flower's ``Grid.send_and_receive`` pushes the messages, then pulls the replies with a pause between pulls: 3 s
under a deployment (``HttpGrid`` of flwr 1.41 and 1.42), 0.1 s under the simulation engine (``InMemoryGrid``).
In a deployment every round so waits 1.5 s on average after its last reply has arrived. :func:`send_and_receive`
does the same with the Grid's public ``push_messages``/``pull_messages`` and the simulation engine's pause
everywhere (:data:`POLL_SECONDS`): while a round is out, the ServerApp asks the SuperLink for replies ten
times a second (each request names the message ids still waiting).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["POLL_SECONDS", "send_and_receive"]

POLL_SECONDS = 0.1


def send_and_receive(grid: Grid, messages: Sequence[Message], timeout: float | None,
                     poll: float = POLL_SECONDS) -> list[Message]:
    """Push ``messages``, then pull replies every ``poll`` s until each has one or ``timeout`` s have passed
    (None: until each has one, as Flower's); the replies, at most one per message, in the order they came."""
    if not messages:
        return []
    waiting = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while True:
        for reply in grid.pull_messages(sorted(waiting)):
            if reply.metadata.reply_to_message_id in waiting:
                waiting.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
        left = None if deadline is None else deadline - time.monotonic()
        if not waiting or (left is not None and left <= 0):
            return replies
        time.sleep(poll if left is None else min(poll, left))
