"""The Flower ClientApp of fed-dp: a node hosts one or many users and answers for each sampled one.

    QUERY  → the user ids this node hosts (node config ``users``, e.g. "0-19,40-49"; in simulations user
             u lives on partition u mod num-partitions)
    TRAIN  → for the requested users: local SGD from θ_{t−1}, Δ_i clipped in the broadcast geometry
             (clients.vectorized.contribution: vectorized over users on CUDA, one at a time on the CPU,
             as the in-process engine does), reply Σu (and Σu² when asked) with the count
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fed_dp.clients.training import LocalTraining, resolve_device
from fed_dp.clients.vectorized import contribution as node_contribution
from fed_dp.flat import ParamLayout
from fed_dp.server.config import DEFAULTS, task_params
from fed_dp.simulations.tasks import build_task

app = ClientApp()
_TASKS: dict[str, Any] = {}  # task cache per process (simulation reuses processes; deployment may not)


def parse_users(spec: str) -> list[int]:
    """"0-19,40-49,7" → sorted user ids; a clear error for anything else."""
    users: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        try:
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"node-config 'users' must look like '0-19,40-49', got {spec!r}") from None
        if first > last or first < 0:
            raise ValueError(f"node-config 'users': bad range {part!r}")
        users.update(range(first, last + 1))
    return sorted(users)


def node_users(node_config: dict[str, Any], num_users: int) -> list[int]:
    if "users" in node_config:
        return parse_users(node_config["users"])
    if "partition-id" in node_config and "num-partitions" in node_config:  # Flower simulation engine
        pid, parts = int(node_config["partition-id"]), int(node_config["num-partitions"])
        return list(range(pid, num_users, parts))
    raise ValueError("this SuperNode has no 'users' in its --node-config (e.g. --node-config \"users='0-19'\")")


def _task(context: Context):
    params = task_params(dict(context.run_config), node_root=str(context.node_config.get("data-root", "")))
    key = repr(sorted(params.items()))
    if key not in _TASKS:
        _TASKS.clear()
        _TASKS[key] = build_task(**params)
    return _TASKS[key]


def _device(context: Context) -> torch.device:
    """``client.device`` resolved like the engine's ``device`` (clear errors for a CUDA device this node lacks)."""
    return resolve_device(str({**DEFAULTS, **context.run_config}["client.device"]))


@app.query()
def query(msg: Message, context: Context) -> Message:
    num_users = int({**DEFAULTS, **context.run_config}["task.users"])
    users = node_users(context.node_config, num_users)
    return Message(content=RecordDict({"users": ConfigRecord({"users": users})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    run_config = {**DEFAULTS, **context.run_config}
    task = _task(context)
    config = msg.content["config"]
    hosted = set(node_users(context.node_config, task.num_users))
    requested = [int(u) for u in config["users"]]
    foreign = [u for u in requested if u not in hosted]
    if foreign:
        raise ValueError(f"asked to train users {foreign[:5]} that this node does not host")
    arrays = msg.content["model"].to_numpy_ndarrays()
    device = _device(context)
    params = torch.from_numpy(np.array(arrays[0], copy=True)).to(device)
    scale = torch.from_numpy(np.array(arrays[1], copy=True)).to(device) if len(arrays) > 1 else None
    model = task.make_model().to(device)  # its initial weights are replaced by the broadcast θ
    layout = ParamLayout.from_state_dict({k: v.detach() for k, v in model.named_parameters()})
    training = LocalTraining(epochs=int(run_config["local.epochs"]), batch_size=int(run_config["local.batch-size"]),
                             lr=float(run_config["local.lr"]))
    users = [(u, task.users[u]) for u in requested]  # moved to the device one at a time (or chunk by chunk)
    contribution, metrics, path = node_contribution(
        users, params=params, round_index=int(config["round"]), clip_norm=float(config["clip-norm"]), scale=scale,
        send_squares=bool(config["send-squares"]), model=model, layout=layout, training=training,
        seed=int(config["seed"]),
    )
    out = [contribution.total.detach().cpu().numpy().astype(np.float32)]
    if contribution.total_squares is not None:
        out.append(contribution.total_squares.detach().cpu().numpy().astype(np.float32))
    reply_metrics = MetricRecord({"count": contribution.count, "unclipped": contribution.unclipped,
                                  "vectorized": float(path == "vectorized"),
                                  **{k: float(v) for k, v in metrics.items() if np.isfinite(v)}})
    return Message(content=RecordDict({"update": ArrayRecord(out), "metrics": reply_metrics}), reply_to=msg)

