"""``fed-dp benchmark --only small-users``: many users with little data each, where user-level DP lives (issue 24).

Three workloads, one torch thread, on the CPU (``--small-users-device cuda``: the engine and the direct
implementation on the GPU, one CPU thread driving it):

``A`` seed 003 §3 heavy-tail, G = 6, L = 256
    1,536 users of one example each (``tasks.builtin.heavy_tail_task`` with users = n), a linear softmax model
    of 1,792 × 63 (112,896 weights), every user every round (sampler ``all``, B = N), one local SGD step at
    lr 1 over the user's examples (``LocalTraining(steps=1, batch_size=64)``), ζ = 1, independent Gaussian
    noise with σ = 10, DP-AdamBC on the server (lr 0.003, γ = Φ̂).
``B`` the paper's size, G = 8, L = 1,024
    The same round with 8,192 users, d = 9,216, c = 255 (2,350,080 weights), plus the peak resident memory.
    A round takes seconds on the one-step path, minutes sequentially: ``--small-users-paper-rounds`` sets its
    rounds (default 1; 0 skips it) and ``--small-users-max-seconds`` caps every workload's wall time.
``C`` a StackOverflow-shaped population
    342,477 users generated when sampled (``tasks.builtin.stackoverflow_like_task``: 1–64 sequences of 20
    tokens, Zipf-distributed counts and tokens, V = 10,000), ``models.bigram_lm`` (Embedding, LayerNorm,
    Linear: 130,012 weights), ``losses.next_token``, Poisson sampling of 1,000 users per round, the same local
    step, clip, noise and optimizer. Reported: seconds per round, milliseconds per user, peak memory.

What is timed. The engine: whole ``fed_dp.train`` runs (``simulations.engine.inprocess``, ``training="auto"``: the path
``fed_dp.clients.training_paths.contribution`` chooses, ``clients.one_step`` for these one-step users; or the path
``--small-users-training`` forces, to compare the paths on the same workloads), and of
each round its record's ``nonprivate_round_seconds``: from ``begin_round`` (budget check, sampling) through
``LocalTrainer.contribution`` (loading, local step, clipping and summing of every user) to ``finish_round``
(validation, noise, DP-AdamBC, the ledger) — everything a round costs. Not timed: building the task, the
trainer and θ₀, and the ε schedule, which is computed before the run (as in the other sections; the ledger
reads it from the memo). The direct implementation (:class:`DirectLinearRound`, workloads A and B): the same
round written for the linear model alone — closed-form per-example gradients, no per-user model — timed by
itself. The two alternate: the engine's ``on_round`` runs one direct round after every engine round (engine
round, direct round, engine round, ...), so both see the same machine load. Medians of the rounds are
compared (with one round, as for B by default, that first round).

On CUDA (``--small-users-device cuda``) the engine's rounds are timed from one ``on_round`` to the next with the
device synchronized (the record's ``nonprivate_round_seconds`` would stop the clock before queued GPU work ends;
the first round also pays for building the trainer and warming the GPU up, which the median leaves out), the
direct round synchronizes before it stops its clock, and the GPU's peak allocation
(``torch.cuda.max_memory_allocated``, reset after every direct round) is reported beside the resident peak.

Peak memory: the process's peak resident set (``VmHWM`` of ``/proc/self/status``) during each engine round,
reset (``/proc/self/clear_refs``) before the run and after each direct round, so it is the engine's peak with
everything the process already holds (the task's data and the direct implementation's copy of the inputs,
reported beside it as the resident set before the run). The workloads run in the order A, C, B, the largest
last: memory a workload frees stays with the process and would be counted in the next one's. Where the reset
is not possible the peak is the process's lifetime peak (``ru_maxrss``), and the result says so.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fed_dp.accounting import epsilon_schedule
from fed_dp.clients.task import Task
from fed_dp.clipping import clip_factor
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import Adam, make_optimizer
from fed_dp.simulations.engine import inprocess as engine
from fed_dp.simulations.benchmark.arguments import DEVICES, TRAINING
from fed_dp.simulations.benchmark.measure import summarize, sync, table, timed, torch_threads
from fed_dp.simulations.tasks.builtin import STACKOVERFLOW_USERS, heavy_tail_task, stackoverflow_like_task
from fed_dp.validation import check_int, check_positive

__all__ = ["AdamBCState", "DirectLinearRound", "HeavyTailWorkload", "PopulationWorkload",
           "adambc_update", "bench_small_users", "format_small_users", "linear_softmax_clipped_sum", "workloads"]


# --- workloads ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Round:
    """What every workload shares: one local step at ``local_lr`` over all of a user's examples (at most
    ``batch_size``), clip ζ, independent noise σ, DP-AdamBC at ``server_lr``, ``rounds`` rounds."""

    rounds: int = 5
    noise_multiplier: float = 10.0
    clip_norm: float = 1.0
    local_lr: float = 1.0
    batch_size: int = 64
    server_lr: float = 0.003
    delta: float = 1e-5
    seed: int = 0
    training: str = "auto"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.training not in TRAINING:
            raise ValueError(f"training must be one of {', '.join(TRAINING)}, got {self.training!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        check_int("rounds", self.rounds, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("seed", self.seed, minimum=0)
        for name in ("noise_multiplier", "clip_norm", "local_lr", "server_lr", "delta"):
            check_positive(name, getattr(self, name))

    def local(self) -> LocalTraining:
        return LocalTraining(steps=1, batch_size=self.batch_size, lr=self.local_lr)

    def optimizer(self) -> Adam:
        return make_optimizer("dp-adambc", lr=self.server_lr)


@dataclass(frozen=True)
class HeavyTailWorkload(_Round):
    """Seed 003 §3 with one example per user, every user every round (workloads A and B)."""

    name: str = "A"
    groups: int = 6
    largest: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("groups", self.groups, minimum=1)
        check_int("largest", self.largest, minimum=1)

    @property
    def users(self) -> int:
        return self.groups * self.largest

    def task(self) -> Task:
        return heavy_tail_task(groups=self.groups, largest=self.largest, users=self.users, seed=self.seed)

    def privacy(self) -> PrivacyConfig:
        return PrivacyConfig(num_users=self.users, expected_cohort=self.users, rounds=self.rounds, sampler="all",
                             noise_multiplier=self.noise_multiplier, clip_norm=self.clip_norm, delta=self.delta,
                             accountant="rdp")

    def label(self) -> str:
        return f"{self.name}: heavy-tail G = {self.groups}, L = {self.largest}, one example per user, full batch"


@dataclass(frozen=True)
class PopulationWorkload(_Round):
    """The StackOverflow-shaped population, Poisson-sampled (workload C)."""

    name: str = "C"
    rounds: int = 3
    users: int = STACKOVERFLOW_USERS
    cohort: int = 1000
    delta: float = 1e-7  # below 1/N = 2.9·10⁻⁶ (a δ ≥ 1/N protects nobody and is refused)
    vocabulary: int = 10_000
    embedding: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("users", self.users, minimum=1)
        check_int("cohort", self.cohort, minimum=1)
        check_int("vocabulary", self.vocabulary, minimum=2)
        check_int("embedding", self.embedding, minimum=1)
        if self.cohort > self.users:
            raise ValueError(f"cohort ({self.cohort}) must be at most users ({self.users})")

    def task(self) -> Task:
        return stackoverflow_like_task(users=self.users, vocabulary=self.vocabulary, embedding=self.embedding,
                                       max_sequences=self.batch_size, seed=self.seed)

    def privacy(self) -> PrivacyConfig:
        return PrivacyConfig(num_users=self.users, expected_cohort=self.cohort, rounds=self.rounds, sampler="poisson",
                             noise_multiplier=self.noise_multiplier, clip_norm=self.clip_norm, delta=self.delta,
                             accountant="rdp")

    def label(self) -> str:
        return (f"{self.name}: StackOverflow-shaped, {self.users:,} lazy users, 1–{self.batch_size} sequences, "
                f"V = {self.vocabulary:,}, Poisson B = {self.cohort:,}")


def workloads(*, smoke: bool, rounds: int, paper_rounds: int, training: str = "auto",
              device: str = "cpu") -> list[HeavyTailWorkload | PopulationWorkload]:
    """The section's workloads in the order they run: A, C, then B (unless ``paper_rounds`` is 0), the largest
    last, since the memory a workload frees stays with this process (``clients.training.keep_freed_memory``)
    and would be counted in the next one's peak; tiny ones with ``smoke``. ``training``: the engine's path;
    ``device``: where the engine and the direct implementation run."""
    check_int("rounds", rounds, minimum=1)
    check_int("paper_rounds", paper_rounds, minimum=0)
    same = {"training": training, "device": device}
    if smoke:
        a = HeavyTailWorkload(name="A", groups=3, largest=8, rounds=2, **same)
        c = PopulationWorkload(cohort=8, vocabulary=100, rounds=1, **same)
        b = HeavyTailWorkload(name="B", groups=4, largest=16, rounds=1, **same)
    else:
        a = HeavyTailWorkload(name="A", groups=6, largest=256, rounds=rounds, **same)
        c = PopulationWorkload(rounds=rounds, **same)
        b = HeavyTailWorkload(name="B", groups=8, largest=1024, rounds=max(1, paper_rounds), **same)
    return [a, c] + ([b] if paper_rounds else [])


# --- the direct implementation of the round -----------------------------------------------------------------


def linear_softmax_clipped_sum(weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *, clip_norm: float,
                               local_lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Σᵢ uᵢ of one-example users of a linear softmax model W (c × d), in closed form; returns (Σu as a flat
    c·d vector, the update norms ‖Δᵢ‖).

    The loss −log softmax(W xᵢ)_{yᵢ} has the gradient gᵢ = rᵢ xᵢᵀ with rᵢ = softmax(W xᵢ) − onehot(yᵢ) (seed 003
    §3's model), so one local SGD step at lr η gives Δᵢ = −η rᵢ xᵢᵀ, of norm ‖Δᵢ‖ = η‖rᵢ‖·‖xᵢ‖ (a rank-one
    matrix), and the clipped sum is one matrix product:

        uᵢ = Δᵢ · min(1, ζ/‖Δᵢ‖),   Σᵢ uᵢ = −(a ⊙ R)ᵀ X  with aᵢ = η·min(1, ζ/‖Δᵢ‖)

    (Goodfellow 2015's per-example norms of a linear layer). No per-user gradient is ever formed."""
    residual = torch.softmax(x @ weight.T, dim=1)
    residual[torch.arange(len(y)), y] -= 1.0
    norms = local_lr * torch.linalg.vector_norm(residual, dim=1) * torch.linalg.vector_norm(x, dim=1)
    factors = (local_lr * clip_factor(norms, clip_norm)).to(x.dtype)
    return -(residual * factors.unsqueeze(1)).T.matmul(x).reshape(-1), norms


@dataclass(frozen=True)
class AdamBCState:
    """DP-AdamBC's state after t steps: the moments m, ν and the noise-variance average b (a number: the
    independent noise's Φ is the same in every coordinate)."""

    step: int
    m: torch.Tensor
    nu: torch.Tensor
    b: float

    @classmethod
    def zeros(cls, dim: int, device: torch.device | str = "cpu") -> "AdamBCState":
        return cls(0, torch.zeros(dim, device=device), torch.zeros(dim, device=device), 0.0)


def adambc_update(state: AdamBCState, grad: torch.Tensor, phi: float, *, lr: float, beta1: float,
                  beta2: float) -> tuple[torch.Tensor, AdamBCState]:
    """One DP-AdamBC step (seed 001 Eq. 3 / Alg. 1, with the floor γ = Φ̂ of ``fed_dp.optimizers.Adam``):

        m = β₁m + (1−β₁)g̃,  ν = β₂ν + (1−β₂)g̃²,  b = β₂b + (1−β₂)Φ,  m̂, ν̂, Φ̂ = m, ν, b over (1 − βᵗ)
        step = −η · m̂ / sqrt(max(ν̂ − Φ̂, Φ̂))

    Φ = (σζ/B)², the variance of the independent noise of g̃ in every coordinate."""
    t = state.step + 1
    m = beta1 * state.m + (1 - beta1) * grad
    nu = beta2 * state.nu + (1 - beta2) * grad.square()
    b = beta2 * state.b + (1 - beta2) * phi
    phi_hat = b / (1 - beta2**t)
    denominator = torch.sqrt(torch.clamp(nu / (1 - beta2**t) - phi_hat, min=phi_hat))
    return -lr * (m / (1 - beta1**t)) / denominator, AdamBCState(t, m, nu, b)


class DirectLinearRound:
    """The private round of workloads A and B written directly (the benchmark's reference):

        Σu = :func:`linear_softmax_clipped_sum` (θ; every user's one example),  w ~ N(0, (σζ)² I) (its own
        ``torch.Generator``),  g̃ = −(Σu + w)/B,  θ ← θ + :func:`adambc_update` (g̃, Φ = (σζ/B)²)

    Every user every round (sampler ``all``), as the engine's round with the same configuration. ``x``
    (n × d) and ``y`` (n) are the users' examples stacked once, before any round is timed, and moved to the
    workload's device with the model, the moments and the noise generator."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int, workload: HeavyTailWorkload) -> None:
        if x.ndim != 2 or y.shape != (x.shape[0],):
            raise ValueError(f"x must be (n, d) and y (n,), got {tuple(x.shape)} and {tuple(y.shape)}")
        self.device = torch.device(workload.device)
        self.x, self.y, self.workload = x.to(self.device), y.to(self.device), workload
        self.shape = (num_classes, x.shape[1])
        # the linear softmax model's zero initialization
        self.params = torch.zeros(num_classes * x.shape[1], device=self.device)
        self.state = AdamBCState.zeros(self.params.numel(), self.device)
        self.optimizer = workload.optimizer()
        self.generator = torch.Generator(device=self.device).manual_seed(workload.seed)

    @classmethod
    def of_task(cls, task: Task, workload: HeavyTailWorkload) -> "DirectLinearRound":
        """The users of ``task`` (one example each), stacked in user order."""
        examples = [task.users[u].fields for u in range(task.num_users)]
        x = torch.cat([fields[0] for fields in examples]).flatten(1)
        y = torch.cat([fields[1] for fields in examples])
        return cls(x, y, int(task.class_groups.numel()), workload)

    def step(self) -> float:
        """One round; returns its seconds."""
        w = self.workload
        started = time.perf_counter()
        total, _ = linear_softmax_clipped_sum(self.params.view(self.shape), self.x, self.y, clip_norm=w.clip_norm,
                                              local_lr=w.local_lr)
        std = w.noise_multiplier * w.clip_norm
        noise = torch.randn(total.numel(), generator=self.generator, device=self.device)
        noisy = (total + std * noise) / len(self.y)
        step, self.state = adambc_update(self.state, -noisy, (std / len(self.y)) ** 2, lr=self.optimizer.lr,
                                         beta1=self.optimizer.beta1, beta2=self.optimizer.beta2)
        self.params = self.params + step
        sync(self.device)
        return time.perf_counter() - started


# --- memory ---------------------------------------------------------------------------------------------------


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_peak_resident() -> bool:
    """Reset the process's peak resident set (Linux: ``5`` into ``/proc/self/clear_refs``); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """The peak resident set since the last reset (``VmHWM``), else since the start (``ru_maxrss``)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- measurement ----------------------------------------------------------------------------------------------


class _OutOfTime(Exception):
    """Raised from ``on_round`` to end a run at its wall-time cap."""


@dataclass
class _Run:
    records: list[dict[str, Any]] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    gpu_peaks: list[int] = field(default_factory=list)
    gpu_seconds: list[float] = field(default_factory=list)


def _engine_rounds(task: Task, workload: HeavyTailWorkload | PopulationWorkload, *,
                   between: Callable[[], float] | None, max_seconds: float | None) -> tuple[_Run, bool, int]:
    """A ``fed_dp.train`` run of ``workload``, ``between()`` after every round; stops after the round that
    passes ``max_seconds`` of wall time. Returns the rounds, whether the peaks were reset per round, and the
    resident bytes before the run."""
    privacy = workload.privacy()
    epsilon_schedule(privacy)  # the ε of every round, before the clock starts (the ledger reads the memo)
    device = torch.device(workload.device)
    cuda = device.type == "cuda"
    run = _Run()
    resettable = reset_peak_resident()
    before = _status_bytes("VmRSS") or 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = round_started = time.perf_counter()

    def on_round(record: dict[str, Any]) -> None:
        nonlocal round_started
        if cuda:  # the round's queued GPU work belongs to it
            sync(device)
            run.gpu_seconds.append(time.perf_counter() - round_started)
            run.gpu_peaks.append(torch.cuda.max_memory_allocated(device))
        run.peaks.append(peak_resident_bytes())
        run.records.append(record)
        if between is not None:
            run.direct.append(between())
        reset_peak_resident()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            raise _OutOfTime
        round_started = time.perf_counter()

    try:
        engine.train(task, privacy, workload.optimizer(), workload.local(), seed=workload.seed, eval_every=0,
                     device=workload.device, training=workload.training, on_round=on_round)
    except _OutOfTime:
        pass
    return run, resettable, before


def _path(record: dict[str, Any]) -> str:
    """The path a round's record says trained its users (``clients.training_paths.path_metrics``): ``one-step`` when
    some of them trained on it."""
    return "one-step" if record.get("nonprivate_one_step") else \
        ("vectorized" if record.get("nonprivate_vectorized") else "sequential")


def measure(workload: HeavyTailWorkload | PopulationWorkload, *, max_seconds: float | None = None,
            log=print) -> dict[str, Any]:
    """One workload, one torch thread: the engine's rounds (interleaved with the direct implementation's for
    the heavy-tail workloads), medians, their ratio, milliseconds per user and the engine's peak memory."""
    with torch_threads(1):
        setup, task = timed(workload.task)
        direct = DirectLinearRound.of_task(task, workload) if isinstance(workload, HeavyTailWorkload) else None
        model = task.build_model()
        run, resettable, before = _engine_rounds(task, workload, between=None if direct is None else direct.step,
                                                 max_seconds=max_seconds)
    engine_seconds = run.gpu_seconds or [float(r["nonprivate_round_seconds"]) for r in run.records]
    users = [int(r["nonprivate_cohort_size"]) for r in run.records]
    result: dict[str, Any] = {
        "name": workload.name, "label": workload.label(), "population": task.num_users,
        "weights": sum(p.numel() for p in model.parameters()), "rounds": len(run.records),
        "rounds_planned": workload.rounds, "setup_seconds": setup, "training": workload.training,
        "engine_round_seconds": engine_seconds, "users_per_round": users, "paths": sorted({_path(r) for r in run.records}),
        "engine": summarize(engine_seconds), "ms_per_user": 1e3 * sum(engine_seconds) / max(1, sum(users)),
        "peak_resident_bytes": max(run.peaks), "resident_before_bytes": before, "peak_reset_per_round": resettable,
        "device": workload.device, "peak_gpu_bytes": max(run.gpu_peaks) if run.gpu_peaks else None,
        "direct_round_seconds": run.direct or None, "direct": summarize(run.direct) if run.direct else None,
        "ratio_to_direct": median_ratio(engine_seconds, run.direct),
    }
    log(f"  {workload.name}: engine rounds {', '.join(f'{s:.3f}' for s in engine_seconds)} s"
        + (f"; direct {', '.join(f'{s:.3f}' for s in run.direct)} s" if run.direct else ""))
    return result


def median_ratio(engine_seconds: list[float], direct_seconds: list[float]) -> float | None:
    """Median engine round over median direct round (None without direct rounds)."""
    if not direct_seconds:
        return None
    return summarize(engine_seconds)["median"] / summarize(direct_seconds)["median"]


def bench_small_users(chosen: list[HeavyTailWorkload | PopulationWorkload], *, max_seconds: float | None = None,
                      log=print) -> dict[str, Any]:
    """Every workload of ``chosen`` measured in turn; the machine's load average before and after (other
    processes share the cores: compare the ratios, measured under the same load, more than the seconds)."""
    load_before = os.getloadavg()
    rows = []
    for workload in chosen:
        log(f"  {workload.label()} ...")
        rows.append(measure(workload, max_seconds=max_seconds, log=log))
    return {"threads": 1, "cores": len(os.sched_getaffinity(0)), "load_before": list(load_before),
            "load_after": list(os.getloadavg()), "max_seconds": max_seconds, "workloads": rows}


def format_small_users(r: dict[str, Any]) -> str:
    """The workloads side by side: median engine round, median direct round, their ratio, ms per user, peak."""
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    rows = []
    for w in r["workloads"]:
        users = summarize([float(u) for u in w["users_per_round"]])["median"]
        rows.append([w["label"], f"{w['population']:,}", f"{users:,.0f}", f"{w['weights']:,}",
                     f"{w['rounds']}", f"{w['engine']['median']:.3f}",
                     "—" if w["direct"] is None else f"{w['direct']['median']:.3f}",
                     "—" if w["ratio_to_direct"] is None else f"{w['ratio_to_direct']:.1f}×",
                     f"{w['ms_per_user']:.3f}", gib(w["peak_resident_bytes"]), gib(w["resident_before_bytes"]),
                     "—" if w.get("peak_gpu_bytes") is None else gib(w["peak_gpu_bytes"]),
                     f"{','.join(w['paths'])} ({w.get('device', 'cpu')})"])
    header = ["workload", "users", "per round", "weights", "rounds", "engine round s", "direct round s",
              "engine/direct", "engine ms/user", "peak GiB", "before GiB", "GPU peak GiB", "path"]
    peaks = ("peak: the process's resident peak during the engine's rounds" if all(w["peak_reset_per_round"]
             for w in r["workloads"]) else "peak: the process's lifetime resident peak (no per-round reset here)")
    return (f"one torch thread, {r['cores']} cores, load average {r['load_before'][0]:.1f} before and "
            f"{r['load_after'][0]:.1f} after; medians of the rounds, engine and direct rounds alternating; "
            f"{peaks} (before: resident before the engine started)\n" + table(header, rows))


def run_section(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """``--only small-users`` with its options (``fed_dp.simulations.benchmark.arguments``)."""
    chosen = workloads(smoke=bool(args.smoke), rounds=args.small_users_rounds,
                       paper_rounds=args.small_users_paper_rounds, training=args.small_users_training,
                       device=args.small_users_device)
    return bench_small_users(chosen, max_seconds=args.small_users_max_seconds, log=log)
