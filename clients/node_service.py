"""A node service: one long-lived process beside a SuperNode that keeps the task, its data and the model loaded
across messages; the project's ClientApp forwards each message to it.

Why: flwr (1.41, 1.42) starts a fresh ``flwr-clientapp`` process for every message, in both ``--isolation
subprocess`` and ``process``, so without a service every round each node imports torch and fed-dp and builds its
task again before it trains (measured on 2 cores: 1.9 s of CPU per message for W1, 4.4 s for a task split with
flwr-datasets). With one, the ClientApp process only imports Flower, as Flower's own minimal app does.

    fed-dp node-service --socket /srv/fed-dp/node0.sock &        # beside the SuperNode, as the same user
    flower-supernode ... --node-config "users='0-19' node-service='/srv/fed-dp/node0.sock'"

With ``node-service`` in its node config, ``fed_dp.clients.app`` imports neither torch nor fed-dp's trainer: it
sends the message and its context (Flower's protobuf serialization) over the Unix socket and returns a reply
built from the service's answer. The service answers with the ClientApp's own handlers
(``fed_dp.clients.handlers.HANDLERS``), so the replies are the same as without it (tested); it keeps the trainer of
the last task configuration it was asked for. It answers one message at a time, as a SuperNode sends them.

Errors: no service at the path → the ClientApp fails the message, saying what to start (the server sees that
node's error reply, as for any failure of the node); a handler that raises in the service → the same exception
type and text in the ClientApp; the service keeps serving. There is no fallback to training in the ClientApp
process: a node configured with a service that is down is a node that is down.

Access: the socket is created with mode 0600 (umask 077 while it binds), so only the service's user (and root)
can connect; run the SuperNode as that user. The wire carries length-prefixed byte frames only
(``multiprocessing.connection``'s ``send_bytes``/``recv_bytes``; nothing is unpickled): request = the Message
proto, then the Context proto; answer = a JSON header ``{"ok": true}`` then the reply's RecordDict proto, or
``{"ok": false, "error": ..., "type": ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Callable

from flwr.app import Context, Message
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.proto.message_pb2 import Context as ContextProto
from flwr.proto.message_pb2 import Message as MessageProto
from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

__all__ = ["NODE_CONFIG_KEY", "NodeServiceError", "answer_one", "forward", "message_kind", "serve"]

log = logging.getLogger("fed_dp.node_service")

#: The node-config key naming the service's socket.
NODE_CONFIG_KEY = "node-service"

Handler = Callable[[Message, Context], Message]


class NodeServiceError(RuntimeError):
    """The node service could not be reached, or it failed to answer a message."""


def message_kind(msg: Message) -> str:
    """``"train"`` for ``train`` and ``train.<action>``; likewise for the other message types."""
    return str(msg.metadata.message_type).partition(".")[0]


def forward(socket_path: str | os.PathLike[str], msg: Message, context: Context) -> Message:
    """The reply to ``msg``, computed by the node service at ``socket_path`` (module docstring)."""
    try:
        connection = Client(str(socket_path), family="AF_UNIX")
    except OSError as error:
        raise NodeServiceError(
            f"this SuperNode's node config names {NODE_CONFIG_KEY}={str(socket_path)!r}, but no fed-dp node service "
            f"answers there ({error.strerror or error}): start `fed-dp node-service --socket {socket_path}` beside "
            f"the SuperNode, as the same user, or remove {NODE_CONFIG_KEY} from the node config to train in the "
            "ClientApp process") from None
    with connection:
        try:
            connection.send_bytes(message_to_proto(msg).SerializeToString())
            connection.send_bytes(context_to_proto(context).SerializeToString())
            header = json.loads(connection.recv_bytes())
            content = None if not header.get("ok") else recorddict_from_proto(
                RecordDictProto.FromString(connection.recv_bytes()))
        except (EOFError, OSError) as error:
            raise NodeServiceError(f"the node service at {str(socket_path)!r} closed the connection before it "
                                   f"answered ({type(error).__name__}): did it exit? Its log says why") from None
    if content is None:
        raise NodeServiceError(f"the node service answered this {message_kind(msg)} message with "
                               f"{header.get('type', 'an error')}: {header.get('error', '')}")
    return Message(content, reply_to=msg)


def answer_one(connection: Connection, handlers: dict[str, Handler]) -> None:
    """Read one request from ``connection``, answer it with ``handlers[kind]``; a failure is sent back as an
    error header (and logged), never raised, so the service goes on."""
    try:
        msg = message_from_proto(MessageProto.FromString(connection.recv_bytes()))
        context = context_from_proto(ContextProto.FromString(connection.recv_bytes()))
        handler = handlers.get(message_kind(msg))
        if handler is None:
            raise ValueError(f"no handler for message type {msg.metadata.message_type!r} (known: {sorted(handlers)})")
        content = recorddict_to_proto(handler(msg, context).content).SerializeToString()
    except (EOFError, ConnectionError):
        log.warning("a ClientApp closed its connection before it sent a whole request")
        return
    except Exception as error:  # answered to the ClientApp, which raises it there: the node's error reply
        log.exception("answering a message failed")
        _send(connection, {"ok": False, "type": type(error).__name__, "error": str(error)})
        return
    _send(connection, {"ok": True}, content)


def _send(connection: Connection, header: dict[str, Any], content: bytes | None = None) -> None:
    try:
        connection.send_bytes(json.dumps(header).encode())
        if content is not None:
            connection.send_bytes(content)
    except OSError:
        log.warning("the ClientApp left before the answer was sent")


def _bind(path: Path) -> Listener:
    """A listener on ``path`` with mode 0600; a stale socket file (no one answers) is replaced, a live one is an
    error."""
    if path.exists():
        try:
            Client(str(path), family="AF_UNIX").close()
        except OSError:
            path.unlink()
        else:
            raise ValueError(f"a node service already answers at {str(path)!r}; stop it first or choose another "
                             "--socket")
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = os.umask(0o077)
    try:
        return Listener(str(path), family="AF_UNIX")
    finally:
        os.umask(previous)


def _default_handlers() -> dict[str, Handler]:
    """The project's ClientApp handlers, with torch and the trainer loaded (once, before the first message)."""
    import fed_dp.clients.replies  # noqa: F401  (torch and the trainer)
    from fed_dp.clients.handlers import HANDLERS

    return HANDLERS


def serve(socket_path: str | os.PathLike[str], handlers: dict[str, Handler] | None = None, *,
          max_requests: int | None = None) -> int:
    """Answer messages at ``socket_path`` until SIGTERM/SIGINT (or ``max_requests``, for tests); returns the
    number answered. ``handlers``: message kind → handler, default the project's ClientApp handlers.

    The socket listens before the default handlers load (torch, a few seconds): a ClientApp that connects
    meanwhile waits in the listen backlog and is answered once they have loaded, instead of being refused.
    "listening on" is logged when messages are answered without that wait."""
    path = Path(socket_path)
    listener = _bind(path)

    state = {"busy": False, "stop": ""}

    def stop(signum: int, _frame: Any) -> None:
        """Stop now when waiting for a message; after the message being answered otherwise (it is then counted)."""
        state["stop"] = signal.Signals(signum).name
        if not state["busy"]:
            raise KeyboardInterrupt(state["stop"])

    in_main = threading.current_thread() is threading.main_thread()  # signal handlers can only be set there
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    answered = 0
    try:
        handlers = _default_handlers() if handlers is None else handlers
        log.info("fed-dp node service listening on %s (handlers: %s)", path, ", ".join(sorted(handlers)))
        while max_requests is None or answered < max_requests:
            with listener.accept() as connection:
                state["busy"] = True
                answer_one(connection, handlers)
            answered += 1
            state["busy"] = False
            if state["stop"]:
                raise KeyboardInterrupt(state["stop"])
    except KeyboardInterrupt as why:
        log.info("node service stopping (%s) after %d message(s)", why, answered)
    finally:
        listener.close()  # removes the socket file
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return answered
