"""The ``w1`` section of ``fed-dp benchmark`` (described in ``benchmark.command``): W1 (docs/explanation/benchmarks.md) on every system —
Flower's own DP simulation, the project's Flower apps, the in-process engine and plain training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from fed_dp.accounting import epsilon, epsilon_schedule
from fed_dp.checkpoint import read_diagnostics
from fed_dp.clients.task import initial_model
from fed_dp.clients.training import resolve_device
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.benchmark.flower_baseline import BaselineConfig, W1Workload
from fed_dp.simulations.benchmark.measure import summarize, sync, table, timed, torch_threads
from fed_dp.simulations.engine import inprocess as engine
from fed_dp.simulations.tasks.builtin import w1_task


#: W1 systems that run in other processes (Ray, flwr): a few seconds of quiet follow each of them.
SUBPROCESS_SYSTEMS = ("flower-dp", "flower-dp-1cpu", "flower-dp-flwr-run", "fed-dp-flower")


@dataclass(frozen=True)
class W1Spec(W1Workload):
    """W1 (docs/explanation/benchmarks.md) with its privacy parameters; ``smoke()`` is a seconds-long version for tests."""

    delta: float = 1e-5
    accountant: str = "rdp"  # the per-round ε of the ServerApp's ledger: RDP costs ~0.1 s, PLD ~0.5 s

    @classmethod
    def smoke(cls) -> "W1Spec":
        return cls(users=12, cohort=4, rounds=2, examples=8, batch_size=4)

    def privacy(self, *, sampler: str = "poisson", cohort: int | None = None, users: int | None = None) -> PrivacyConfig:
        return PrivacyConfig(num_users=users or self.users, expected_cohort=cohort or self.cohort, rounds=self.rounds,
                             noise_multiplier=self.noise_multiplier, delta=self.delta, clip_norm=self.clip_norm,
                             sampler=sampler, accountant=self.accountant)

    def training(self) -> LocalTraining:
        return LocalTraining(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr)

    def baseline(self, out: Path, client_cpus: int) -> BaselineConfig:
        return BaselineConfig(**self.workload(), client_cpus=client_cpus, out=str(out))

    def run_config(self, checkpoint_dir: Path) -> dict[str, Any]:
        """The project's Flower run config for W1 (DP-FedAvg with η = 1 is FedAvg of the noisy mean)."""
        return {
            "task.ref": "w1", "task.users": self.users, "task.examples": self.examples,
            "privacy.expected-cohort": self.cohort, "privacy.rounds": self.rounds,
            "privacy.noise-multiplier": self.noise_multiplier, "privacy.clip-norm": self.clip_norm,
            "privacy.delta": self.delta, "privacy.accountant": self.accountant, "privacy.sampler": "poisson",
            "optimizer.name": "dp-fedavg", "optimizer.lr": 1.0,
            "local.epochs": self.epochs, "local.batch-size": self.batch_size, "local.lr": self.lr,
            "run.seed": self.seed, "run.eval-every": 0, "server.checkpoint-dir": str(checkpoint_dir),
            "client.device": "cpu",
        }


def accounting_seconds(privacy: PrivacyConfig) -> float:
    """Wall time of the ε schedule (every round 1..T) from cold (the memos are cleared first); leaves it warm."""
    epsilon.cache_clear()
    epsilon_schedule.cache_clear()
    seconds, _ = timed(lambda: epsilon_schedule(privacy))
    return seconds


def engine_run(task, privacy: PrivacyConfig, training: LocalTraining, *, seed: int, vectorized: bool | None,
               device: str = "cpu", chunk_size: int | None = None) -> dict[str, Any]:
    """One timed run of the in-process engine (DP-FedAvg, η = 1); ε is read from the warm memo."""
    epsilon_schedule(privacy)
    with simulation():
        optimizer = make_optimizer("dp-fedavg", lr=1.0)
    resolved = resolve_device(device)
    path = {None: "auto", True: "vectorized", False: "sequential"}[vectorized]
    sync(resolved)
    seconds, result = timed(lambda: engine.train(
        task, privacy, optimizer, training, seed=seed, eval_every=0, training=path, chunk_size=chunk_size,
        device=resolved))
    records = result.records
    sync(resolved)
    return {"seconds": seconds, "users": sum(int(r["nonprivate_cohort_size"]) for r in records),
            "path": "vectorized" if records and records[-1]["nonprivate_vectorized"] else "sequential",
            "round_seconds": [r["nonprivate_round_seconds"] for r in records], "epsilon": records[-1]["epsilon"]}


def plain_training_seconds(task, users_per_round: list[list[int]], training: LocalTraining, *,
                           device: str = "cpu", seed: int = 0, staged: bool = False) -> float:
    """Non-private, non-federated minibatch SGD of one model over the same examples as the rounds: for
    every round, the examples of its users, shuffled, in minibatches of ``training.batch_size`` (one
    model, no per-user copies, no clipping or noise). The channels-last layout, as the engine uses. Timed:
    gathering each round's examples onto the device in that layout (unless ``staged``: then they are
    gathered before the clock starts), and the SGD steps; one untimed warm-up step first."""
    device = resolve_device(device)
    model = initial_model(task, seed)[0].to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=training.lr)
    generator = torch.Generator().manual_seed(seed)
    first = task.users[users_per_round[0][0]] if users_per_round and users_per_round[0] else None
    if first is not None and len(first):  # warm-up step, untimed (kernel selection, allocator)
        x, y = first.fields
        x = x[: training.batch_size].to(device).contiguous(memory_format=torch.channels_last)
        F.cross_entropy(model(x), y[: training.batch_size].to(device)).backward()
        optimizer.zero_grad(set_to_none=True)
        sync(device)

    def gather(users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([task.users[u].fields[0] for u in users]).to(device).contiguous(memory_format=torch.channels_last)
        return x, torch.cat([task.users[u].fields[1] for u in users]).to(device)

    staged_rounds = [gather(users) for users in users_per_round] if staged else None

    def train() -> None:
        for index, users in enumerate(users_per_round):  # gathering is timed unless staged, as the engine's is
            x, y = staged_rounds[index] if staged_rounds is not None else gather(users)
            for _ in range(training.epochs):
                order = torch.randperm(len(y), generator=generator).to(device)
                for start in range(0, len(y), training.batch_size):
                    batch = order[start : start + training.batch_size]
                    optimizer.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x[batch]), y[batch]).backward()
                    optimizer.step()
        sync(device)

    seconds, _ = timed(train)
    return seconds


def engine_cohorts(privacy: PrivacyConfig, seed: int) -> list[list[int]]:
    """The users the engine's sampler draws in every round of ``privacy`` with ``seed`` (its derived seed)."""
    from fed_dp.randomness import derive_seed
    from fed_dp.sampling import make_sampler

    sampler = make_sampler(privacy, seed=derive_seed(seed, "sampler"))
    return [sampler.next_cohort().tolist() for _ in range(privacy.rounds)]


def flower_baseline_run(spec: W1Spec, client_cpus: int, folder: Path, timeout: float) -> dict[str, Any]:
    """One run of Flower's own DP simulation of W1 in a fresh Python process."""
    out = folder / f"flower-{client_cpus}cpu-{time.time_ns()}.json"
    config = spec.baseline(out, client_cpus)
    args = [sys.executable, "-m", "fed_dp.simulations.benchmark.flower_baseline"]
    for key, value in asdict(config).items():
        args += ["--" + key.replace("_", "-"), str(value)]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    log = folder / (out.stem + ".log")
    with open(log, "wb") as handle:
        done = subprocess.run(args, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"Flower's DP simulation failed (exit {done.returncode}); its log: {log}")
    result = json.loads(out.read_text())
    if result["trained_rounds"] != spec.rounds:
        raise RuntimeError(f"Flower's DP simulation trained {result['trained_rounds']} of {spec.rounds} rounds; log: {log}")
    return {"seconds": result["rounds_seconds"], "total_seconds": result["total_seconds"],
            "users": spec.cohort * spec.rounds}


def flower_baseline_flwr_run(spec: W1Spec, folder: Path, timeout: float) -> dict[str, Any]:
    """One run of Flower's own DP apps of W1 through ``flwr run`` (simulation engine, 1 CPU per ClientApp),
    launched as :func:`project_flower_run` launches the project's."""
    from fed_dp.simulations.launch import local_simulation
    from fed_dp.simulations.benchmark.flower_baseline import APP

    stamp = time.time_ns()
    out = folder / f"flower-flwr-run-{stamp}.json"
    run_config = {key.replace("_", "-"): value for key, value in asdict(spec.baseline(out, 1)).items()}
    total, log = timed(lambda: local_simulation.run(folder / f"flwr-home-{stamp}", run_config, supernodes=spec.users,
                                                     client_cpus=1, timeout=timeout, app=APP))
    result = json.loads(out.read_text()) if out.exists() else {}
    if result.get("trained_rounds") != spec.rounds:
        raise RuntimeError(f"Flower's DP apps under flwr run trained {result.get('trained_rounds', 0)} of "
                           f"{spec.rounds} rounds; log tail:\n" + "\n".join(log.splitlines()[-30:]))
    return {"seconds": result["rounds_seconds"], "total_seconds": total, "users": spec.cohort * spec.rounds}


def project_flower_run(spec: W1Spec, client_cpus: int, folder: Path, timeout: float) -> dict[str, Any]:
    """One run of the project's ServerApp/ClientApp through ``flwr run`` (simulation engine)."""
    from fed_dp.simulations.launch import local_simulation
    from fed_dp.server.app import SERVER_SEED_VARIABLE

    stamp = time.time_ns()
    checkpoint = folder / f"fed-dp-flower-{stamp}"
    # The ServerApp draws the engine's cohorts only from the seed in its own environment (run.seed reaches every
    # ClientApp, so it never seeds the sampler or the noise of a Flower run).
    seed = {SERVER_SEED_VARIABLE: str(spec.seed)}
    total, log = timed(lambda: local_simulation.run(folder / f"flwr-home-{stamp}", spec.run_config(checkpoint),
                                                     supernodes=spec.users, client_cpus=client_cpus, timeout=timeout,
                                                     environment=seed))
    results = checkpoint / "results.json"
    records = json.loads(results.read_text()) if results.exists() else []
    if len(records) != spec.rounds:
        raise RuntimeError(f"the project's Flower apps ran {len(records)} of {spec.rounds} rounds; log tail:\n"
                           + "\n".join(log.splitlines()[-30:]))
    return {"seconds": sum(r["round_seconds"] for r in read_diagnostics(checkpoint)), "total_seconds": total,
            "users": sum(int(r["replied_users"]) for r in read_diagnostics(checkpoint)),  # the operator's counts
            "epsilon": records[-1]["epsilon"]}


def bench_w1(spec: W1Spec, runs: int, folder: Path, *, flower: bool, timeout: float, smoke: bool = False,
             settle: float = 3.0, log=print) -> dict[str, Any]:
    """Every W1 system ``runs`` times (interleaved, so slow phases of a shared machine hit all of them)."""
    task = w1_task(users=spec.users, examples=spec.examples)
    privacy, training = spec.privacy(), spec.training()
    results: dict[str, list[dict[str, Any]]] = {}
    systems: dict[str, Callable[[], dict[str, Any]]] = {}
    if flower:
        systems["flower-dp"] = lambda: flower_baseline_run(spec, 2, folder, timeout)
        if not smoke:
            systems["flower-dp-1cpu"] = lambda: flower_baseline_run(spec, 1, folder, timeout)
        systems["flower-dp-flwr-run"] = lambda: flower_baseline_flwr_run(spec, folder, timeout)
        systems["fed-dp-flower"] = lambda: project_flower_run(spec, 1, folder, timeout)
    systems["engine"] = lambda: engine_run(task, privacy, training, seed=spec.seed, vectorized=None)
    systems["engine-1thread"] = lambda: _one_thread(
        lambda: engine_run(task, privacy, training, seed=spec.seed, vectorized=None))
    systems["engine-vectorized"] = lambda: engine_run(task, privacy, training, seed=spec.seed, vectorized=True)
    cohorts = engine_cohorts(privacy, spec.seed)
    systems["plain"] = lambda: {"seconds": plain_training_seconds(task, cohorts, training),
                                "users": sum(len(c) for c in cohorts)}
    accounting = accounting_seconds(privacy)
    log(f"W1: {task.description}; accounting (ε of rounds 1..{privacy.rounds}, {privacy.accountant}): {accounting:.2f} s")
    for run in range(runs):
        for name, system in systems.items():
            result = system()
            if name in SUBPROCESS_SYSTEMS:
                time.sleep(settle)  # let Ray's and flwr's processes finish exiting before the next system
            results.setdefault(name, []).append(result)
            log(f"  run {run + 1}/{runs} {name:>18}: {result['seconds']:7.2f} s  ({result['users']} users)")
    summary = {name: {**summarize([r["seconds"] for r in rs]), "users": rs[-1]["users"],
                      **({"total_seconds": summarize([r["total_seconds"] for r in rs])} if "total_seconds" in rs[-1] else {}),
                      **({"path": rs[-1]["path"]} if "path" in rs[-1] else {})}
               for name, rs in results.items()}
    reference = summary.get("flower-dp", {}).get("median")
    for name, entry in summary.items():
        entry["speedup_vs_flower_dp"] = reference / entry["median"] if reference else None
    engine_eps = results["engine"][-1]["epsilon"]
    return {"spec": asdict(spec), "accounting_seconds": accounting, "systems": summary, "epsilon": engine_eps,
            "flower_epsilon": results["fed-dp-flower"][-1]["epsilon"] if "fed-dp-flower" in results else None,
            "torch_threads": torch.get_num_threads()}


def _one_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    with torch_threads(1):
        return fn()


def format_w1(result: dict[str, Any]) -> str:
    rows = []
    for name, entry in result["systems"].items():
        speed = entry["speedup_vs_flower_dp"]
        total = entry.get("total_seconds", {}).get("median")
        rows.append([name, f"{entry['median']:.2f}", f"{entry['min']:.2f}–{entry['max']:.2f}",
                     "" if total is None else f"{total:.1f}", str(entry["users"]),
                     "" if speed is None else f"{speed:.1f}×"])
    header = ["W1 system", "median s", "min–max s", "total s", "users", "vs flower-dp"]
    return table(header, rows) + (f"\nuser-level ε after {result['spec']['rounds']} rounds: {result['epsilon']:.4f} "
                                   f"({result['spec']['accountant']}, δ = {result['spec']['delta']:g}); "
                                   f"accounting {result['accounting_seconds']:.2f} s once per configuration")
