"""Flower's own DP simulation of W1: the baseline ``fed-dp benchmark`` measures the project against.

W1 (docs/explanation/benchmarks.md) written the way a Flower user writes it with Flower's DP wrapper, nothing of fed-dp in
the round: a ServerApp running ``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` (the server clips
every client's model update to ζ, FedAvg averages them with equal weights, Gaussian noise of std
σ·ζ/B is added to the average) and a ClientApp that trains its one user with ``torch.optim.SGD``.
One virtual SuperNode per user; FedAvg samples ``cohort`` of them per round (fraction = cohort/users).
Run by ``flwr.simulation.run_simulation`` (Ray backend), one torch thread per worker, ``client_cpus`` Ray
CPUs per ClientApp: Flower's default 2 (one worker at a time on a 2-core machine) or 1 (one per core).

Only the data (``simulations.tasks.synthetic.w1_user_data``) and the model (``simulations.tasks.models.w1_cnn``)
are shared with the project, so both sides train the same users on the same network.

    python -m fed_dp.simulations.benchmark.flower_baseline --out result.json [--users 500 --cohort 50 --rounds 10]

writes ``{"rounds_seconds": wall time of the rounds (strategy.start), "total_seconds": ..., ...}``.
``run_simulation`` gives the apps an empty run config, so the settings reach them (the ServerApp in
this process, ClientApps in Ray workers) through the environment variable ``FED_DP_FLOWER_BASELINE``.

The same two apps also run under ``flwr run`` (``simulations/benchmark/flower_baseline_app``, whose run config holds
the W1 fields, e.g. ``batch-size``), so the benchmark can launch Flower's DP wrapper exactly as it launches the
project's apps and tell the launcher's cost from the apps'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ENV = "FED_DP_FLOWER_BASELINE"
#: ``server_app`` and ``client_app`` are built on first access (module ``__getattr__``: importing flwr is slow and
#: only the runs need it); listed here so that ``flwr run`` finds them.
__all__ = ["APP", "BaselineConfig", "W1Workload", "client_app", "main", "run", "server_app"]


@dataclass(frozen=True)
class W1Workload:
    """W1 (docs/explanation/benchmarks.md): users × examples CIFAR-shaped examples, ``rounds`` rounds of ``cohort`` users, each
    ``epochs`` local epochs of SGD in minibatches of ``batch_size`` at ``lr``; clip ζ, noise σ."""

    users: int = 500
    cohort: int = 50
    rounds: int = 10
    examples: int = 32
    batch_size: int = 16
    epochs: int = 1
    lr: float = 0.05
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (1 <= self.cohort <= self.users):
            raise ValueError(f"cohort must be in [1, users = {self.users}], got {self.cohort}")
        if self.rounds < 1 or self.examples < 1 or self.batch_size < 1 or self.epochs < 1:
            raise ValueError("rounds, examples, batch size and epochs must be >= 1")

    def workload(self) -> dict[str, Any]:
        """The W1 fields alone (what every system of the benchmark is given)."""
        return {f.name: getattr(self, f.name) for f in fields(W1Workload)}


@dataclass(frozen=True)
class BaselineConfig(W1Workload):
    """W1 plus how Flower runs it: Ray CPUs per ClientApp and where to write the result."""

    client_cpus: int = 2  # Flower's default: 2, one worker at a time on 2 cores
    out: str = ""


#: The Flower app folder that runs these apps with ``flwr run``.
APP = Path(__file__).resolve().parent / "flower_baseline_app"


def _config(run_config: dict[str, Any]) -> BaselineConfig:
    """The settings: the run config's (``flwr run``, keys as ``batch-size``), else ``FED_DP_FLOWER_BASELINE``."""
    if run_config:
        return BaselineConfig(**{key.replace("-", "_"): value for key, value in run_config.items()})
    return BaselineConfig(**json.loads(os.environ.get(ENV, "{}")))


def __getattr__(name: str) -> Any:
    """``server_app`` and ``client_app``, built on first use (the components ``flwr run`` loads)."""
    if name in ("server_app", "client_app"):
        server_app, client_app = _apps()
        globals().update(server_app=server_app, client_app=client_app)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _apps():
    """The ServerApp and ClientApp (built lazily: importing flwr is slow and only the runs need it)."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from torch.nn import functional as F

    from fed_dp.simulations.tasks.models import w1_cnn
    from fed_dp.simulations.tasks.synthetic import w1_user_data

    server_app, client_app = ServerApp(), ClientApp()

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        config = _config(context.run_config)
        torch.manual_seed(config.seed)
        model = w1_cnn()
        strategy = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_train=config.cohort / config.users, fraction_evaluate=0.0,
                   min_train_nodes=config.cohort, min_available_nodes=config.users),
            noise_multiplier=config.noise_multiplier, clipping_norm=config.clip_norm,
            num_sampled_clients=config.cohort,
        )
        start = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=config.rounds)
        seconds = time.perf_counter() - start
        if config.out:
            Path(config.out).write_text(json.dumps({
                "rounds_seconds": seconds, "rounds": config.rounds,
                "trained_rounds": len(result.train_metrics_clientapp),
            }))

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        config = _config(context.run_config)
        torch.set_num_threads(1)
        user = int(context.node_config["partition-id"])
        x, y = w1_user_data(user, config.examples)
        model = w1_cnn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        for _ in range(config.epochs):
            order = torch.randperm(len(y))
            for start in range(0, len(y), config.batch_size):
                batch = order[start : start + config.batch_size]
                optimizer.zero_grad()
                F.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                           "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)

    return server_app, client_app


def run(config: BaselineConfig) -> None:
    """One Flower DP simulation of ``config`` in this process (Ray starts and stops with it)."""
    from flwr.simulation import run_simulation

    os.environ[ENV] = json.dumps(asdict(config))  # Ray workers inherit the environment
    server_app, client_app = _apps()
    run_simulation(
        server_app=server_app, client_app=client_app, num_supernodes=config.users,
        backend_config={"client_resources": {"num_cpus": config.client_cpus, "num_gpus": 0.0},
                        "init_args": {"include_dashboard": False}},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fed_dp.simulations.benchmark.flower_baseline", description=__doc__.split("\n\n")[0])
    defaults = BaselineConfig()
    for field, value in asdict(defaults).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    config = BaselineConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    start = time.perf_counter()
    run(config)
    if config.out:
        path = Path(config.out)
        if not path.exists():
            print(f"the Flower baseline did not finish its rounds (no {path}); see the log above", file=sys.stderr)
            return 1
        result = json.loads(path.read_text())
        result["total_seconds"] = time.perf_counter() - start
        path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
