"""Learning-rate tuning of a config's optimizers on a small grid, on a tuning draw of the data.

    python -m fed_dp.simulations.experiments.tune main-job                 # the grid below, tuning seed 1
    python -m fed_dp.simulations.experiments.tune main-job --grid dp-adam=0.001,0.003 --seed 2 --out results/tune

For every optimizer of the config (``run.optimizers``), each server learning rate of its grid is trained with
the config's other settings (its ``[optimizers.NAME]`` keys but ``lr``) on a *tuning* instance: the task built
with ``task.seed = SEED`` and ``run.seed = SEED`` (default 1), while the reported run uses the config's own
seeds (0 in the built-in configs), so the learning rates are not chosen on the data they are reported on.
The score is the final ``eval_accuracy`` (``eval_loss`` for tasks without accuracy, lower is better). It
prints one line per run and, per optimizer, the best learning rate; ``--out`` also writes ``tuning.json``.

Tuning runs are not part of the privacy accounting (as in the seed papers): choosing a learning rate on
users' data spends privacy that the reported ε does not include; here the tuning draw is a separate synthetic
draw, or state it when tuning on real users' data.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from fed_dp.accounting import resolve_privacy
from fed_dp.clients.task import build_task
from fed_dp.run_config import apply_overrides
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.experiments.runner import load_config, parse_experiment

__all__ = ["GRIDS", "best", "grid_for", "main", "tune"]

#: Server learning rates tried per optimizer family, points a factor ~3 apart around the usual values
#: (η = 1 for DP-FedAvg, η/(1 − μ) ≈ 1 for DP-SGDM with μ = 0.9, 1e-3 .. 3e-2 for the Adam variants), reaching
#: up to 30× the usual value for the SGD family: on heavy-tailed classes its best η is large (the main job's 10).
GRIDS: dict[str, tuple[float, ...]] = {
    "dp-fedavg": (0.3, 1.0, 3.0, 10.0, 30.0),
    "dp-sgd": (0.3, 1.0, 3.0, 10.0, 30.0),
    "dp-sgdm": (0.03, 0.1, 0.3, 1.0, 3.0),
    "adaptive": (0.001, 0.003, 0.01, 0.03),
}


def grid_for(name: str) -> tuple[float, ...]:
    """The learning rates tried for optimizer ``name`` (the Adam and AdaGrad variants share one grid)."""
    return GRIDS.get(name, GRIDS["adaptive"])


def _score(record: dict[str, Any]) -> float:
    """Higher is better: final accuracy, else minus the final loss (NaN or a missing metric scores −inf)."""
    value = record.get("eval_accuracy", -record.get("eval_loss", math.inf))
    return value if isinstance(value, float) and math.isfinite(value) else -math.inf


def best(results: list[dict[str, Any]]) -> dict[str, float]:
    """The learning rate with the best score, per optimizer (ties: the smaller learning rate)."""
    chosen: dict[str, tuple[float, float]] = {}
    for row in sorted(results, key=lambda r: r["lr"]):
        if row["optimizer"] not in chosen or row["score"] > chosen[row["optimizer"]][1]:
            chosen[row["optimizer"]] = (row["lr"], row["score"])
    return {name: lr for name, (lr, _) in chosen.items()}


def tune(config: dict[str, Any], grids: dict[str, tuple[float, ...]] | None = None, seed: int = 1,
         log=print) -> list[dict[str, Any]]:
    """Train every (optimizer, learning rate) of the grid on the tuning draw ``seed``; one row per run."""
    config = apply_overrides(config, [f"task.seed={seed}", f"run.seed={seed}"])
    experiment = parse_experiment(config)
    task = build_task(experiment.base.task)
    privacy = resolve_privacy(experiment.privacy, task.num_users)
    rows = []
    for name, run in experiment.runs.items():
        for lr in (grids or {}).get(name, grid_for(name)):
            tuned = dataclasses.replace(run.optimizer, name=name, lr=lr)
            start = time.perf_counter()
            result = train(task, privacy, tuned.build(), run.local, seed=seed, eval_every=run.run.eval_every,
                           device=run.client.device, training=run.client.training, chunk_size=run.client.chunk_size)
            final = [r for r in result.records if "eval_loss" in r][-1]
            row = {"optimizer": name, "lr": lr, "score": _score(final), "eval_accuracy": final.get("eval_accuracy"),
                   "eval_loss": final.get("eval_loss"), "epsilon": result.epsilon,
                   "seconds": round(time.perf_counter() - start, 1)}
            log(f"{name:>14}  lr {lr:<8g} accuracy {row['eval_accuracy']}  loss {row['eval_loss']:.4f}  "
                f"({row['seconds']} s)")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fed_dp.simulations.experiments.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a TOML config or the name of a built-in config")
    parser.add_argument("--grid", action="append", default=[], metavar="NAME=LR,LR,...",
                        help="learning rates for one optimizer (repeatable; default: GRIDS; NAME= skips it)")
    parser.add_argument("--seed", type=int, default=1, help="task.seed and run.seed of the tuning draw (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a config key")
    parser.add_argument("--out", metavar="DIR", help="write tuning.json there")
    args = parser.parse_args(argv)
    grids = {}
    for item in args.grid:
        name, _, values = item.partition("=")
        grids[name] = tuple(float(v) for v in values.split(",") if v.strip())
    config = apply_overrides(load_config(args.config), args.set)
    rows = tune(copy.deepcopy(config), grids, args.seed)
    chosen = best(rows)
    print("\nbest learning rate per optimizer (tuning seed %d): " % args.seed
          + ", ".join(f"{name} {lr:g}" for name, lr in chosen.items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tuning.json").write_text(json.dumps({"seed": args.seed, "runs": rows, "best": chosen}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
