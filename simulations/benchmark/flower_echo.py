"""Flower's floor for a deployment round: a ServerApp that sends one W1-sized array (25,578 float32) to every
connected node per round and a ClientApp that sends it back, nothing else (no torch in the ClientApp's process).

``fed-dp benchmark --only deployment`` runs it on the same SuperLink and SuperNodes as the project's apps, so
the project's round overhead is read against what Flower itself costs per round. Run config: ``rounds`` and
``out`` (where the ServerApp writes ``{"round_seconds": [...], "nodes": n}``); the Flower app folder is
``simulations/benchmark/flower_echo_app``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

#: The Flower app folder that runs these apps with ``flwr run``.
APP = Path(__file__).resolve().parent / "flower_echo_app"
W1_PARAMETERS = 25_578

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    nodes = sorted(grid.get_node_ids())
    arrays = ArrayRecord([np.zeros(W1_PARAMETERS, dtype=np.float32)])
    seconds = []
    for _ in range(int(context.run_config["rounds"])):
        start = time.perf_counter()
        messages = [Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type=MessageType.TRAIN)
                    for node in nodes]
        replies = list(grid.send_and_receive(messages, timeout=300))
        seconds.append(time.perf_counter() - start)
        failed = [reply.error.reason for reply in replies if reply.has_error()]
        if len(replies) != len(nodes) or failed:
            raise RuntimeError(f"{len(replies)} of {len(nodes)} nodes replied; errors: {failed[:3]}")
    Path(str(context.run_config["out"])).write_text(json.dumps({"round_seconds": seconds, "nodes": len(nodes)}))


@client_app.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)
