"""The ``scaling`` section of ``fed-dp benchmark``: the engine's rounds as the cohort grows, against plain
training on the same examples (the per-user overhead)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from fed_dp.simulations.benchmark.measure import table
from fed_dp.simulations.benchmark.w1 import W1Spec, engine_run, plain_training_seconds
from fed_dp.simulations.tasks.builtin import w1_task


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
    return table(["users/round", "round s", "plain s", "ms/user", "overhead ms/user"], rows)
