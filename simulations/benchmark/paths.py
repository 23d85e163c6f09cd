"""``fed-dp benchmark --only paths``: is the automatic training path the fastest one, workload by workload?

A node trains its users on one of three paths (``clients.training_paths.contribution``): without a model per user
when their update is one full-batch gradient step (``clients.one_step``), vectorized over users with
``torch.func``, or one user at a time. ``client.training = "auto"`` chooses by rules fixed in advance from the
model and the users' shapes (never from a clock, so a run's path, and with it its float rounding, does not depend
on the machine's load): the one-step path unless its per-user norms would cost more than
``one_step.AUTO_MAX_EXTRA_MACS`` multiply-adds per user beyond a per-user path's own work; on the CPU vectorized
only for models without convolutions of at most ``training_paths.CPU_VECTORIZE_MAX_PARAMS`` parameters.

This section checks those rules against the clock: each workload below (small users of the built-in tasks' model
families, on the CPU, one torch thread) runs a few rounds of the in-process engine with ``auto``, ``vectorized`` and
``sequential``, and prints the seconds of the fastest round of each (the first round, which warms up, left out:
the least disturbed round is the steadiest estimate of a path's cost on a machine shared with other jobs), the
path auto took, and auto's time over the fastest path's. A ratio near 1 says auto chose well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fed_dp.clients.task import Task
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.benchmark.measure import table, torch_threads
from fed_dp.simulations.engine import inprocess as engine
from fed_dp.simulations.tasks.builtin import heavy_tail_task, stackoverflow_like_task, w1_task

__all__ = ["PATHS", "PathWorkload", "bench_paths", "format_paths", "workloads"]

#: The run-config choices compared (``client.training``).
PATHS = ("auto", "vectorized", "sequential")


@dataclass(frozen=True)
class PathWorkload:
    """One workload: a task, how its users train locally, and how many of them a round samples (Poisson)."""

    label: str
    build: Callable[[], Task]
    users: int
    cohort: int
    local: LocalTraining

    def privacy(self, rounds: int) -> PrivacyConfig:
        return PrivacyConfig(num_users=self.users, expected_cohort=self.cohort, rounds=rounds, sampler="poisson",
                             noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, accountant="rdp")


def workloads(*, smoke: bool) -> list[PathWorkload]:
    """Linear models with one and with several local steps, the W1 CNN with one and with four, and a next-token
    model over a 10,000-word vocabulary (``smoke``: the first and the third, a few users each, seconds in all)."""
    one_step = LocalTraining(epochs=1, batch_size=64, lr=0.5)
    chosen = [
        PathWorkload("heavy-tail linear (G = 6, L = 64), 1 example, one step",
                     lambda: heavy_tail_task(groups=6, largest=64, users=384), 384, 256, one_step),
        PathWorkload("heavy-tail linear, 4 examples, 2 epochs of batch 2",
                     lambda: heavy_tail_task(groups=6, largest=64, users=96), 96, 64,
                     LocalTraining(epochs=2, batch_size=2, lr=0.5)),
        PathWorkload("W1 CNN, 32 images, one step",
                     lambda: w1_task(users=200), 200, 48, LocalTraining(epochs=1, batch_size=32, lr=0.05)),
        PathWorkload("W1 CNN, 32 images, 4 steps of batch 8",
                     lambda: w1_task(users=200), 200, 48, LocalTraining(epochs=1, batch_size=8, lr=0.05)),
        PathWorkload("next-token, V = 10,000, 1-16 sequences, one step",
                     lambda: stackoverflow_like_task(users=10_000, max_sequences=16), 10_000, 100,
                     LocalTraining(epochs=1, batch_size=16, lr=0.5)),
    ]
    if smoke:
        return [replace(w, cohort=max(2, w.cohort // 16)) for w in (chosen[0], chosen[2])]
    return chosen


def _rounds(workload: PathWorkload, task: Task, training: str, rounds: int) -> tuple[list[float], str]:
    """Seconds of each round after the first, and the path the last round's record names."""
    records: list[dict[str, Any]] = []
    engine.train(task, workload.privacy(rounds), make_optimizer("dp-adam", lr=0.001), workload.local, seed=0,
                 eval_every=0, device="cpu", training=training, on_round=records.append)
    last = records[-1]
    path = "one-step" if last.get("nonprivate_one_step") else \
        ("vectorized" if last.get("nonprivate_vectorized") else "sequential")
    return [r["nonprivate_round_seconds"] for r in records[1:]], path


def bench_paths(chosen: list[PathWorkload], rounds: int, log=print) -> list[dict[str, Any]]:
    """Seconds of the fastest round (after the first) of every path on every workload, one torch thread."""
    rows = []
    with torch_threads(1):
        for workload in chosen:
            task = workload.build()
            row: dict[str, Any] = {"workload": workload.label}
            for training in PATHS:
                log(f"  {workload.label}: {training} ...")
                seconds, path = _rounds(workload, task, training, rounds)
                row[training] = min(seconds)
                if training == "auto":
                    row["auto_path"] = path
            row["auto_over_fastest"] = row["auto"] / min(row[p] for p in PATHS)
            rows.append(row)
    return rows


def format_paths(rows: list[dict[str, Any]]) -> str:
    return table(["workload", "auto (path taken)", "vectorized", "sequential", "auto / fastest"],
                  [[r["workload"], f"{r['auto']:.3f} s ({r['auto_path']})", f"{r['vectorized']:.3f} s",
                    f"{r['sequential']:.3f} s", f"{r['auto_over_fastest']:.2f}"] for r in rows])
