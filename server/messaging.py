"""Sending a round's messages and collecting the replies: without Flower's 3-second wait under a deployment, and
riding out the SuperLink's transient errors.

Flower's ``Grid.send_and_receive`` pushes the messages, then pulls the replies with a pause between pulls: 3 s
under a deployment (``HttpGrid`` of flwr 1.41 and 1.42), 0.1 s under the simulation engine (``InMemoryGrid``).
In a deployment every round so waits 1.5 s on average after its last reply has arrived. :func:`send_and_receive`
does the same with the Grid's public ``push_messages``/``pull_messages`` and the simulation engine's pause
everywhere (:data:`POLL_SECONDS`): while a round is out, the ServerApp asks the SuperLink for replies ten
times a second (each request names the message ids still waiting).

Transient errors. Under load the SuperLink's state store (SQLite) can fail a request with "database is locked"
(it waits 5 s for the lock, then gives up). flwr 1.41/1.42 pass that to the ServerApp as HTTP 500 (the reason
is only in the SuperLink's log); they retry 502, 503, 504 and lost connections themselves, but not 500, so the
ServerApp failed. :class:`RetryingGrid` wraps the ServerApp's Grid and retries what is transient
(:func:`transient`: HTTP 500, 502, 503, 504 and 429, a timeout or a dropped connection, flwr's
``ObjectPushError`` (an upload of a message's content that gave up), gRPC UNAVAILABLE, DEADLINE_EXCEEDED and
RESOURCE_EXHAUSTED, any error that says "database is locked") a bounded number of times
with exponential backoff (:data:`RETRIES`: 6 tries, waits of 2, 4, 8, 16 and 30 s), logging each retry with the
error; then it stops with :class:`SuperLinkError`. Anything else (401 or 403: the run was stopped; a malformed
message) is raised at once.

A retry cannot release a round twice or spend budget twice: the Grid is used only before a round's noise is
drawn (the membership refresh, pushing the round's messages, pulling the replies); the noise, the ledger and the
checkpoint never go through it. Pushing again is idempotent (a message's id is its content's hash, and the
SuperLink ignores a message id it already stores); a pull that failed half-way may lose replies it had already
confirmed, whose users then count as dropped for that round (the fixed denominator B keeps the guarantee).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["POLL_SECONDS", "RETRIES", "Retries", "RetryingGrid", "SuperLinkError", "receive", "retrying",
           "send_and_receive", "transient", "unwrapped", "with_retries"]

POLL_SECONDS = 0.1
log = logging.getLogger("fed_dp.server")
T = TypeVar("T")


def send_and_receive(grid: Grid, messages: Sequence[Message], timeout: float | None,
                     poll: float = POLL_SECONDS) -> list[Message]:
    """Push ``messages``, then pull replies every ``poll`` s until each has one or ``timeout`` s have passed
    (None: until each has one, as Flower's); the replies, at most one per message, in the order they came."""
    if not messages:
        return []
    return receive(grid, grid.push_messages(messages), timeout, poll)


def receive(grid: Grid, message_ids: Iterable[str], timeout: float | None, poll: float = POLL_SECONDS,
            arrived: dict[str, float] | None = None) -> list[Message]:
    """Pull the replies to ``message_ids`` (pushed already) every ``poll`` s until each has one or ``timeout`` s
    have passed; ``arrived`` is filled with message id → ``time.monotonic()`` when its reply was pulled. An id that
    is None (flwr's ``push_messages`` for a message the SuperLink refused, e.g. to a node that has just gone) gets no
    reply: its node counts as not answering."""
    waiting = {message_id for message_id in message_ids if message_id}
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while waiting:
        pulled = grid.pull_messages(sorted(waiting))
        now = time.monotonic()
        for reply in pulled:
            if reply.metadata.reply_to_message_id in waiting:
                waiting.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
                if arrived is not None:
                    arrived[reply.metadata.reply_to_message_id] = now
        left = None if deadline is None else deadline - time.monotonic()
        if not waiting or (left is not None and left <= 0):
            break
        time.sleep(poll if left is None else min(poll, left))
    return replies


# --- the SuperLink's transient errors ------------------------------------------------------------------------


class SuperLinkError(RuntimeError):
    """The SuperLink kept failing one request through every retry (:class:`Retries`)."""


@dataclass(frozen=True, kw_only=True)
class Retries:
    """Bounded retries: at most ``attempts`` tries of a request, waiting ``first_wait`` s after the first failure
    and ``factor`` times longer after each further one, at most ``max_wait`` s."""

    attempts: int = 6
    first_wait: float = 2.0
    factor: float = 2.0
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"Retries.attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("first_wait", "max_wait"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Retries.{name} must be a number >= 0, got {getattr(self, name)!r}")
        if not self.factor >= 1:
            raise ValueError(f"Retries.factor must be a number >= 1, got {self.factor!r}")

    def wait(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed try (1-based): first_wait · factor^(failures − 1),
        at most max_wait."""
        return min(self.max_wait, self.first_wait * self.factor ** (failures - 1))


#: The ServerApp's retries of the SuperLink's transient errors: 6 tries, over 60 s of waits.
RETRIES = Retries()
_TRANSIENT_HTTP = {429: "429 Too Many Requests", 500: "500 Internal Server Error", 502: "502 Bad Gateway",
                   503: "503 Service Unavailable", 504: "504 Gateway Timeout"}
_TRANSIENT_GRPC = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
_LOCKED = "database is locked"


def transient(error: BaseException) -> str | None:
    """Why ``error`` is a transient failure of the SuperLink, worth retrying (module docstring); None if it is
    not one."""
    if _LOCKED in str(error).lower():
        return f"the SuperLink's state store: {_LOCKED}"
    status = getattr(getattr(error, "response", None), "status_code", None)  # httpx.HTTPStatusError
    if isinstance(status, int) and status in _TRANSIENT_HTTP:
        why = f"HTTP {_TRANSIENT_HTTP[status]}"
        return f"{why}; the SuperLink's log says why, e.g. '{_LOCKED}' from its state store" if status == 500 else why
    try:
        import httpx
    except ImportError:  # pragma: no cover - a flwr without its HTTP transport
        httpx = None
    if httpx is not None and isinstance(error, (httpx.TimeoutException, httpx.NetworkError,
                                                httpx.RemoteProtocolError)):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if type(error).__name__ == "ObjectPushError":  # flwr's object upload gave up, e.g. on a locked state store
        return f"the upload of the messages' content failed: {error}"
    code = getattr(error, "code", None)  # grpc.RpcError, from a flwr whose Grid speaks gRPC
    if callable(code):
        try:
            name = getattr(code(), "name", "")
        except Exception:  # noqa: BLE001 - another object's code(): not gRPC's
            name = ""
        if name in _TRANSIENT_GRPC:
            details = getattr(error, "details", None)
            return f"gRPC {name}" + (f": {details()}" if callable(details) else "")
    return None


def with_retries(what: str, call: Callable[[], T], retries: Retries = RETRIES,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, tried again after a :func:`transient` error (each retry logged with the error), at most
    ``retries.attempts`` tries in all; then :class:`SuperLinkError` saying that ``what`` failed and why. Any other
    error is raised at once."""
    started = time.monotonic()
    for attempt in range(1, retries.attempts + 1):
        try:
            return call()
        except Exception as error:
            why = transient(error)
            if why is None:
                raise
            if attempt == retries.attempts:
                raise SuperLinkError(
                    f"the SuperLink failed {what} {attempt} time(s) in a row over "
                    f"{time.monotonic() - started:.0f} s ({why}); fed-dp retried with backoff and gave up. Look at "
                    "the SuperLink's log and its machine (a state store that stays locked, a full disk, an "
                    "overloaded machine)") from error
            wait = retries.wait(attempt)
            log.warning("the SuperLink failed %s (%s); retry %d of %d in %.1f s", what, why, attempt,
                        retries.attempts - 1, wait)
            sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


class RetryingGrid(Grid):
    """A Grid whose requests to the SuperLink are tried again after transient errors (:func:`with_retries`,
    ``retries``: :data:`RETRIES` unless given); everything else is the wrapped grid's (``inner``)."""

    def __init__(self, inner: Grid, retries: Retries | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner, self.retries, self._sleep = inner, RETRIES if retries is None else retries, sleep

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        return with_retries(what, call, self.retries, self._sleep)

    def set_run(self, run: Any) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._retry("the request for the connected node ids", lambda: list(self.inner.get_node_ids()))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        return self._retry(f"the push of {len(messages)} message(s)", lambda: list(self.inner.push_messages(messages)))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        message_ids = list(message_ids)
        return self._retry("a pull of replies", lambda: list(self.inner.pull_messages(message_ids)))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return send_and_receive(self, list(messages), timeout)

    def __getattr__(self, name: str) -> Any:  # what a particular grid adds (HttpGrid.get_nodes, ...)
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def retrying(grid: Grid) -> RetryingGrid:
    """``grid`` with retries (:class:`RetryingGrid`); a grid that retries already is returned as it is."""
    return grid if isinstance(grid, RetryingGrid) else RetryingGrid(grid)


def unwrapped(grid: Grid) -> Grid:
    """The Grid Flower gave, under any :class:`RetryingGrid`."""
    while isinstance(grid, RetryingGrid):
        grid = grid.inner
    return grid
