"""The node service (fed_dp.clients.node_service): a long-lived process beside a SuperNode that answers the
ClientApp's messages with the ClientApp's own handlers. Replies forwarded through it must be the replies the
ClientApp computes in its own process; failures must reach the ClientApp (and so the server) as errors with
what to do, never as a silent fallback. A real Flower deployment with services is in the benchmark's smoke test
(tests/simulations/test_benchmark.py)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict

from fed_dp.clients import app as client_app
from fed_dp.clients import handlers as client_handlers
from fed_dp.clients import node_service, protocol
from fed_dp.clients.node_service import NODE_CONFIG_KEY, NodeServiceError, forward, serve
from fed_dp.config import PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.round import begin_round, init_server

RUN_CONFIG = {"task.ref": "w1", "task.users": 6, "task.examples": 4, "local.batch-size": 2, "local.lr": 0.1,
              "client.device": "cpu"}
NODE_CONFIG = {"users": "0-3"}
PRIVACY = PrivacyConfig(num_users=6, expected_cohort=2, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")


def _context(node_config=None) -> Context:
    return Context(run_id=1, node_id=5, node_config=dict(node_config or NODE_CONFIG), state=RecordDict(),
                   run_config=dict(RUN_CONFIG))


def _plan():
    trainer = client_handlers._trainer(_context())  # the same model the node builds, for θ's names and shapes
    named = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return begin_round(init_server(PRIVACY, make_optimizer("dp-fedavg"), trainer.layout.flatten(named), seed=1)), named


def _train_message(users=(1, 3)) -> Message:
    plan, named = _plan()
    message = protocol.train_message(plan, 5, list(users), named, seed=17)
    message.metadata.__dict__["_message_id"] = "m1"  # as the SuperLink gives it
    return message


class Service:
    """``serve`` on a socket in ``folder``, in a thread, for ``requests`` messages. Entered once the service logs
    that it listens (what the local deployment waits for too): its socket file exists from ``bind``, a moment
    before ``listen``, and a connection in between is refused."""

    def __init__(self, folder: Path, requests: int, handlers=None) -> None:
        self.socket = folder / "node.sock"
        self.answered: list[int] = []
        self.listening = threading.Event()
        self._log = logging.getLogger("fed_dp.node_service")
        self._level = self._log.level
        self._handler = _OnListening(self.listening)
        self._log.addHandler(self._handler)
        self._log.setLevel(logging.INFO)
        self.thread = threading.Thread(
            target=lambda: self.answered.append(serve(self.socket, handlers, max_requests=requests)), daemon=True)
        self.thread.start()

    def __enter__(self) -> "Service":
        if self.listening.wait(60):  # the default handlers import torch's trainer first
            return self
        self._detach()
        raise AssertionError("the node service did not start listening within 60 s")

    def __exit__(self, *exc) -> None:
        self.thread.join(30)
        self._detach()

    def _detach(self) -> None:
        self._log.removeHandler(self._handler)
        self._log.setLevel(self._level)


class _OnListening(logging.Handler):
    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fed-dp node service listening"):
            self.event.set()


@pytest.fixture(autouse=True)
def _identity(server_identity):
    """The tests create the server's messages (train_message, users_query) as a ServerApp does."""


@pytest.fixture
def message() -> Message:
    return _train_message()


def test_a_forwarded_train_message_gets_the_reply_the_clientapp_computes_itself(tmp_path, message):
    local = client_handlers.answer_train(message, _context())
    with Service(tmp_path, requests=1) as service:
        via_service = client_app.train(message, _context({**NODE_CONFIG, NODE_CONFIG_KEY: str(service.socket)}))
    assert service.answered == [1] and not service.socket.exists()  # the socket file goes with the service
    assert via_service.metadata.reply_to_message_id == message.metadata.message_id
    assert via_service.metadata.dst_node_id == message.metadata.src_node_id
    assert set(via_service.content) == set(local.content)
    for name in local.content:
        if name in via_service.content.array_records:
            for key, array in local.content[name].items():
                assert np.array_equal(array.numpy(), via_service.content[name][key].numpy()), (name, key)
        else:
            assert dict(via_service.content[name]) == dict(local.content[name]), name
    plan, _ = _plan()
    parsed = protocol.parse_train_reply(via_service, plan, asked=2, dim=plan.params.numel(), dtype=torch.float32)
    assert parsed.count == 2 and 0 < parsed.total.norm() <= 2 * PRIVACY.clip_norm + 1e-5  # two users, each clipped


def test_the_user_query_is_forwarded_too(tmp_path):
    query = protocol.users_query(5)
    query.metadata.__dict__["_message_id"] = "q1"
    with Service(tmp_path, requests=1) as service:
        reply = client_app.query(query, _context({**NODE_CONFIG, NODE_CONFIG_KEY: str(service.socket)}))
    assert protocol.parse_users_reply(reply, 6) == [0, 1, 2, 3]


def test_no_service_at_the_socket_is_an_error_saying_what_to_start(tmp_path, message):
    missing = tmp_path / "nobody.sock"
    with pytest.raises(NodeServiceError, match=r"fed-dp node-service --socket .*nobody\.sock.*remove node-service"):
        client_app.train(message, _context({**NODE_CONFIG, NODE_CONFIG_KEY: str(missing)}))


def test_a_failing_handler_reaches_the_clientapp_and_the_service_goes_on(tmp_path, message):
    calls = []

    def broken(msg, context):
        calls.append(msg.metadata.message_id)
        raise ValueError("asked to train users [9] that this node does not host")

    def echo(msg, context):
        return Message(RecordDict(), reply_to=msg)

    with Service(tmp_path, requests=2, handlers={"train": broken, "query": echo}) as service:
        context = _context({**NODE_CONFIG, NODE_CONFIG_KEY: str(service.socket)})
        with pytest.raises(NodeServiceError, match=r"ValueError: asked to train users \[9\]"):
            forward(service.socket, message, context)
        query = protocol.users_query(5)
        query.metadata.__dict__["_message_id"] = "q2"
        assert forward(service.socket, query, context).metadata.reply_to_message_id == "q2"
    assert calls == ["m1"] and service.answered == [2]


def test_a_clientapp_that_connects_while_the_service_loads_is_answered_once_it_has_loaded(tmp_path, monkeypatch):
    """The socket listens before the default handlers (torch) load: a ClientApp started right after the service
    waits for its answer instead of being refused."""
    loading, loaded = threading.Event(), threading.Event()

    def slow_handlers():
        loading.set()  # serve has bound and listens
        loaded.wait(30)  # the handlers load until the test lets them
        return {"query": lambda msg, context: Message(RecordDict(), reply_to=msg)}

    monkeypatch.setattr(node_service, "_default_handlers", slow_handlers)
    socket_path = tmp_path / "node.sock"
    service = threading.Thread(target=serve, args=(socket_path,), kwargs={"max_requests": 1}, daemon=True)
    service.start()
    assert loading.wait(30)
    query = protocol.users_query(5)
    query.metadata.__dict__["_message_id"] = "q4"
    replies = []
    asking = threading.Thread(target=lambda: replies.append(forward(socket_path, query, _context())), daemon=True)
    asking.start()
    asking.join(1.0)
    assert asking.is_alive() and not replies  # connected and waiting while the handlers load
    loaded.set()
    asking.join(30)
    service.join(30)
    assert replies and replies[0].metadata.reply_to_message_id == "q4" and not socket_path.exists()


def test_an_unknown_message_type_is_refused_with_the_known_ones(tmp_path):
    evaluate = Message(RecordDict(), dst_node_id=5, message_type=MessageType.EVALUATE)
    evaluate.metadata.__dict__["_message_id"] = "e1"
    with Service(tmp_path, requests=1, handlers={"train": None}) as service:
        with pytest.raises(NodeServiceError, match=r"no handler for message type 'evaluate' \(known: \['train'\]\)"):
            forward(service.socket, evaluate, _context())


def test_the_socket_is_private_and_a_live_one_is_not_taken_over(tmp_path):
    with Service(tmp_path, requests=1, handlers={}) as service:
        mode = stat.S_IMODE(os.stat(service.socket).st_mode)
        assert mode & 0o077 == 0, oct(mode)  # only the service's user can connect
        with pytest.raises(ValueError, match="already answers"):
            serve(service.socket, {}, max_requests=0)
        evaluate = Message(RecordDict(), dst_node_id=5, message_type=MessageType.EVALUATE)
        evaluate.metadata.__dict__["_message_id"] = "e2"
        with pytest.raises(NodeServiceError):
            forward(service.socket, evaluate, _context())


def test_a_stale_socket_file_is_replaced(tmp_path):
    stale = tmp_path / "node.sock"
    import socket

    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))  # a file of a service that died: nobody listens
    leftover.close()
    assert serve(stale, {}, max_requests=0) == 0 and not stale.exists()


def test_the_command_serves_in_its_own_process_until_sigterm(tmp_path):
    """``fed-dp node-service --socket PATH`` as an operator starts it: answers once it says it listens, then exits
    0 on SIGTERM and removes its socket."""
    import signal
    import subprocess
    import sys

    socket_path = tmp_path / "svc" / "node.sock"
    command = [sys.executable, "-m", "fed_dp.simulations.cli", "node-service", "--socket", str(socket_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line:  # logged after listen(): the socket file exists a moment earlier
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(lines)
        query = protocol.users_query(5)
        query.metadata.__dict__["_message_id"] = "q3"
        reply = forward(socket_path, query, _context({**NODE_CONFIG, "name": "edge-7"}))
        assert protocol.parse_users_reply(reply, 6) == [0, 1, 2, 3] and protocol.node_name(reply) == "edge-7"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        reader.join(30)
    output = "".join(lines)
    assert process.returncode == 0, output
    assert "stopping (SIGTERM) after 1 message(s)" in output
    assert not socket_path.exists()
