"""Experiment runner: a TOML config → one or several optimizers trained with the same seeds → results.

A config is a run configuration (``fed_dp.run_config``: tables ``[task]``, ``[privacy]``, ``[optimizer]``,
``[local]``, ``[adaptive]``, ``[client]``, ``[run]``; keys hyphenated, as in Flower run configs) plus two
experiment keys: ``run.optimizers = [names]`` trains each of these optimizers with the same seeds, and
``[optimizers.NAME]`` tables hold their hyper-parameters (the keys of ``[optimizer]``). See
``simulations/configs/`` and docs/tutorials/simulations.md. Of ``[server]``, ``checkpoint-dir`` (one folder per optimizer),
``max-empty-rounds`` and ``noise-source`` act; the keys that wait for SuperNodes are refused
(:data:`FLOWER_ONLY_KEYS`).

Each run writes to its output folder: ``config.json`` (the config as given, and what was resolved: N, the
calibrated σ, the seed of the model and local training; the seed of the sampler and the noise only when the
config gave ``run.seed``), ``rounds-NAME.jsonl`` (one record per round: round, ε, losses, accuracies, per-group
metrics, optimizer diagnostics) and ``summary.json`` (the table printed at the end). A folder that cannot be
written is refused before anything trains; a write that fails later (a full disk) is a
``fed_dp.atomic.WriteError`` saying which results are incomplete.

With ``server.checkpoint-dir``, a run whose folders hold checkpoints resumes them: before anything is written,
their recorded configuration is compared with this one (``fed_dp.run_setup``; a change is refused, so config.json
never describes a run the checkpoint does not hold), and without ``run.seed`` the seed the checkpointed run drew is
taken again.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fed_dp.accounting import accounting_note, epsilon_schedule, resolve_privacy
from fed_dp.atomic import reporting_writes
from fed_dp.checkpoint import recorded_run
from fed_dp.clients.task import Task, build_task
from fed_dp.clients.training import resolve_device
from fed_dp.config import PrivacyConfig
from fed_dp.randomness import entropy_seed
from fed_dp.round_loop import TrainingStopped
from fed_dp.plan import RunPlan
from fed_dp.run_config import OPTIMIZER_DEFAULTS, RunConfig, apply_overrides
from fed_dp.run_setup import check_resume, describe_run
from fed_dp.simulations.engine.inprocess import run_plan
from fed_dp.simulations.engine.progress import RoundProgress
from fed_dp.simulations.experiments.config_files import DEFAULT_CONFIG, check_config_names, load_config

__all__ = ["DEFAULT_CONFIG", "Experiment", "apply_overrides", "format_table", "load_config", "parse_experiment",
           "read_results", "run_experiment"]


@dataclass(frozen=True)
class Experiment:
    """A parsed, validated config: one run configuration per optimizer (identical but for the optimizer)."""

    runs: dict[str, RunConfig]

    @property
    def base(self) -> RunConfig:
        return next(iter(self.runs.values()))

    @property
    def privacy(self) -> PrivacyConfig:
        return self.base.privacy


#: Keys that only a Flower run acts on (they wait for SuperNodes and their replies): an in-process command refuses
#: them rather than ignore them.
FLOWER_ONLY_KEYS = ("server.reply-timeout", "server.min-nodes", "server.node-wait", "server.allow-unreported-model")


def refuse_keys(config: dict[str, Any], keys: tuple[str, ...], command: str, why: str) -> None:
    """Raise when ``config`` gives any of the dotted ``keys``, which ``command`` does not act on (``why``)."""
    given = [key for key in keys if key.partition(".")[2] in (config.get(key.partition(".")[0]) or {})]
    if given:
        raise ValueError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect in {command}: {why}; "
                         "remove it from the config")


def parse_experiment(config: dict[str, Any], command: str = "fed-dp simulate") -> Experiment:
    """Validate a whole config (every optimizer's run configuration) before anything runs; keys that only a
    Flower run acts on are refused (``command`` names the command in the message)."""
    check_config_names(config)
    refuse_keys(config, FLOWER_ONLY_KEYS, command, "it trains in this process, without SuperNodes (they are for "
                "Flower runs)")
    tables = copy.deepcopy(config)
    hyper = tables.pop("optimizers", {})
    run_table = tables.setdefault("run", {})
    names = run_table.pop("optimizers", None)
    single = tables.get("optimizer", {})
    if names is None:
        names = [single.get("name", OPTIMIZER_DEFAULTS.name)]
    elif "name" in single:
        raise ValueError("give optimizer.name or run.optimizers, not both")
    if not isinstance(names, list) or not names:
        raise ValueError(f"run.optimizers must be a non-empty list of names, got {names!r}")
    runs = {}
    for name in names:
        runs[name] = RunConfig.from_tables({**tables, "optimizer": {**single, "name": name, **hyper.get(name, {})}})
    resolve_device(runs[names[0]].client.device)  # a CUDA device this machine lacks fails here, before any work
    return Experiment(runs)


def _summary_row(name: str, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    final = records[-1]
    evaluated = [r for r in records if any(k.startswith("eval_") for k in r)]
    last_eval = evaluated[-1] if evaluated else {}
    row = {
        "optimizer": name,
        "epsilon": final["epsilon"],
        "delta": final["delta"],
        "rounds": sum(1 for r in records if r["round"] > 0),  # released rounds (round 0: the initial model)
        "eval_accuracy": last_eval.get("eval_accuracy", math.nan),
        "eval_loss": last_eval.get("eval_loss", math.nan),
        "seconds": round(seconds, 2),
    }
    if final.get("non_private"):
        row["non_private"] = True
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


@dataclass(frozen=True)
class RunSeeds:
    """The seeds of an experiment, shared by its optimizers (the same cohorts, noise and initial model for each).

    ``privacy`` seeds the sampler and the noise: with ``run.seed`` it is that seed (a research run, reproducible
    by whoever reads the config); without, it comes from OS entropy, stays in memory and is written nowhere,
    because whoever knows it can rebuild every cohort and subtract the noise. ``training`` seeds the model's
    initialization and local training and is the one written to config.json and the log."""

    privacy: int
    training: int
    note: str


def run_seeds(seed: int | None, resumed: int | None = None) -> RunSeeds:
    """The seeds for ``run.seed`` (None: the noise and sampler seed and the training seed from OS entropy, or the
    training seed ``resumed``, the one a checkpointed run of this experiment drew: it resumes with it)."""
    if seed is not None:
        return RunSeeds(seed, seed, "run.seed: model, local training, sampler and noise are reproducible from it "
                        "(a research run; anyone who reads it can rebuild the cohorts and remove the noise)")
    drawn = "drawn from OS entropy when the run started, and kept by its checkpoint" if resumed is not None else \
        "from OS entropy"
    return RunSeeds(entropy_seed(), resumed if resumed is not None else entropy_seed(), "the seed of the model's "
                    f"initialization and local training, {drawn}; the sampler and the noise were seeded from OS "
                    "entropy too and that seed is written nowhere")


def checkpoint_folder(checkpoint_dir: str | None, optimizer: str) -> str | None:
    """``server.checkpoint-dir/<optimizer>``: each optimizer of an experiment checkpoints, and resumes, there."""
    return None if checkpoint_dir is None else str(Path(checkpoint_dir) / optimizer)


def _recorded_runs(experiment: Experiment) -> dict[str, tuple[PrivacyConfig, dict[str, Any] | None]]:
    """The recorded privacy configuration and description (``fed_dp.run_setup``) of each optimizer whose
    checkpoint folder holds a run to resume."""
    recorded = {}
    for name, run in experiment.runs.items():
        folder = checkpoint_folder(run.server.checkpoint_dir, name)
        found = recorded_run(folder) if folder is not None else None
        if found is not None:
            recorded[name] = found
    return recorded


def _check_resumes(plans: dict[str, RunPlan], recorded: dict[str, tuple[PrivacyConfig, dict[str, Any] | None]]) -> None:
    """Refuse, before anything is written, a resume whose plan differs from the configuration its checkpoint
    recorded (everything the engine checks but the model, which it checks once built): otherwise config.json
    would be rewritten for a run that then does not start."""
    for name, (recorded_privacy, recorded_setup) in recorded.items():
        plan = plans[name]
        adaptive = None if plan.adaptive_clipping is None else plan.adaptive_clipping.for_privacy(plan.privacy)
        setup = describe_run(optimizer=plan.optimizer, adaptive=adaptive, noise_source=plan.noise_source,
                             seed=plan.training_seed, local=plan.local)
        check_resume(plan.checkpoint_dir, recorded_privacy, recorded_setup, plan.privacy, setup)


def _results_folder(out: Path, text: str) -> None:
    """Create the results folder and write ``text`` (the run's description) to its config.json, before any
    training: a folder that cannot be written (read-only, on a full disk) is a ValueError naming it, before anything
    runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(text)
    except OSError as error:
        raise ValueError(f"the results folder {out} cannot be written: {error.strerror} ({error.filename}). Give a "
                         "folder you can write to (fed-dp simulate --out DIR)") from error


def _results_write(out: Path, name: str) -> Any:
    """A failed write of ``name``'s results (a full disk) as a WriteError that says where its model is kept."""
    return reporting_writes(f"the results of {name} are incomplete. Free space (or give another --out) and run "
                            "again; with server.checkpoint-dir the run resumes from its checkpoint instead of "
                            "training again", out)


def run_experiment(
    config: dict[str, Any], out_dir: str | Path, *, progress: bool = True, log=print, task: Task | None = None,
    write: bool = True,
) -> list[dict[str, Any]]:
    """Run every optimizer of the config with the same seeds; write results; return the summary rows.

    ``task``: train this task instead of building the config's ``[task]`` (``fed-dp simulate --task``).
    ``write``: False on the ranks other than 0 of a ``torchrun`` run, which train and return the same rows
    (rank 0's records) but leave the results folder to rank 0."""
    experiment = parse_experiment(config)
    base = experiment.base
    task = task if task is not None else build_task(base.task)
    privacy = resolve_privacy(base.privacy, task.num_users)  # σ calibrated once, shared by every optimizer
    recorded = _recorded_runs(experiment) if write else {}  # resumes (rank 0 of a torchrun run reads them)
    resumed = next((setup["seed"] for _, setup in recorded.values() if setup and setup.get("seed") is not None), None)
    seeds = run_seeds(base.run.seed, resumed)
    plans = {name: RunPlan.from_run_config(run, privacy=privacy, seed=seeds.privacy, training_seed=seeds.training,
                                           checkpoint_dir=checkpoint_folder(run.server.checkpoint_dir, name),
                                           flower_run=False)
             for name, run in experiment.runs.items()}  # each validated once, here
    _check_resumes(plans, recorded)
    out = Path(out_dir)
    resolved = {**copy.deepcopy(config), "resolved": {
        "num_users": task.num_users, "noise_multiplier": privacy.noise_multiplier,
        "calibrated_from_target_epsilon": base.privacy.target_epsilon, "task": task.description or task.name,
        "seed": seeds.training, "seed_note": seeds.note,
    }}
    if write:
        _results_folder(out, json.dumps(resolved, indent=2, default=str))
    log(f"task: {task.description or task.name}")
    log(f"privacy: N = {task.num_users}, B = {privacy.expected_cohort}, T = {privacy.rounds}, "
        f"sigma = {privacy.noise_multiplier:.4f}, clip = {privacy.clip_norm}, sampler = {privacy.sampler}, "
        f"noise = {privacy.noise}, delta = {privacy.delta:g}; seed {seeds.training}")
    # The ε of every round is the same for all optimizers (same sampler, σ, T): compute the schedule once up
    # front (memoized in fed_dp.accounting) so the per-optimizer times compare training, not accounting.
    note = accounting_note(privacy.rounds, privacy.accountant)
    if note is not None:
        log(note)
    schedule = epsilon_schedule(privacy).epsilons
    if privacy.non_private:
        log("WARNING: privacy.noise-multiplier = 0: a NON-PRIVATE baseline, no noise is added and epsilon is "
            "infinite; every result is labelled non-private")
    else:
        log(f"user-level epsilon after {privacy.rounds} rounds: {schedule[-1]:.4f} "
            f"({privacy.accountant}, delta = {privacy.delta:g})")
    log(f"users train: {base.client.training} on {resolve_device(base.client.device)}"
        + (f", chunks of {base.client.chunk_size} users" if base.client.chunk_size else ""))
    rows = []
    for name, run in experiment.runs.items():
        bar = RoundProgress(privacy.rounds, f"{name:>14}", leave=True) if progress else None

        def on_round(record: dict[str, Any]) -> None:
            if bar is not None:
                bar.update(record)

        start = time.perf_counter()
        try:
            result = run_plan(task, plans[name], run.client, on_round=on_round)
        except TrainingStopped as stop:
            if write:
                with _results_write(out, name):
                    _write_rounds(out, name, stop.records)
                    stop.saved = _save_model(out, name, stop.result.model)
            raise
        finally:
            if bar is not None:
                bar.close()
        if write:
            with _results_write(out, name):
                _write_rounds(out, name, result.records)
        rows.append(_summary_row(name, result.records, time.perf_counter() - start))
    if write:
        with _results_write(out, "the experiment"):
            (out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


def _write_rounds(out: Path, name: str, records: list[dict[str, Any]]) -> None:
    with (out / f"rounds-{name}.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps({"optimizer": name, **record}, default=str) + "\n")


def _save_model(out: Path, name: str, model: torch.nn.Module) -> Path:
    """``out/model-<optimizer>.pt``: the model's state_dict (``torch.load`` it into the task's model)."""
    path = out / f"model-{name}.pt"
    torch.save(model.state_dict(), path)
    return path


def read_results(folder: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The per-round records of every optimizer in a results folder."""
    folder = Path(folder)
    files = sorted(folder.glob("rounds-*.jsonl"))
    if not files:
        raise ValueError(f"{folder} holds no rounds-*.jsonl results (run fed-dp simulate --out {folder})")
    return {f.stem[len("rounds-"):]: [json.loads(line) for line in f.read_text().splitlines() if line]
            for f in files}
