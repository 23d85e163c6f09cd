"""Experiment runner: a TOML config → one or several optimizers trained with the same seeds → results.

A config has five tables (keys hyphenated, as in Flower run configs); see ``simulations/configs/`` and the
README. ``[privacy]`` holds the ``PrivacyConfig`` fields except ``num-users``, which is the task's number
of users; ``target-epsilon`` instead of ``noise-multiplier`` calibrates σ with dp_accounting.

    [task]        name = "heavy-tail" and the task's own parameters (simulations.tasks)
    [privacy]     expected-cohort, rounds, noise-multiplier | target-epsilon, clip-norm, delta, sampler, ...
    [local]       epochs, batch-size, lr
    [run]         seed, eval-every, optimizers = [names], engine = "auto" | "vectorized" | "sequential",
                  device = "auto" | "cpu" | "cuda[:N]", chunk-size (users per vmapped call; 0 = automatic)
    [optimizers.NAME]   hyper-parameters of optimizer NAME (fed_dp.optimizers.make_optimizer)

Each run writes to its output folder: ``config.json`` (the resolved config), ``rounds-NAME.jsonl`` (one
record per round: round, ε, losses, accuracies, per-group metrics, optimizer diagnostics) and
``summary.json`` (the table printed at the end).
"""

from __future__ import annotations

import copy
import json
import math
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fed_dp.accounting import calibrate_noise_multiplier, epsilon
from fed_dp.adaptive_clipping import AdaptiveClipConfig, check_compatible
from fed_dp.config import PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import OPTIMIZERS, make_optimizer
from fed_dp.clients.training import LocalTraining
from fed_dp.simulations.engine import resolve_device, run
from fed_dp.simulations.tasks import build_task

TABLES = ("task", "privacy", "local", "run", "optimizers", "adaptive")
DEFAULT_CONFIG = "heavy-tail-quick"


def _keys(table: dict[str, Any]) -> dict[str, Any]:
    """Hyphenated TOML keys → Python field names."""
    return {k.replace("-", "_"): v for k, v in table.items()}


def load_config(path: str | Path | None) -> dict[str, Any]:
    """Read a TOML config; ``None`` is the built-in default, a bare name one of ``simulations/configs``."""
    if path is None:
        path = DEFAULT_CONFIG
    path_str = str(path)
    if not path_str.endswith(".toml") and "/" not in path_str:
        resource = resources.files("fed_dp.simulations") / "configs" / f"{path_str}.toml"
        if not resource.is_file():
            names = sorted(p.name[:-5] for p in (resources.files("fed_dp.simulations") / "configs").iterdir()
                           if p.name.endswith(".toml"))
            raise ValueError(f"no built-in config {path_str!r}; built-in configs: {', '.join(names)}")
        return tomllib.loads(resource.read_text(encoding="utf-8"))
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {file} does not exist")
    return tomllib.loads(file.read_text(encoding="utf-8"))


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set table.key=value`` (value parsed as a TOML literal, else kept as a string)."""
    config = copy.deepcopy(config)
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set expects table.key=value (e.g. privacy.rounds=50), got {item!r}")
        dotted, raw = item.split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *tables, key = dotted.split(".")
        if tables[0] not in TABLES:
            raise ValueError(f"--set {dotted}: unknown table {tables[0]!r}; tables are {', '.join(TABLES)}")
        target = config
        for table in tables:
            target = target.setdefault(table, {})
        target[key] = value
    return config


@dataclass(frozen=True)
class Experiment:
    """A parsed, validated config: everything a run needs."""

    task_params: dict[str, Any]
    privacy: PrivacyConfig
    local: LocalTraining
    seed: int
    eval_every: int
    optimizers: dict[str, dict[str, Any]]
    calibrated_from: float | None
    adaptive: AdaptiveClipConfig | None = None
    engine: str = "auto"
    device: str = "auto"
    chunk_size: int | None = None

    @property
    def vectorized(self) -> bool | None:
        """The engine's ``vectorized`` argument: None (auto), True or False."""
        return {"auto": None, "vectorized": True, "sequential": False}[self.engine]


def _adaptive(table: dict[str, Any], privacy: PrivacyConfig) -> AdaptiveClipConfig | None:
    """[adaptive]: enabled, target-quantile, learning-rate, bit-noise-std (<= 0: B/20, Andrew et al.).

    The initial clip norm is privacy.clip-norm. Independent noise only (checked when the server starts).
    """
    values = _keys(table)
    if not values.pop("enabled", bool(values)):
        return None
    if values.get("bit_noise_std", 0) <= 0:
        values["bit_noise_std"] = privacy.expected_cohort / 20
    unknown = set(values) - {"target_quantile", "learning_rate", "bit_noise_std"}
    if unknown:
        raise ValueError(f"unknown [adaptive] key(s) {sorted(unknown)}; known: enabled, target-quantile, learning-rate, bit-noise-std")
    config = AdaptiveClipConfig(initial_clip_norm=privacy.clip_norm, **values)
    check_compatible(privacy, config)
    return config


def parse_experiment(config: dict[str, Any], num_users: int) -> Experiment:
    unknown = set(config) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown config table(s) {sorted(unknown)}; tables are {', '.join(TABLES)}")
    privacy_args = _keys(config.get("privacy", {}))
    if "num_users" in privacy_args:
        raise ValueError("privacy.num-users is the task's number of users; set task.users instead")
    target = privacy_args.pop("target_epsilon", None)
    if target is not None and "noise_multiplier" in privacy_args:
        raise ValueError("give privacy.noise-multiplier or privacy.target-epsilon, not both")
    privacy = PrivacyConfig(num_users=num_users, **{"noise_multiplier": 1.0, **privacy_args})
    if target is not None:
        privacy = privacy.replace(noise_multiplier=calibrate_noise_multiplier(privacy, float(target)))
    run_table = _keys(config.get("run", {}))
    names = run_table.pop("optimizers", ["dp-adam"])
    seed = run_table.pop("seed", 0)
    eval_every = run_table.pop("eval_every", max(1, privacy.rounds // 20))
    engine = run_table.pop("engine", "auto")
    if engine not in ("auto", "vectorized", "sequential"):
        raise ValueError(f"run.engine must be 'auto', 'vectorized' or 'sequential', got {engine!r}")
    device = str(run_table.pop("device", "auto"))
    resolve_device(device)  # a CUDA device this machine lacks fails here, before any work
    chunk_size = run_table.pop("chunk_size", 0)
    if not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 0):
        raise ValueError(f"run.chunk-size must be an integer >= 0 (0 = automatic), got {chunk_size!r}")
    if run_table:
        raise ValueError(f"unknown [run] key(s) {sorted(run_table)}; known: seed, eval-every, optimizers, "
                         "engine, device, chunk-size")
    hyper = {name: _keys(table) for name, table in config.get("optimizers", {}).items()}
    unknown_names = [n for n in list(names) + list(hyper) if n not in OPTIMIZERS]
    if unknown_names:
        raise ValueError(f"unknown optimizer(s) {unknown_names}; choose from {', '.join(OPTIMIZERS)}")
    with simulation():  # validates every optimizer's hyper-parameters before anything runs
        for name in names:
            make_optimizer(name, **hyper.get(name, {}))
    return Experiment(
        adaptive=_adaptive(config.get("adaptive", {}), privacy),
        task_params=_keys(config.get("task", {})),
        privacy=privacy,
        local=LocalTraining(**_keys(config.get("local", {}))),
        seed=int(seed),
        eval_every=int(eval_every),
        optimizers={name: hyper.get(name, {}) for name in names},
        calibrated_from=target,
        engine=engine,
        device=device,
        chunk_size=chunk_size or None,
    )


def _summary_row(name: str, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    final = records[-1]
    evaluated = [r for r in records if "eval_accuracy" in r]
    last_eval = evaluated[-1] if evaluated else {}
    row = {
        "optimizer": name,
        "epsilon": final["epsilon"],
        "delta": final["delta"],
        "rounds": len(records),
        "eval_accuracy": last_eval.get("eval_accuracy", math.nan),
        "eval_loss": last_eval.get("eval_loss", math.nan),
        "seconds": round(seconds, 2),
    }
    row.update({k: v for k, v in last_eval.items() if k.startswith("group") and k.endswith("_accuracy")})
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the summary rows (ε shown as 'not private' for the noiseless baseline)."""
    groups = sorted({k for r in rows for k in r if k.startswith("group")}, key=lambda k: int(k[5:].split("_")[0]))
    header = ["optimizer", "epsilon", "accuracy", "loss"] + [g.replace("_accuracy", "") for g in groups] + ["seconds"]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) < 1000 else f"{value:.4g}"
        return str(value)

    lines = [[r["optimizer"], cell(r["epsilon"]), cell(r["eval_accuracy"]), cell(r["eval_loss"])]
             + [cell(r.get(g, math.nan)) for g in groups] + [cell(r["seconds"])] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    render = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([render(header), render(["-" * w for w in widths])] + [render(line) for line in lines])


def run_experiment(
    config: dict[str, Any], out_dir: str | Path, *, progress: bool = True, log=print
) -> list[dict[str, Any]]:
    """Run every optimizer of the config with the same seeds; write results; return the summary rows."""
    task = build_task(**_keys(config.get("task", {})))
    experiment = parse_experiment(config, task.num_users)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = {**copy.deepcopy(config), "resolved": {
        "num_users": task.num_users, "noise_multiplier": experiment.privacy.noise_multiplier,
        "calibrated_from_target_epsilon": experiment.calibrated_from, "task": task.description,
        "seed_note": "explicit seed: sampler and noise are reproducible (research run)",
    }}
    (out / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    log(f"task: {task.description}")
    log(f"privacy: N = {task.num_users}, B = {experiment.privacy.expected_cohort}, T = {experiment.privacy.rounds}, "
        f"sigma = {experiment.privacy.noise_multiplier:.4f}, clip = {experiment.privacy.clip_norm}, "
        f"sampler = {experiment.privacy.sampler}, noise = {experiment.privacy.noise}, delta = {experiment.privacy.delta:g}; "
        f"explicit seed {experiment.seed} (reproducible research run)")
    # The ε of every round is the same for all optimizers (same sampler, σ, T): compute it once up front
    # (memoized in fed_dp.accounting) so the per-optimizer times compare training, not accounting.
    schedule = [epsilon(experiment.privacy, t) for t in tqdm(
        range(1, experiment.privacy.rounds + 1), desc="    accounting", disable=not progress, leave=False)]
    log(f"user-level epsilon after {experiment.privacy.rounds} rounds: {schedule[-1]:.4f} "
        f"({experiment.privacy.accountant}, delta = {experiment.privacy.delta:g})")
    log(f"engine: {experiment.engine} on {resolve_device(experiment.device)}"
        + (f", chunks of {experiment.chunk_size} users" if experiment.chunk_size else ""))
    rows = []
    for name, hyper in experiment.optimizers.items():
        with simulation():
            optimizer = make_optimizer(name, **hyper)
        bar = tqdm(total=experiment.privacy.rounds, desc=f"{name:>14}", disable=not progress, leave=True)
        records_path = out / f"rounds-{name}.jsonl"

        def on_round(record: dict[str, Any]) -> None:
            eps = record["epsilon"]
            bar.set_postfix(eps=eps if isinstance(eps, str) else f"{eps:.2f}", loss=f"{record['train_loss']:.3f}")
            bar.update(1)

        start = time.perf_counter()
        _, records = run(task, experiment.privacy, optimizer, experiment.local, seed=experiment.seed,
                         eval_every=experiment.eval_every, on_round=on_round, adaptive_clipping=experiment.adaptive,
                         vectorized=experiment.vectorized, chunk_size=experiment.chunk_size, device=experiment.device)
        bar.close()
        with records_path.open("w") as handle:
            for record in records:
                handle.write(json.dumps({"optimizer": name, **record}, default=str) + "\n")
        rows.append(_summary_row(name, records, time.perf_counter() - start))
    (out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


def read_results(folder: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The per-round records of every optimizer in a results folder."""
    folder = Path(folder)
    files = sorted(folder.glob("rounds-*.jsonl"))
    if not files:
        raise ValueError(f"{folder} holds no rounds-*.jsonl results (run fed-dp simulate --out {folder})")
    return {f.stem[len("rounds-"):]: [json.loads(line) for line in f.read_text().splitlines() if line]
            for f in files}
