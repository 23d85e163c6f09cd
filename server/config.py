"""The Flower run config → the same experiment the simulation runner parses (one parsing path).

Flower run configs are flat: ``[tool.flwr.app.config]`` tables flatten to dotted, hyphenated keys
(``privacy.noise-multiplier``), and values are scalars. They are unflattened into the runner's tables and
parsed once by ``simulations.runner.parse_experiment`` into the ``fed_dp`` dataclasses. Because a run
config cannot leave a key unset, a few keys use a sentinel:

    privacy.target-epsilon <= 0      no calibration: use privacy.noise-multiplier
    privacy.epsilon-budget <= 0      no ε budget
    privacy.max-participations <= 0  the default k of min-sep
    run.seed < 0                     sampler and noise seeded from OS entropy (real deployments)

The server-only keys live in ``[server]`` (``checkpoint-dir``, ``reply-timeout``, ``min-nodes``,
``node-wait``, ``evaluate``), the client-only ones in ``[client]`` (``device``).
"""

from __future__ import annotations

import copy
import inspect
import secrets
from dataclasses import dataclass
from typing import Any

from flwr.common.config import unflatten_dict

from fed_dp.simulations.runner import Experiment, parse_experiment
from fed_dp.simulations.tasks import TASKS

#: Defaults for every key, so that an app started without a run config (``run_simulation`` passes an
#: empty one) still has a complete configuration; pyproject.toml's [tool.flwr.app.config] repeats them.
DEFAULTS: dict[str, Any] = {
    "task.name": "heavy-tail",
    "task.groups": 3,
    "task.largest": 16,
    "task.users": 40,
    "task.partition": "iid",
    "task.seed": 0,
    "task.examples": 32,
    "task.root": "",
    "privacy.expected-cohort": 10,
    "privacy.rounds": 5,
    "privacy.noise-multiplier": 1.0,
    "privacy.target-epsilon": 0.0,
    "privacy.clip-norm": 1.0,
    "privacy.delta": 1e-4,
    "privacy.sampler": "poisson",
    "privacy.noise": "independent",
    "privacy.bands": 1,
    "privacy.max-participations": 0,
    "privacy.accountant": "rdp",
    "privacy.epsilon-budget": 0.0,
    "optimizer.name": "dp-adam",
    "optimizer.lr": 0.01,
    "local.epochs": 1,
    "local.batch-size": 1,
    "local.lr": 1.0,
    "adaptive.enabled": False,
    "adaptive.target-quantile": 0.5,
    "adaptive.learning-rate": 0.2,
    "adaptive.bit-noise-std": 0.0,
    "run.seed": -1,
    "server.checkpoint-dir": "",
    "server.reply-timeout": 120.0,
    "server.min-nodes": 1,
    "server.node-wait": 60.0,
    "server.evaluate": True,
    "client.device": "auto",
}


@dataclass(frozen=True)
class ServerSettings:
    checkpoint_dir: str
    reply_timeout: float
    min_nodes: int
    node_wait: float
    evaluate: bool


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from one run config."""

    experiment: Experiment
    optimizer_name: str
    seed: int
    seeded_explicitly: bool
    server: ServerSettings
    device: str
    raw: dict[str, Any]


def _drop_sentinels(tables: dict[str, Any]) -> dict[str, Any]:
    privacy = tables.setdefault("privacy", {})
    if privacy.get("target-epsilon", 0) <= 0:
        privacy.pop("target-epsilon", None)
    else:
        privacy.pop("noise-multiplier", None)
    for key in ("epsilon-budget", "max-participations"):
        if privacy.get(key, 0) <= 0:
            privacy.pop(key, None)
    return tables


def task_params(run_config: dict[str, Any], node_root: str = "") -> dict[str, Any]:
    """The [task] table for ``simulations.tasks.build_task``, holding only the keys the chosen task takes.

    The run config must list every key any task may use (Flower only overrides keys that exist), so a key
    the chosen task does not take is dropped when it still has its default, and is an error when it was
    set: it would otherwise be ignored silently. ``task.root`` (or a SuperNode's ``data-root``, which
    wins) is passed only to tasks that read local files.
    """
    merged = {**DEFAULTS, **run_config}
    table = {k: v for k, v in unflatten_dict(merged).get("task", {}).items()}
    name = table.pop("name")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    accepted = set(inspect.signature(TASKS[name]).parameters)
    root = node_root or table.pop("root", "")
    table.pop("root", None)
    params: dict[str, Any] = {"name": name}
    for key, value in table.items():
        field = key.replace("-", "_")
        if field in accepted:
            params[field] = value
        elif value != DEFAULTS.get(f"task.{key}"):
            raise ValueError(f"task.{key} = {value!r} does not apply to task {name!r} (it takes {sorted(accepted)})")
    if "root" in accepted:
        if not root:
            raise ValueError(f"task {name!r} reads local files: set task.root, or data-root in the SuperNode's --node-config")
        params["root"] = str(root)
    return params


def parse_app_config(run_config: dict[str, Any]) -> AppConfig:
    """Validate and parse a Flower run config (missing keys take DEFAULTS)."""
    merged = {**DEFAULTS, **run_config}
    unknown = sorted(k for k in merged if k.split(".")[0] not in ("task", "privacy", "optimizer", "local", "run", "server", "client", "adaptive"))
    if unknown:
        raise ValueError(f"unknown run-config key(s) {unknown}; see server/config.py and the README")
    tables = _drop_sentinels(copy.deepcopy(unflatten_dict(merged)))
    tables["task"].pop("root", None)  # the task's data folder is task_params' business
    optimizer = dict(tables.pop("optimizer"))
    name = optimizer.pop("name")
    server = tables.pop("server")
    client = tables.pop("client")
    seed = int(tables["run"].pop("seed"))
    seeded = seed >= 0
    tables["run"] = {"seed": seed if seeded else secrets.randbits(62), "optimizers": [name]}
    tables["optimizers"] = {name: optimizer}
    experiment = parse_experiment(tables, num_users=int(tables["task"]["users"]))
    return AppConfig(
        experiment=experiment,
        optimizer_name=name,
        seed=experiment.seed,
        seeded_explicitly=seeded,
        server=ServerSettings(
            checkpoint_dir=str(server["checkpoint-dir"]),
            reply_timeout=float(server["reply-timeout"]),
            min_nodes=int(server["min-nodes"]),
            node_wait=float(server["node-wait"]),
            evaluate=bool(server["evaluate"]),
        ),
        device=str(client["device"]),
        raw=merged,
    )
