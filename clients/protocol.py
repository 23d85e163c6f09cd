"""The messages between fed-dp's server and its clients: the keys and the parse/reply pairs of both sides.

QUERY, "which users do you host?" (once per node id, when the server first sees it connected):

    server → node   {"fed-dp.query": ConfigRecord{"what": "users"}}
    node → server   {"fed-dp.users": ConfigRecord{"users": [sampler indices 0..N−1], "name": stable name (optional),
                                                   "model": ["name:shape", ...] (optional)}}
    a virtual node  {"fed-dp.users": ConfigRecord{"users": [], "virtual-nodes": P, "num-users": N, "model": ...}}

``model`` is the node's model fingerprint (:func:`model_fingerprint`): its trained parameters' names and shapes, in
order, then its frozen parameters (``requires_grad=False``) with a digest of their values. The server compares it
with its own model before round 1 and refuses a node whose model differs (:func:`fingerprint_mismatch`: another
trainable set, other shapes, other frozen values), before any round is sampled or any noise drawn. Frozen
parameters never travel: the node builds them as the server does (pretrained weights from a local folder, or the
same seed), and the digest says whether it did. It is optional, so replies of
nodes that do not send it still parse (the check is then skipped, with a warning) and the protocol version is
unchanged.

A virtual SuperNode of Flower's simulation engine builds the whole task, so it can train any of the N users
(:class:`VirtualNodeUsers`); on such an answer from one node the server assigns the users to the P virtual nodes
itself instead of asking each of them (``fed_dp.server.membership``).

TRAIN, round t, to each node hosting sampled users:

    server → node   {"fed-dp.model": ArrayRecord θ_{t−1} by parameter name (the trainable ones only),
                     "fed-dp.scale": ArrayRecord{"scale": s_t} (scale-then-privatize only),
                     "fed-dp.round": ConfigRecord{protocol, round, users, clip-norm, send-squares, send-clip-bits, seed},
                     "config": ConfigRecord (the Strategy's train_config, for a user's own ClientApp)}
    node → server   {"fed-dp.update": ArrayRecord{"total": Σ_i u_i, "squares": Σ_i u_i² (only when asked)},
                     "fed-dp.reply": MetricRecord{count, scaled (1 if clipped as s_t ⊙ Δ), unclipped (only when asked)},
                     "metrics": MetricRecord (training diagnostics; the server does not publish them)}

A client answers with :func:`parse_train_request` and :func:`make_train_reply`; the second refuses a contribution
that does not answer the request (no Σu² when they were asked for, no clip bits under adaptive clipping, not
clipped in the s_t-scaled geometry when s_t was broadcast), so a custom ClientApp that forgets one fails
loudly on its own node. The server reads replies with :func:`parse_train_reply`, which raises
:class:`ReplyError` with the reason for anything it cannot count (error replies, missing records, wrong
shapes, NaN/Inf, impossible counts); the server then counts that node's users as dropped and says why.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from fed_dp.clients.task import frozen_fingerprint, model_fingerprint  # noqa: F401 (the protocol's names)
from fed_dp.contribution import Contribution, RoundPlan

PROTOCOL = 1
QUERY, USERS = "fed-dp.query", "fed-dp.users"
MODEL, SCALE, ROUND, CONFIG = "fed-dp.model", "fed-dp.scale", "fed-dp.round", "config"
UPDATE, REPLY, METRICS = "fed-dp.update", "fed-dp.reply", "metrics"

__all__ = [
    "ReplyError", "TrainRequest", "VirtualNodeUsers", "destinations", "fingerprint_mismatch", "frozen_fingerprint",
    "make_train_reply",
    "model_fingerprint", "node_fingerprint", "node_name", "parse_train_reply", "parse_train_request",
    "parse_users_reply", "query_reply", "replying_node", "train_message", "users_query", "virtual_nodes",
]


class ReplyError(ValueError):
    """A reply the server cannot count; the message says why."""


# --- QUERY: which users a node hosts ---------------------------------------------------------------------------


def users_query(node_id: int) -> Message:
    """The server's question to one node."""
    return Message(content=RecordDict({QUERY: ConfigRecord({"what": "users"})}), dst_node_id=node_id,
                   message_type=MessageType.QUERY)


class VirtualNodeUsers(tuple):
    """The users of one of the ``nodes`` virtual SuperNodes of Flower's simulation engine: all N of them (every
    virtual node builds the whole task, so it can train any user), as a tuple 0..N−1 that also says how many
    virtual nodes there are. :func:`query_reply` answers it in one short record (not N indices), and the server,
    told so by a single node, assigns user u to the (u mod P)-th virtual node itself."""

    nodes: int

    def __new__(cls, num_users: int, nodes: int) -> "VirtualNodeUsers":
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"the number of virtual nodes must be an integer >= 1, got {nodes!r}")
        users = super().__new__(cls, range(num_users))
        users.nodes = nodes
        return users


def _parse_entry(entry: str) -> tuple[str, str, str | None]:
    """A fingerprint entry → (name, shape "d0xd1", the frozen digest or None for a trained parameter)."""
    head, marker, digest = entry.rpartition(":frozen:")
    if not marker:
        head, digest = entry, None
    name, _, shape = head.rpartition(":")
    return name, shape, digest


def _describe(entry: str | None, kinds: bool = False) -> str:
    if entry is None:
        return "nothing (no parameter there)"
    name, shape, digest = _parse_entry(entry)
    kind = ("trainable " if digest is None else "frozen ") if kinds else ""
    return f"{kind}{name!r} of shape ({', '.join(shape.split('x')) if shape else ''})"


def fingerprint_mismatch(server: Sequence[str], node: Sequence[str]) -> str | None:
    """None when the two fingerprints (:func:`model_fingerprint`) agree, else the first parameter that differs,
    with its name and shape on each side; where either model has frozen parameters, also whether each side trains
    or freezes it, and for a frozen parameter of the same name and shape, that its values differ."""
    if list(server) == list(node):
        return None
    index = next(i for i in range(max(len(server), len(node)))
                 if i >= len(server) or i >= len(node) or server[i] != node[i])
    mine = server[index] if index < len(server) else None
    theirs = node[index] if index < len(node) else None
    frozen = [sum(1 for entry in side if _parse_entry(entry)[2] is not None) for side in (node, server)]
    if not any(frozen):
        return (f"parameter #{index + 1} is {_describe(theirs)} on the node but {_describe(mine)} on the server "
                f"(the node's model has {len(node)} parameter tensors, the server's {len(server)})")
    if mine is not None and theirs is not None:
        (name, shape, digest), (their_name, their_shape, their_digest) = _parse_entry(mine), _parse_entry(theirs)
        if (name, shape) == (their_name, their_shape) and digest is not None and their_digest is not None:
            return (f"frozen parameter {name!r} holds other values on the node than on the server (digest "
                    f"{their_digest} against {digest}). Frozen parameters are never sent: every node and the server "
                    "build them themselves, so they must load the same pretrained weights (task.pretrained) or "
                    "initialize them from the same seed (run.seed)")
    return (f"parameter #{index + 1} is {_describe(theirs, True)} on the node but {_describe(mine, True)} on the "
            f"server (the node's model has {len(node) - frozen[0]} trainable and {frozen[0]} frozen parameter "
            f"tensors, the server's {len(server) - frozen[1]} and {frozen[1]}): both must build the same model and "
            "freeze the same parameters (requires_grad=False)")


def node_fingerprint(reply: Message) -> list[str] | None:
    """The model fingerprint a node sent with its answer to the user query; None if it sent none."""
    answer = reply.content[USERS] if USERS in reply.content else {}
    return [str(entry) for entry in answer["model"]] if "model" in answer else None


def query_reply(msg: Message, users: Sequence[int], name: str | None = None,
                model: nn.Module | Mapping[str, torch.Tensor] | None = None) -> Message:
    """A node's answer: the sampler indices of the users it hosts, optionally its stable ``name`` (the server
    recognises a restarted node by it; without one, by its user ranges) and the ``model`` it trains (an
    ``nn.Module`` or its named parameters: the server refuses a model other than its own before round 1, naming
    the first parameter that differs; pass it). For :class:`VirtualNodeUsers` (a virtual node of Flower's
    simulation engine, ``fed_dp.hosted_users``), the number of virtual nodes and N instead of the indices."""
    if QUERY not in msg.content:
        raise ValueError("this QUERY is not fed-dp's user query (it has no 'fed-dp.query' record)")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"a node's name must be a non-empty string, got {name!r}")
    if model is not None and not isinstance(model, (nn.Module, Mapping)):
        raise ValueError(f"model must be the node's torch.nn.Module or its named parameters, got "
                         f"{type(model).__name__}")
    if isinstance(users, VirtualNodeUsers):
        answer = {"users": [], "virtual-nodes": users.nodes, "num-users": len(users)}
    else:
        answer = {"users": [int(u) for u in users]}
    if model is not None:
        answer["model"] = model_fingerprint(model)
    answer = ConfigRecord(answer | ({"name": name.strip()} if name is not None else {}))
    return Message(content=RecordDict({USERS: answer}), reply_to=msg)


def virtual_nodes(reply: Message, num_users: int) -> int | None:
    """P when a node answered the user query as one of P virtual nodes of Flower's simulation engine (any of the
    N users can be trained on it), else None; ReplyError when its task has another N than the server's."""
    if reply.has_error() or USERS not in reply.content or "virtual-nodes" not in reply.content[USERS]:
        return None
    answer = reply.content[USERS]
    if int(answer.get("num-users", -1)) != num_users:
        raise ReplyError(f"it is a virtual node of a task with N = {answer.get('num-users')} users, but the server's "
                         f"population has N = {num_users}: the ServerApp and the ClientApp must build the same task")
    nodes = int(answer["virtual-nodes"])
    if nodes < 1:
        raise ReplyError(f"it says there are {nodes} virtual nodes")
    return nodes


def node_name(reply: Message) -> str | None:
    """The name a node gave in its answer to the user query (None if it gave none)."""
    name = reply.content[USERS].get("name") if USERS in reply.content else None
    return str(name) if name else None


def parse_users_reply(reply: Message, num_users: int) -> list[int]:
    """The user indices of a node's answer; ReplyError for an error reply, a missing record or bad indices."""
    if reply.has_error():
        raise ReplyError(f"error reply ({reply.error.code}): {last_line(reply.error.reason)}")
    if USERS not in reply.content:
        raise ReplyError("its answer has no 'fed-dp.users' record; a ClientApp must answer fed-dp's user query with "
                         "fed_dp.query_reply (an @app.query() handler)")
    users = [int(u) for u in reply.content[USERS]["users"]]
    outside = [u for u in users if not 0 <= u < num_users]
    if outside:
        raise ReplyError(f"it hosts users {outside[:5]} outside 0..{num_users - 1} (the population has N = "
                         f"{num_users} users)")
    return users


def destinations(messages: Sequence[Message]) -> dict[str, int]:
    """message id → the node id it was sent to (ids are set when the grid pushes the messages)."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}


def replying_node(reply: Message, sent_to: Mapping[str, int]) -> int:
    """The node a reply answers for: the destination of the message it replies to (for an unreachable node the
    SuperLink itself sends the error reply, so the reply's own source is not the node), else its source."""
    return sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)


# --- TRAIN ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainRequest:
    """What a node is asked in round ``round`` (0-based): train ``users`` from θ_{t−1} = ``params`` (by
    parameter name), clip to ``clip_norm`` (as s_t ⊙ Δ when ``scale`` is given), and reply Σu, the count,
    Σu² when ``send_squares`` and the number of unclipped users when ``send_clip_bits``."""

    round: int
    users: tuple[int, ...]
    clip_norm: float
    send_squares: bool
    send_clip_bits: bool
    seed: int
    params: "OrderedDict[str, torch.Tensor]"
    scale: torch.Tensor | None = None
    config: Mapping[str, Any] = field(default_factory=dict)

    def plan(self, params: torch.Tensor) -> RoundPlan:
        """The request as the round plan of the users it asks for (``params``: θ_{t−1} as the node's flat vector)."""
        return RoundPlan(round=self.round, cohort=torch.tensor(self.users, dtype=torch.int64), params=params,
                         clip_norm=self.clip_norm, scale=self.scale, send_squares=self.send_squares,
                         send_clip_bits=self.send_clip_bits)


def train_message(plan: RoundPlan, node_id: int, users: Sequence[int], params: Mapping[str, torch.Tensor],
                  seed: int, config: Mapping[str, Any] | None = None) -> Message:
    """The TRAIN message of round ``plan.round`` for one node hosting ``users`` of the cohort."""
    content = {
        MODEL: ArrayRecord(torch_state_dict=OrderedDict((k, v.detach().cpu()) for k, v in params.items())),
        ROUND: ConfigRecord({"protocol": PROTOCOL, "round": plan.round, "users": [int(u) for u in users],
                             "clip-norm": float(plan.clip_norm), "send-squares": plan.send_squares,
                             "send-clip-bits": plan.send_clip_bits, "seed": int(seed)}),
        CONFIG: ConfigRecord(dict(config or {})),
    }
    if plan.scale is not None:
        content[SCALE] = ArrayRecord(torch_state_dict=OrderedDict(scale=plan.scale.detach().cpu()))
    return Message(content=RecordDict(content), dst_node_id=node_id, message_type=MessageType.TRAIN,
                   group_id=str(plan.round + 1))  # Flower's server_round: rounds 1 … T


def parse_train_request(msg: Message) -> TrainRequest:
    """The request of a TRAIN message; ValueError if it is not fed-dp's (or of another protocol version)."""
    missing = [key for key in (MODEL, ROUND) if key not in msg.content]
    if missing:
        raise ValueError(f"this TRAIN message is not fed-dp's: it lacks {missing}; it must come from "
                         "fed_dp's Strategy (fed_dp.UserLevelDP)")
    meta = msg.content[ROUND]
    if int(meta["protocol"]) != PROTOCOL:
        raise ValueError(f"the server speaks fed-dp protocol {meta['protocol']}, this client {PROTOCOL}: install the "
                         "same fed-dp version on the server and every node")
    scale = msg.content[SCALE].to_torch_state_dict()["scale"] if SCALE in msg.content else None
    return TrainRequest(
        round=int(meta["round"]), users=tuple(int(u) for u in meta["users"]), clip_norm=float(meta["clip-norm"]),
        send_squares=bool(meta["send-squares"]), send_clip_bits=bool(meta["send-clip-bits"]), seed=int(meta["seed"]),
        params=msg.content[MODEL].to_torch_state_dict(), scale=scale,
        config=dict(msg.content[CONFIG]) if CONFIG in msg.content else {},
    )


def make_train_reply(msg: Message, request: TrainRequest, contribution: Contribution,
                metrics: Mapping[str, float] | None = None) -> Message:
    """A node's reply to ``request``; ValueError when ``contribution`` does not answer it (what is missing and
    how to compute it)."""
    if contribution.count > len(request.users) or contribution.count < 0:
        raise ValueError(f"the contribution counts {contribution.count} users; {len(request.users)} were requested")
    if request.send_squares and contribution.total_squares is None:
        raise ValueError("the server asked for Σu² (independent moment estimation): compute the contribution with "
                         "send_squares=request.send_squares")
    if request.send_clip_bits and contribution.unclipped is None:
        raise ValueError("the server runs adaptive clipping and needs the number of users whose update was not "
                         "clipped (contribution.unclipped)")
    if (request.scale is not None) != contribution.scaled:
        raise ValueError("the server broadcast s_t (scale-then-privatize): clip s_t ⊙ Δ_i "
                         "(fed_dp.clipping.clip_scaled with scale=request.scale)" if request.scale is not None else
                         "the contribution says it was clipped in a scaled geometry, but no s_t was broadcast")
    arrays = OrderedDict(total=contribution.total.detach().to("cpu", torch.float32))
    if request.send_squares:
        arrays["squares"] = contribution.total_squares.detach().to("cpu", torch.float32)
    reply = {"count": int(contribution.count), "scaled": int(contribution.scaled)}
    if request.send_clip_bits:
        reply["unclipped"] = int(contribution.unclipped)
    diagnostics = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
    return Message(content=RecordDict({UPDATE: ArrayRecord(torch_state_dict=arrays), REPLY: MetricRecord(reply),
                                       METRICS: MetricRecord(diagnostics)}), reply_to=msg)


def parse_train_reply(reply: Message, plan: RoundPlan, asked: int, dim: int, dtype: torch.dtype) -> Contribution:
    """A node's reply as a Contribution to ``plan`` (``asked`` users were requested of it, d = ``dim``).

    Raises ReplyError with the reason when it cannot be counted. Oversized sums are not an error here: the
    round re-clips them (server-side enforcement of ζ)."""
    node = reply.metadata.src_node_id
    if reply.has_error():
        raise ReplyError(f"error reply ({reply.error.code}): {last_line(reply.error.reason)}")
    missing = [key for key in (UPDATE, REPLY) if key not in reply.content]
    if missing:
        raise ReplyError(f"the reply lacks {missing}; a ClientApp must answer with fed_dp.train_reply (or parse_train_request + make_train_reply)")
    try:
        arrays = reply.content[UPDATE].to_torch_state_dict()
        meta = reply.content[REPLY]
        count = meta["count"]
    except Exception as error:  # a malformed record
        raise ReplyError(f"unreadable reply ({type(error).__name__}: {error})") from None
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= asked:
        raise ReplyError(f"reports {count!r} users but {asked} were asked of it")
    total = _vector(arrays.get("total"), "total", dim, dtype)
    squares = _vector(arrays.get("squares"), "squares", dim, dtype) if plan.send_squares else None
    if squares is not None and bool((squares < 0).any()):
        raise ReplyError("squares has negative entries")
    unclipped = None
    if plan.send_clip_bits:
        unclipped = meta.get("unclipped")
        if isinstance(unclipped, bool) or not isinstance(unclipped, int) or not 0 <= unclipped <= count:
            raise ReplyError(f"clip-bit sum {unclipped!r} is not an integer in [0, count = {count}] (adaptive "
                             "clipping needs it)")
    scaled = bool(meta.get("scaled", 0))
    if scaled != (plan.scale is not None):
        raise ReplyError("it did not clip in the broadcast s_t geometry (scale-then-privatize)" if plan.scale is not None
                         else "it says it clipped in a scaled geometry, but no s_t was broadcast")
    return Contribution(total, count, squares, source=f"node {node}", unclipped=unclipped, scaled=scaled)


def failed_users(reply: Message) -> int:
    """How many of the users a node was asked for failed to load or train and went as zero updates (its reply's
    ``failed_users`` diagnostic; 0 when absent or unreadable): operator-only information."""
    try:
        value = reply.content[METRICS]["failed_users"]
    except Exception:
        return 0
    return int(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0


def _vector(value: Any, name: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ReplyError(f"{name} is missing")
    if not value.dtype.is_floating_point:
        raise ReplyError(f"{name} has dtype {value.dtype}, expected a floating-point vector")
    if tuple(value.shape) != (dim,):
        raise ReplyError(f"{name} has shape {tuple(value.shape)}, expected ({dim},)")
    if not bool(torch.isfinite(value).all()):
        raise ReplyError(f"{name} contains NaN or Inf")
    return value.to(dtype)


def last_line(text: str | None) -> str:
    return text.strip().splitlines()[-1] if text and text.strip() else ""
