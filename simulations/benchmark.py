"""``fed-dp benchmark``: the workloads of BENCHMARKS.md, measured side by side in one invocation.

    fed-dp benchmark [--runs 3] [--out DIR] [--only w1,scaling,noise,accounting,gpu,small-users,paths] [--smoke]

Sections (each prints a table; everything is also saved to ``DIR/benchmark.json`` with a figure
``DIR/benchmark.png``):

``w1``
    W1 (500 users × 32 CIFAR-shaped examples, W1 CNN, 10 rounds, expected cohort 50, 1 local epoch of
    batch 16 at lr 0.05, ζ = 1, σ = 1, FedAvg η = 1), ``--runs`` times each, on:

    - ``flower-dp``: Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` through
      ``run_simulation`` (``simulations.flower_baseline``), Flower's default 2 CPUs per ClientApp;
    - ``flower-dp-1cpu``: the same with 1 CPU per ClientApp (two workers on two cores);
    - ``flower-dp-flwr-run``: the same apps launched with ``flwr run`` (``simulations/flower_baseline_app``),
      one virtual SuperNode per user, 1 CPU per ClientApp: the project's Flower apps' launcher, so that
      ``fed-dp-flower`` against it compares the apps and against ``flower-dp`` the whole experience;
    - ``fed-dp-flower``: the project's ServerApp/ClientApp through ``flwr run`` (Flower's simulation
      engine), one virtual SuperNode per user, 1 CPU per ClientApp;
    - ``engine``: the in-process engine (auto path: one user at a time on the CPU, vectorized on CUDA),
      all torch threads; ``engine-1thread``: the same with one torch thread; ``engine-vectorized``: the
      ``torch.func`` path forced;
    - ``plain``: non-private, non-federated minibatch SGD over the same number of examples in the same
      minibatches (the local-training compute alone, the floor of every system above).

    Time = wall time of the 10 rounds (Flower: ``strategy.start``; the project's apps: the sum of the
    server's ``round_seconds`` in its secret diagnostics; the engine: its ``run`` call). The engine's rounds read ε from the
    memoized accounting (computed once per configuration, timed separately as ``accounting``); the
    project's ServerApp accounts inside its rounds. Medians, min–max and the ratio of medians to
    ``flower-dp`` are printed. Every system trains the same users (``synthetic.w1_user_data``) on the
    same model; Flower samples exactly 50 users per round, fed-dp's Poisson sampler 50 in expectation
    (the users trained are printed).
``scaling``
    The engine with cohorts of 50, 200 and 1,000 users per round (every user every round), against plain
    minibatch training over the same examples: the per-user overhead is (round − plain) / users.
``noise``
    Side by side at d = 10⁷: one step of independent noise, BandMF (b = 64) and BLT (2 … 5 buffers), each
    against drawing one N(0, I_d) vector (steps interleaved); the memory of each stream's state; the
    error each strategy optimizes at T = 2,000 (with min-separation 64, and with one participation); the
    time to read the BandMF ring once (its memory-bandwidth floor); cold strategy optimization times,
    up to T = 10,000 with b = 1,024.
``secure-noise``
    Drawing N(0, I_d), d = 10⁷, from the secure source (AES-256-CTR keyed from os.urandom) against
    ``torch.randn`` on the same device (the CPU, and the GPU when there is one): the throughput ratio.
``accounting``
    ε after 10,000 Poisson-sampled Gaussian rounds with PLD, the whole per-round ε schedule of those rounds
    (RDP and PLD), and calibrating σ for a target ε (PLD and RDP).
``deployment``
    A SuperLink and 10 SuperNodes on 127.0.0.1 as processes: the seconds of a round of Flower's floor (an echo
    app: one W1-sized array to every node and back) and of the project's apps with a trivial local step, without
    and with a node service beside each SuperNode, side by side (:func:`bench_deployment`).
``small-users``
    Many users with little data each, one torch thread (``simulations.benchmark_small_users``): seed 003's
    heavy-tail task with one example per user at G = 6, L = 256 and at the paper's G = 8, L = 1,024, the
    engine's rounds against a direct implementation of the same round (closed-form per-example gradients of
    the linear model), alternating, with the ratio of the medians and the peak memory; and a StackOverflow-
    shaped population of 342,477 lazily generated users, 1,000 per round: seconds per round, ms per user, peak
    memory. ``--small-users-rounds``, ``--small-users-paper-rounds`` (0 skips the paper's size) and
    ``--small-users-max-seconds`` size it.
``paths``
    Whether ``client.training = "auto"`` takes the fastest training path (``simulations.benchmark_paths``): small
    users of a linear model, the W1 CNN and a next-token model, with one and with several local steps, each run
    with auto, vectorized and sequential; the fastest round of each and auto over the fastest.
    ``--paths-rounds`` sizes it.
``gpu`` (only with CUDA)
    W1's data scaled to 10,000 users and 1,000 per round on ``cuda``, with W1's CNN and the seeds' CIFAR CNN:
    users/s of the engine's vectorized path against the hardware's practical limit for the same work (one
    model trained on the same examples in batches of a whole round's examples and of 1,024), the peak memory,
    and host-to-device copies and synchronizations per round from a profile (:func:`bench_gpu`).

Machines are shared and noisy: compare ratios measured in the same run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from fed_dp.clients.training import resolve_device
from fed_dp.config import LocalTraining
from fed_dp.accounting import calibrate_noise_multiplier, epsilon, epsilon_schedule
from fed_dp.checkpoint import read_diagnostics
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.noise import Privatizer
from fed_dp.randomness import SecureNormal
from fed_dp.optimizers import make_optimizer
from fed_dp.factorization import optimize_toeplitz
from fed_dp.simulations import engine, models
from fed_dp.clients.task import initial_model
from fed_dp.simulations.flower_baseline import BaselineConfig, W1Workload
from fed_dp.simulations.builtin_tasks import w1_task

SECTIONS = ("w1", "scaling", "noise", "secure-noise", "accounting", "gpu", "deployment", "small-users", "paths")
#: W1 systems that run in other processes (Ray, flwr): a few seconds of quiet follow each of them.
SUBPROCESS_SYSTEMS = ("flower-dp", "flower-dp-1cpu", "flower-dp-flwr-run", "fed-dp-flower")


@dataclass(frozen=True)
class W1Spec(W1Workload):
    """BENCHMARKS.md W1 with its privacy parameters; ``smoke()`` is a seconds-long version for tests."""

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


# --- statistics and printing ------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min, max and the count of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op torch threads (None: leave as is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- W1 systems -------------------------------------------------------------------------------------------


def accounting_seconds(privacy: PrivacyConfig) -> float:
    """Wall time of the ε schedule (every round 1..T) from cold (the memos are cleared first); leaves it warm."""
    epsilon.cache_clear()
    epsilon_schedule.cache_clear()
    seconds, _ = _timed(lambda: epsilon_schedule(privacy))
    return seconds


def engine_run(task, privacy: PrivacyConfig, training: LocalTraining, *, seed: int, vectorized: bool | None,
               device: str = "cpu", chunk_size: int | None = None) -> dict[str, Any]:
    """One timed run of the in-process engine (DP-FedAvg, η = 1); ε is read from the warm memo."""
    epsilon_schedule(privacy)
    with simulation():
        optimizer = make_optimizer("dp-fedavg", lr=1.0)
    resolved = resolve_device(device)
    path = {None: "auto", True: "vectorized", False: "sequential"}[vectorized]
    _sync(resolved)
    seconds, result = _timed(lambda: engine.train(
        task, privacy, optimizer, training, seed=seed, eval_every=0, training=path, chunk_size=chunk_size,
        device=resolved))
    records = result.records
    _sync(resolved)
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
        _sync(device)

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
        _sync(device)

    seconds, _ = _timed(train)
    return seconds


def _cohorts(privacy: PrivacyConfig, seed: int) -> list[list[int]]:
    """The users the engine's sampler draws in every round of ``privacy`` with ``seed`` (its derived seed)."""
    from fed_dp.randomness import derive_seed
    from fed_dp.sampling import make_sampler

    sampler = make_sampler(privacy, seed=derive_seed(seed, "sampler"))
    return [sampler.next_cohort().tolist() for _ in range(privacy.rounds)]


def flower_baseline_run(spec: W1Spec, client_cpus: int, folder: Path, timeout: float) -> dict[str, Any]:
    """One run of Flower's own DP simulation of W1 in a fresh Python process."""
    out = folder / f"flower-{client_cpus}cpu-{time.time_ns()}.json"
    config = spec.baseline(out, client_cpus)
    args = [sys.executable, "-m", "fed_dp.simulations.flower_baseline"]
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
    from fed_dp.server import local_simulation
    from fed_dp.simulations.flower_baseline import APP

    stamp = time.time_ns()
    out = folder / f"flower-flwr-run-{stamp}.json"
    run_config = {key.replace("_", "-"): value for key, value in asdict(spec.baseline(out, 1)).items()}
    total, log = _timed(lambda: local_simulation.run(folder / f"flwr-home-{stamp}", run_config, supernodes=spec.users,
                                                     client_cpus=1, timeout=timeout, app=APP))
    result = json.loads(out.read_text()) if out.exists() else {}
    if result.get("trained_rounds") != spec.rounds:
        raise RuntimeError(f"Flower's DP apps under flwr run trained {result.get('trained_rounds', 0)} of "
                           f"{spec.rounds} rounds; log tail:\n" + "\n".join(log.splitlines()[-30:]))
    return {"seconds": result["rounds_seconds"], "total_seconds": total, "users": spec.cohort * spec.rounds}


def project_flower_run(spec: W1Spec, client_cpus: int, folder: Path, timeout: float) -> dict[str, Any]:
    """One run of the project's ServerApp/ClientApp through ``flwr run`` (simulation engine)."""
    from fed_dp.server import local_simulation
    from fed_dp.server.app import SERVER_SEED_VARIABLE

    stamp = time.time_ns()
    checkpoint = folder / f"fed-dp-flower-{stamp}"
    # The ServerApp draws the engine's cohorts only from the seed in its own environment (run.seed reaches every
    # ClientApp, so it never seeds the sampler or the noise of a Flower run).
    seed = {SERVER_SEED_VARIABLE: str(spec.seed)}
    total, log = _timed(lambda: local_simulation.run(folder / f"flwr-home-{stamp}", spec.run_config(checkpoint),
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
    cohorts = _cohorts(privacy, spec.seed)
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
    return _table(header, rows) + (f"\nuser-level ε after {result['spec']['rounds']} rounds: {result['epsilon']:.4f} "
                                   f"({result['spec']['accountant']}, δ = {result['spec']['delta']:g}); "
                                   f"accounting {result['accounting_seconds']:.2f} s once per configuration")


# --- cohort scaling -----------------------------------------------------------------------------------------


def bench_scaling(spec: W1Spec, cohorts: tuple[int, ...], rounds: int, runs: int, log=print) -> dict[str, Any]:
    """Engine rounds with every user of a cohort-sized W1 task, against plain training on the same examples."""
    rows = []
    for cohort in cohorts:
        task = w1_task(users=cohort, examples=spec.examples)
        privacy = replace(spec, rounds=rounds).privacy(sampler="all", cohort=cohort, users=cohort)
        engine_seconds, plain_seconds = [], []
        for _ in range(runs):
            result = engine_run(task, privacy, spec.training(), seed=spec.seed, vectorized=None)
            engine_seconds.append(statistics.median(result["round_seconds"]))
            plain_seconds.append(plain_training_seconds(task, [list(range(cohort))], spec.training()))
        round_s, plain_s = statistics.median(engine_seconds), statistics.median(plain_seconds)
        rows.append({"cohort": cohort, "round_seconds": round_s, "plain_seconds": plain_s,
                     "per_user_ms": 1e3 * round_s / cohort, "overhead_ms_per_user": 1e3 * (round_s - plain_s) / cohort})
        log(f"  cohort {cohort}: round {round_s:.3f} s, plain {plain_s:.3f} s")
    return {"rounds": rounds, "runs": runs, "rows": rows}


def format_scaling(result: dict[str, Any]) -> str:
    rows = [[str(r["cohort"]), f"{r['round_seconds']:.3f}", f"{r['plain_seconds']:.3f}", f"{r['per_user_ms']:.2f}",
             f"{r['overhead_ms_per_user']:+.2f}"] for r in result["rows"]]
    return _table(["users/round", "round s", "plain s", "ms/user", "overhead ms/user"], rows)


# --- noise and accounting -----------------------------------------------------------------------------------


def _resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _noise_steps(privatizers: dict[str, Privatizer], dim: int, steps: int) -> dict[str, list[float]]:
    """``steps`` timed steps of every privatizer and of one N(0, I_d) draw, interleaved (a slow phase of a
    shared machine hits all of them), plus one read of the largest buffer (``buffer read``)."""
    generator = torch.Generator().manual_seed(1)
    largest = max((p.buffer for p in privatizers.values() if p.buffer is not None), key=torch.Tensor.numel, default=None)
    times: dict[str, list[float]] = {"gaussian": [], "buffer read": [], **{name: [] for name in privatizers}}
    for _ in range(steps):
        times["gaussian"].append(_timed(lambda: torch.randn(dim, generator=generator))[0])
        if largest is not None:
            times["buffer read"].append(_timed(largest.sum)[0])
        for name, privatizer in privatizers.items():
            times[name].append(_timed(privatizer.next_noise)[0])
    return times


def bench_noise(dim: int, bands: int, horizon: int, buffers: tuple[int, ...], steps: int, log=print) -> dict[str, Any]:
    """Independent, BandMF (b bands) and BLT (each ℓ in ``buffers``) noise steps at d = ``dim`` against one
    N(0, I_d) draw, side by side; their state's memory; and the error each strategy optimizes at T = horizon.

    Error: sens² · (1/T)·‖A C⁻¹‖_F² (prefix sums), the expected squared error per round of the noise on the
    running sums of updates at σ = 1, with sens the sensitivity of all the participations the separation
    allows: at min-separation b (⌈T/b⌉ participations, what BandMF with b bands is built for; the BLTs are
    optimized for it), and with one participation (BandMF's strategy unchanged, a BLT optimized for it).
    At equal sensitivity-scaled error the mechanisms have equal ε, so these compare noise at matched ε.
    Strategy optimizations are timed cold (a fresh cache folder), including T = 10,000 with b = 1,024.
    """
    from fed_dp.blt import blt_error, optimize_blt
    from fed_dp.factorization import banded_error, identity_strategy

    k = -(-horizon // bands)
    optimize: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        optimize[f"BandMF T = {horizon}, b = {bands}"], strategy = _timed(lambda: optimize_toeplitz(horizon, bands, cache_dir=cache))
        optimize[f"BandMF T = {horizon}, b = {bands}, from the cache"] = _timed(lambda: optimize_toeplitz(horizon, bands, cache_dir=cache))[0]
        blts, single = {}, {}
        for count in buffers:
            optimize[f"BLT T = {horizon}, {count} buffers"], blts[count] = _timed(
                lambda: optimize_blt(horizon, count, separation=bands, cache_dir=cache))
            single[count] = optimize_blt(horizon, count, separation=horizon, cache_dir=cache)
        large_t, large_b = (5 * horizon, 16 * bands)  # T = 10,000, b = 1,024 at full size
        optimize[f"BandMF T = {large_t:,}, b = {large_b:,}"] = _timed(lambda: optimize_toeplitz(large_t, large_b, cache_dir=cache))[0]
        optimize[f"BLT T = {large_t:,}, 4 buffers"] = _timed(lambda: optimize_blt(large_t, 4, separation=bands, cache_dir=cache))[0]
    for name, seconds in optimize.items():
        log(f"  strategy {name}: {seconds:.2f} s")

    identity = identity_strategy(horizon)
    rows = [{"name": "independent", "state_vectors": 0,
             "error_min_sep": banded_error(identity, separation=bands), "error_one": banded_error(identity, separation=horizon)},
            {"name": f"BandMF b = {bands}", "state_vectors": bands - 1,
             "error_min_sep": banded_error(strategy, separation=bands), "error_one": banded_error(strategy, separation=horizon)}]
    rows += [{"name": f"BLT {count} buffers", "state_vectors": count,
              "error_min_sep": blt_error(blts[count], separation=bands), "error_one": blt_error(single[count], separation=horizon)}
             for count in buffers]
    privatizers, growth = {}, {}
    for row, mechanism in zip(rows, [None, strategy] + [blts[count] for count in buffers]):
        before = _resident_bytes()
        privatizers[row["name"]] = privatizer = Privatizer(mechanism, noise_std=1.0, dim=dim, seed=0)
        for _ in range(min(bands, horizon - steps)):  # fill the buffers first: untouched zero pages would be cheap
            privatizer.next_noise()
        after = _resident_bytes()
        growth[row["name"]] = None if before is None or after is None else after - before
    times = _noise_steps(privatizers, dim, steps)
    gaussian = statistics.median(times["gaussian"])
    bandmf_error = rows[1]["error_min_sep"], rows[1]["error_one"]
    for row in rows:
        privatizer = privatizers[row["name"]]
        step = statistics.median(times[row["name"]])
        row.update(step_seconds=step, ratio=step / gaussian,
                   buffer_bytes=0 if privatizer.buffer is None else privatizer.buffer.numel() * privatizer.buffer.element_size(),
                   resident_growth_bytes=growth[row["name"]],
                   error_min_sep_vs_bandmf=row["error_min_sep"] / bandmf_error[0],
                   error_one_vs_bandmf=row["error_one"] / bandmf_error[1])
    return {"dim": dim, "bands": bands, "horizon": horizon, "participations": k, "steps": steps,
            "gaussian_seconds": gaussian, "buffer_read_seconds": statistics.median(times["buffer read"]),
            "mechanisms": rows, "optimize_seconds": optimize}


def format_noise(r: dict[str, Any]) -> str:
    d, b, T, k = r["dim"], r["bands"], r["horizon"], r["participations"]
    rows = [[row["name"], f"{1e3 * row['step_seconds']:.1f}", f"{row['ratio']:.2f}×",
             f"{row['state_vectors']}·d = {row['buffer_bytes'] / 2**30:.2f} GiB",
             "" if row["resident_growth_bytes"] is None else f"{row['resident_growth_bytes'] / 2**30:.2f} GiB",
             f"{row['error_min_sep']:.1f} ({row['error_min_sep_vs_bandmf']:.3f})",
             f"{row['error_one']:.2f} ({row['error_one_vs_bandmf']:.3f})"] for row in r["mechanisms"]]
    header = ["noise", "step ms", "vs draw", "state (float32)", "RSS growth", f"error, min-sep {b} (vs BandMF)",
              "error, 1 participation (vs BandMF)"]
    lines = [f"d = {d:.0e}, median of {r['steps']} interleaved steps; one N(0, I_d) draw: {1e3 * r['gaussian_seconds']:.1f} ms; "
             f"reading the (b − 1)×d ring once (BandMF's memory-bandwidth floor): {1e3 * r['buffer_read_seconds']:.1f} ms "
             f"({r['buffer_read_seconds'] / r['gaussian_seconds']:.2f}× the draw)",
             _table(header, rows),
             f"error = sens²·‖A C⁻¹‖²_F/T at T = {T:,} (prefix sums, σ = 1): with min-separation {b} every user can take "
             f"part {k} times (the BLTs are optimized for it); with one participation the BLT is optimized for that",
             "strategy optimization (cold): " + "; ".join(f"{name} {seconds:.2f} s" for name, seconds in r["optimize_seconds"].items())]
    return "\n".join(lines)


def bench_secure_noise(dim: int, steps: int, devices: list[str]) -> dict[str, Any]:
    """N(0, I_d) from the secure source (AES-256-CTR keyed from os.urandom, fed_dp.randomness) against
    ``torch.randn`` on the same device: medians of ``steps`` draws each, interleaved, and their ratio."""
    rows = []
    for device in devices:
        secure, generator = SecureNormal(device), torch.Generator(device=device).manual_seed(0)
        resolved = torch.device(device)
        secure.normal(dim, torch.float32), torch.randn(dim, generator=generator, device=device)  # warm-up
        secure_times, torch_times = [], []
        for _ in range(steps):
            _sync(resolved)
            secure_times.append(_timed(lambda: (secure.normal(dim, torch.float32), _sync(resolved)))[0])
            torch_times.append(_timed(lambda: (torch.randn(dim, generator=generator, device=device),
                                               _sync(resolved)))[0])
        s, t = statistics.median(secure_times), statistics.median(torch_times)
        rows.append({"device": device, "dim": dim, "secure_seconds": s, "torch_seconds": t,
                     "throughput_ratio": t / s, "steps": steps})
    return {"rows": rows}


def format_secure_noise(r: dict[str, Any]) -> str:
    return "\n".join(f"{row['device']}: d = {row['dim']:.0e}: secure {1e3 * row['secure_seconds']:.1f} ms, torch.randn "
                     f"{1e3 * row['torch_seconds']:.1f} ms: secure throughput {row['throughput_ratio']:.2f}× torch's"
                     for row in r["rows"])


def bench_accounting(rounds: int, target_epsilon: float) -> dict[str, Any]:
    """ε after ``rounds`` Poisson-sampled Gaussian rounds (PLD), the whole per-round schedule (RDP and PLD),
    and σ calibration (PLD and RDP), each from cold (memos cleared)."""
    config = PrivacyConfig(num_users=100_000, expected_cohort=1_000, rounds=rounds, noise_multiplier=1.0,
                           delta=1e-6, accountant="pld")
    out: dict[str, Any] = {"rounds": rounds, "q": config.sampling_rate, "delta": config.delta,
                           "target_epsilon": target_epsilon}

    def cold(fn: Callable[[], Any]) -> tuple[float, Any]:
        epsilon.cache_clear()
        epsilon_schedule.cache_clear()
        return _timed(fn)

    out["epsilon_seconds"], out["epsilon"] = cold(lambda: epsilon(config))
    for accountant in ("rdp", "pld"):
        which = config.replace(accountant=accountant)
        seconds, schedule = cold(lambda: epsilon_schedule(which))
        out[f"schedule_{accountant}_seconds"], out[f"schedule_{accountant}_exact_rounds"] = seconds, len(schedule.exact_rounds)
        out[f"schedule_{accountant}_last"] = schedule.epsilons[-1]
        out[f"calibrate_{accountant}_seconds"], out[f"calibrated_sigma_{accountant}"] = cold(
            lambda: calibrate_noise_multiplier(which, target_epsilon))
    return out


def format_accounting(r: dict[str, Any]) -> str:
    head = f"Poisson q = {r['q']:g}, σ = 1, δ = {r['delta']:g}, T = {r['rounds']:,} rounds"
    rows = [["ε after T rounds, PLD (one accountant)", f"{r['epsilon_seconds']:.2f}", f"ε = {r['epsilon']:.3f}"],
            ["per-round schedule, RDP (exact every round)", f"{r['schedule_rdp_seconds']:.2f}",
             f"ε(T) = {r['schedule_rdp_last']:.3f}"],
            ["per-round schedule, PLD", f"{r['schedule_pld_seconds']:.2f}",
             f"exact at {r['schedule_pld_exact_rounds']} rounds, ε(T) = {r['schedule_pld_last']:.3f}"],
            [f"calibrate σ for ε = {r['target_epsilon']:g}, PLD", f"{r['calibrate_pld_seconds']:.2f}",
             f"σ = {r['calibrated_sigma_pld']:.6f}"],
            [f"calibrate σ for ε = {r['target_epsilon']:g}, RDP", f"{r['calibrate_rdp_seconds']:.2f}",
             f"σ = {r['calibrated_sigma_rdp']:.6f}"]]
    return head + "\n" + _table(["accounting", "seconds", "result"], rows)


# --- GPU ------------------------------------------------------------------------------------------------------


#: The models of the ``gpu`` section: W1's CNN and the seeds' CIFAR CNN (411,466 parameters), on W1's data.
GPU_MODELS = {"w1-cnn": models.w1_cnn, "cifar-cnn": models.cifar_cnn}


def transfer_summary(events: Iterable[tuple[str, int]], rounds: int) -> dict[str, float]:
    """Host-to-device copies and stream/device synchronizations per round, from a CUDA profile's
    (event name, count) pairs (``torch.profiler`` names them ``Memcpy HtoD (...)``, ``cudaStreamSynchronize``,
    ``cudaDeviceSynchronize``)."""
    copies = sum(count for name, count in events if name.startswith("Memcpy HtoD"))
    syncs = sum(count for name, count in events if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    return {"h2d_copies_per_round": copies / rounds, "syncs_per_round": syncs / rounds}


def _profile_rounds(run: Callable[[], Any], rounds: int) -> dict[str, float]:
    """:func:`transfer_summary` of ``run`` (``rounds`` engine rounds) under the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    return transfer_summary(((e.key, e.count) for e in prof.key_averages()), rounds)


def bench_gpu(spec: W1Spec, users: int, cohort: int, rounds: int, device: str, log=print) -> dict[str, Any]:
    """W1's data at scale on ``device``, for each model of :data:`GPU_MODELS`: the engine's vectorized path
    against the hardware's practical limit for the same work, one model trained by SGD on the same examples
    (every round's examples of the sampled users, staged on the device), in batches of all of a round's examples
    and of 1,024 (``plain_training_seconds``). Users/s and the engine's ratio to each; on CUDA also the peak
    memory and, from a profile of the engine's rounds, host-to-device copies and synchronizations per round.

    Like for like: the engine's time is the sum of its rounds (its one-time move of every user's data to the
    device is reported apart); both sides are warmed up once first."""
    resolved = resolve_device(device)
    data = w1_task(users=users, examples=spec.examples)
    privacy = replace(spec, rounds=rounds).privacy(cohort=cohort, users=users)
    cohorts = _cohorts(privacy, spec.seed)
    epsilon_schedule(privacy)
    rows = []
    for name, build in GPU_MODELS.items():
        task = replace(data, model=build)
        engine = lambda: engine_run(task, privacy, spec.training(), seed=spec.seed, vectorized=True, device=device)  # noqa: E731
        engine_run(task, replace(privacy, rounds=1), spec.training(), seed=spec.seed, vectorized=True, device=device)
        if resolved.type == "cuda":
            torch.cuda.reset_peak_memory_stats(resolved)
        result = engine()
        seconds = sum(result["round_seconds"])
        row = {"model": name, "parameters": sum(p.numel() for p in build().parameters()),
               "engine_seconds": seconds, "engine_setup_seconds": result["seconds"] - seconds,
               "users_per_second": result["users"] / seconds,
               "peak_gib": torch.cuda.max_memory_allocated(resolved) / 2**30 if resolved.type == "cuda" else None}
        examples = max(1, max(len(c) for c in cohorts) * spec.examples)
        for label, batch in (("all", examples), ("1024", 1024)):
            training = replace(spec.training(), batch_size=batch)
            plain_training_seconds(task, cohorts[:1], training, device=device)  # warm-up
            limit = plain_training_seconds(task, cohorts, training, device=device, staged=True)
            row[f"limit_{label}_users_per_second"] = result["users"] / limit
            row[f"ratio_to_limit_{label}"] = row["users_per_second"] / row[f"limit_{label}_users_per_second"]
        row.update(_profile_rounds(engine, rounds) if resolved.type == "cuda" else
                   {"h2d_copies_per_round": None, "syncs_per_round": None})
        log(f"  {name}: engine {row['users_per_second']:.0f} users/s, limit {row['limit_all_users_per_second']:.0f} "
            f"(batch = a round's examples) and {row['limit_1024_users_per_second']:.0f} (batch 1,024) users/s")
        rows.append(row)
    return {"device": str(resolved), "users": users, "cohort": cohort, "rounds": rounds, "rows": rows,
            "name": torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else "cpu"}


def format_gpu(r: dict[str, Any]) -> str:
    def number(value: float | None, form: str) -> str:
        return "" if value is None else format(value, form)

    rows = [[row["model"], f"{row['parameters']:,}", f"{row['users_per_second']:.0f}",
             f"{row['limit_all_users_per_second']:.0f}", f"{row['ratio_to_limit_all']:.2f}×",
             f"{row['limit_1024_users_per_second']:.0f}", f"{row['ratio_to_limit_1024']:.2f}×",
             number(row["peak_gib"], ".2f"), number(row["h2d_copies_per_round"], ".0f"),
             number(row["syncs_per_round"], ".0f")] for row in r["rows"]]
    header = ["model", "parameters", "engine users/s", "limit (batch = round)", "engine/limit", "limit (batch 1,024)",
              "engine/limit", "peak GiB", "H2D copies/round", "syncs/round"]
    return (f"{r['name']}: W1's data, {r['users']:,} users, {r['cohort']:,} per round, {r['rounds']} rounds; the "
            "engine's vectorized path against one model trained on the same examples (the limit)\n" + _table(header, rows))


# --- deployment rounds ----------------------------------------------------------------------------------------


def bench_deployment(nodes: int, rounds: int, folder: Path, log=print) -> dict[str, Any]:
    """A deployment round's overhead on 127.0.0.1, ``rounds`` rounds of each system, ``nodes`` SuperNodes of 4
    users each (insecure: no TLS, which a real deployment needs), as processes:

    - Flower's floor (``simulations.flower_echo``: one W1-sized array to every node and back), then the project's
      apps, on one SuperLink and the same SuperNodes;
    - the project's apps again on a second SuperLink whose SuperNodes each have a node service beside them
      (``fed_dp.clients.node_service``: the task and model stay loaded across messages).

    The project's runs use the W1 task and model (the same array size as the echo) with every user sampled and
    one local step on one example (``privacy.sampler = "all"``, ``local.steps = 1``, ``local.max-examples = 1``).
    Medians of the rounds after the first (the first also installs the app bundle on every node)."""
    from fed_dp.server.local_deployment import deployment
    from fed_dp.simulations.flower_echo import APP

    def start(d, service: bool) -> None:
        d.start_superlink()
        started = [d.start_supernode({"users": f"{k * 4}-{k * 4 + 3}"}, service=service) for k in range(nodes)]
        d.wait_for_nodes(started, timeout=120)

    def fed_dp_rounds(d, checkpoint: Path) -> list[float]:
        outcome = d.run({"task.ref": "w1", "task.users": nodes * 4, "task.examples": 2, "privacy.sampler": "all",
                         "privacy.expected-cohort": nodes * 4, "privacy.rounds": rounds, "privacy.accountant": "rdp",
                         "local.steps": 1, "local.batch-size": 1, "local.max-examples": 1, "run.eval-every": 0,
                         "run.seed": 1, "server.checkpoint-dir": str(checkpoint), "server.min-nodes": nodes,
                         "client.device": "cpu"}, timeout=60 + 120 * rounds)
        if outcome.status != "finished:completed":
            raise RuntimeError(f"the project's apps did not complete ({outcome.status}):\n{d.diagnostics()}")
        return [r["round_seconds"] for r in read_diagnostics(checkpoint)]  # the operator's: it tracks the cohort

    with deployment(folder / "plain", None) as d:
        start(d, service=False)
        echo_out = folder / "echo.json"
        echo = d.finish(d.submit({"rounds": rounds, "out": str(echo_out)}, app=APP), timeout=60 + 120 * rounds)
        if echo.status != "finished:completed" or not echo_out.exists():
            raise RuntimeError(f"Flower's echo app did not complete ({echo.status}):\n{d.diagnostics()}")
        times = {"echo": json.loads(echo_out.read_text())["round_seconds"]}
        log(f"  flower echo:          rounds {', '.join(f'{x:.1f}' for x in times['echo'])} s")
        times["fed_dp"] = fed_dp_rounds(d, folder / "fed-dp")
        log(f"  fed-dp:               rounds {', '.join(f'{x:.1f}' for x in times['fed_dp'])} s")
    with deployment(folder / "service", None) as d:
        start(d, service=True)
        times["fed_dp_service"] = fed_dp_rounds(d, folder / "fed-dp-service")
        log(f"  fed-dp, node service: rounds {', '.join(f'{x:.1f}' for x in times['fed_dp_service'])} s")
    medians = {name: statistics.median(t[1:] or t) for name, t in times.items()}
    return {"nodes": nodes, "rounds": rounds, "cores": len(os.sched_getaffinity(0)),
            **{f"{name}_round_seconds": t for name, t in times.items()},
            **{f"{name}_median": m for name, m in medians.items()},
            "ratio_to_echo": medians["fed_dp"] / medians["echo"],
            "service_ratio_to_echo": medians["fed_dp_service"] / medians["echo"]}


def format_deployment(r: dict[str, Any]) -> str:
    rows = [["Flower's floor: echo of one W1-sized array", f"{r['echo_median']:.2f}", "1"],
            ["fed-dp's apps: W1, every user, one local step", f"{r['fed_dp_median']:.2f}", f"{r['ratio_to_echo']:.2f}×"],
            ["the same, a node service beside each SuperNode", f"{r['fed_dp_service_median']:.2f}",
             f"{r['service_ratio_to_echo']:.2f}×"]]
    met = min(r["fed_dp_median"], r["fed_dp_service_median"]) <= 1
    which = f"median of rounds 2..{r['rounds']}" if r["rounds"] > 1 else "one round"
    return (f"{r['nodes']} SuperNode(s) on 127.0.0.1, {r['cores']} cores, {which}; a target of "
            f"1 s per round {'is' if met else 'is not'} met\n"
            + _table(["system", "round s", "vs Flower's floor"], rows))


# --- figure and command -----------------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """W1 medians with min–max whiskers and the ratio to flower-dp; when measured, the cohort scaling."""
    if "w1" not in results and "scaling" not in results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("w1", "scaling") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "w1":
            systems = results["w1"]["systems"]
            names = list(systems)
            med = [systems[n]["median"] for n in names]
            err = [[m - systems[n]["min"] for n, m in zip(names, med)], [systems[n]["max"] - m for n, m in zip(names, med)]]
            ax.barh(names, med, xerr=err, capsize=3,
                    color=["tab:gray" if n.startswith("flower") else "tab:blue" for n in names])
            for i, name in enumerate(names):
                speed = systems[name]["speedup_vs_flower_dp"]
                relative = "" if not speed or name == "flower-dp" else (
                    f"  ({speed:.1f}× faster)" if speed >= 1 else f"  ({1 / speed:.1f}× slower)")
                label = f" {med[i]:.1f} s{relative}"
                ax.text(systems[name]["max"], i, label, va="center", fontsize=8)
            ax.set_xlim(0, 1.45 * max(systems[n]["max"] for n in names))
            ax.set_xlabel("wall time of the W1 rounds (s)")
            ax.invert_yaxis()
            ax.set_title(f"W1, median of {systems[names[0]]['runs']} runs (min–max)")
        else:
            rows = results["scaling"]["rows"]
            ax.plot([r["cohort"] for r in rows], [r["round_seconds"] for r in rows], "o-", label="engine round")
            ax.plot([r["cohort"] for r in rows], [r["plain_seconds"] for r in rows], "s--", label="plain training")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("users per round")
            ax.set_ylabel("seconds")
            ax.legend()
            ax.set_title("cohort scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="fed-dp benchmark")
    parser.add_argument("--runs", type=int, default=3, help="runs of every W1 system and scaling point (default 3)")
    parser.add_argument("--only", default=",".join(SECTIONS), metavar="A,B",
                        help=f"sections to run, from {','.join(SECTIONS)} (default: all; gpu only with CUDA)")
    parser.add_argument("--no-flower", action="store_true", help="skip the Flower systems of W1 (no Ray, no flwr run)")
    parser.add_argument("--out", metavar="DIR", help="where to save benchmark.json and benchmark.png "
                        "(default: results/benchmark-<time>)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one run: checks that every section works (seconds, not a measurement)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one Flower run (default 600)")
    from fed_dp.simulations.benchmark_small_users import add_arguments as small_users_arguments

    small_users_arguments(parser)
    parser.add_argument("--paths-rounds", type=int, default=4, metavar="R",
                        help="paths: rounds per workload and path, the first left out as warm-up (default 4)")
    return parser


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown benchmark section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if not (isinstance(args.runs, int) and args.runs >= 1):
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    runs = 1 if args.smoke else args.runs
    spec = W1Spec.smoke() if args.smoke else W1Spec()
    out = Path(args.out) if args.out else Path("results") / f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                           "torch_threads": torch.get_num_threads(),
                                           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
                               "smoke": bool(args.smoke)}
    printed: list[str] = []

    def section(title: str, text: str) -> None:
        block = f"\n== {title} ==\n{text}"
        printed.append(block)
        log(block)

    if "w1" in sections:
        log("measuring W1 ...")
        with tempfile.TemporaryDirectory(prefix="fed-dp-bench-") as folder:
            results["w1"] = bench_w1(spec, runs, Path(folder), flower=not args.no_flower, timeout=args.timeout,
                                     smoke=args.smoke, settle=0.0 if args.smoke else 3.0, log=log)
        section("W1", format_w1(results["w1"]))
    if "scaling" in sections:
        log("measuring cohort scaling ...")
        cohorts, rounds = ((4, 8), 2) if args.smoke else ((50, 200, 1000), 3)
        results["scaling"] = bench_scaling(spec, cohorts, rounds, runs, log=log)
        section("cohort scaling (engine, every user every round; median round)", format_scaling(results["scaling"]))
    if "noise" in sections:
        log("measuring noise ...")
        dim, bands, horizon, buffers = (10_000, 8, 64, (2, 3)) if args.smoke else (10**7, 64, 2000, (2, 3, 4, 5))
        results["noise"] = bench_noise(dim, bands, horizon, buffers, steps=3 if args.smoke else 10, log=log)
        section("noise", format_noise(results["noise"]))
    if "secure-noise" in sections:
        log("measuring secure noise ...")
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        results["secure-noise"] = bench_secure_noise(10_000 if args.smoke else 10**7, 3 if args.smoke else 10, devices)
        section("secure noise (AES-CTR) vs torch.randn", format_secure_noise(results["secure-noise"]))
    if "accounting" in sections:
        log("measuring accounting ...")
        results["accounting"] = bench_accounting(100, 1.0) if args.smoke else bench_accounting(10_000, 8.0)
        section("accounting", format_accounting(results["accounting"]))
    if "gpu" in sections:
        if torch.cuda.is_available():
            log("measuring on the GPU ...")
            users, cohort, rounds = (64, 16, 2) if args.smoke else (10_000, 1_000, 5)
            results["gpu"] = bench_gpu(spec, users, cohort, rounds, "cuda", log=log)
            section("GPU: the engine against the hardware's limit", format_gpu(results["gpu"]))
        else:
            results["gpu"] = None
            section("GPU", "no CUDA device on this machine: skipped")
    if "deployment" in sections:
        log("measuring deployment rounds ...")
        nodes, rounds = (1, 1) if args.smoke else (10, 6)
        with tempfile.TemporaryDirectory(prefix="fed-dp-deployment-") as folder:
            results["deployment"] = bench_deployment(nodes, rounds, Path(folder), log=log)
        section("deployment rounds", format_deployment(results["deployment"]))
    if "small-users" in sections:
        from fed_dp.simulations import benchmark_small_users

        log("measuring many small users ...")
        results["small-users"] = benchmark_small_users.run_section(args, log=log)
        section("many small users: the engine against a direct implementation of the same round",
                benchmark_small_users.format_small_users(results["small-users"]))
    if "paths" in sections:
        from fed_dp.simulations import benchmark_paths

        log("measuring the training paths ...")
        results["paths"] = benchmark_paths.bench_paths(benchmark_paths.workloads(smoke=bool(args.smoke)),
                                                       rounds=2 if args.smoke else args.paths_rounds, log=log)
        section("training paths: the automatic choice against each path (CPU, one torch thread)",
                benchmark_paths.format_paths(results["paths"]))
    (out / "benchmark.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "benchmark.txt").write_text("\n".join(printed) + "\n")
    figure = plot(results, out / "benchmark.png")
    log(f"\nresults: {out / 'benchmark.json'}, {out / 'benchmark.txt'}" + (f", {figure}" if figure else ""))
    return results


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
