"""fed_dp — the folder fed_dp/, layer 0 of 4 (the core) and the public facade: user-level DP federated training.

fed-dp trains with user-level differential privacy on Flower and PyTorch.

The public API, importable from here (loaded on first use, so ``import fed_dp`` stays light):

    Bring your task                Task, Users, Examples, losses, evaluation, load_task, build_task
    Configure                      PrivacyConfig, LocalTraining, AdaptiveClipConfig, RunConfig, make_optimizer;
                                   RunPlan (what an engine executes, built once: UserLevelDP(plan=...))
    Simulate in this process       train -> TrainResult (TrainingStopped, with .result, when a user fails)
    Checkpoint folders             FolderInUseError (another run owns it), CheckpointWriteError (a write failed)
    Run on Flower (server side)    UserLevelDP (a flwr Strategy; UserLevelDP.from_run_config), model_arrays,
                                   centralized_evaluation
    Run on Flower (client side)    LocalTrainer, train_reply, query_reply, hosted_users; client_app (fed-dp's own
                                   ClientApp, which answers with them)
    Account                        epsilon, epsilon_schedule, calibrate_noise_multiplier, resolve_privacy

The package is layered; imports point down only (tests/test_architecture.py checks it). Each layer above the
core is a top-level folder of the repository that installs under another name (pyproject.toml's package-dir):

    fed_dp.simulations   simulations/   tasks (built-in tasks, datasets), engine (in-process simulator),
                                        experiments, benchmark, CLI
    fed_dp.server        server/        the Flower Strategy, membership, the ServerApp
    fed_dp.clients       clients/       the task interface, losses, local training, the message protocol, the ClientApp
    fed_dp (core)        fed_dp/        DP math on flat tensors, no torch.nn and no Flower (the modules below)

Core modules (docs/explanation/mechanism.md):
    config             PrivacyConfig (sampler, noise and accounting from one object), LocalTraining
    schema             a setting of the run configuration (key, type, default, help), written on the dataclasses
    run_config         the one run configuration (RunConfig), the public entry of the four modules below
    run_schema         its sections: every key, its type, default and meaning
    run_parsing        TOML tables, --set overrides and Flower run configs read into the sections
    run_rendering      the Flower run-config table and the configuration reference, generated from the schema
    task_registry      tasks by short name (the entry-point group fed_dp.tasks)
    plan               RunPlan: what an engine executes (privacy, optimizer, local training, seeds, ...), built once
    flat               ParamLayout — a model update as one float32 vector and back
    clipping           L2 clip of whole user updates; scaled-geometry clip (scale-then-privatize)
    factorization      BandMF strategy matrices C (banded, Toeplitz, optimized for a workload)
    blt                BLT strategies C (Toeplitz, ℓ buffers): sensitivity under min-separation, optimization
    noise              privatizers: streaming independent / BandMF / BLT Gaussian noise
    aggregation        the DP query: noisy sum over the fixed denominator B
    sampling           user samplers, each with its dp_accounting event
    accounting         ε with dp_accounting, the per-round ε schedule in O(T), calibrate_noise_multiplier, ledger
                       with budget
    calibration        the σ search on a mechanism (its event as a function of σ, accountant, δ), certified
    adaptive_clipping  quantile-tracking clip norm with its noise split
    optimizers         server optimizers as pure transforms: DP-FedAvg/SGD, DP-Adam(BC/W/W-BC), IME, STP, AdaGrad
    moment_estimation  the joint Gaussian query [Σu ; α·Σu²] of independent moment estimation
    diagnostics        ν̂ / ν̂ − Φ̂ summaries and update alignment (the seeds' figures)
    clip_hint          whether the noise, sized by ζ, drowns released updates far under ζ (costs no privacy)
    context            simulation vs deployment; non-private baselines only in simulations
    contribution       RoundPlan (what a round broadcasts) and Contribution (what a node sends back)
    round              the one private round: init_server, begin_round, finish_round (every engine)
    round_loop         the one round loop of every engine: budget, checkpoints, evaluation, results.json
    records            the keys of a round's record (the docs' table is generated from them)
    checkpoint         atomic checkpoints of the server state and resuming from them
    folder_lock        one run per checkpoint folder: a lock the system releases when its holder dies
    run_setup          what a checkpoint records of its run (optimizer, local training, seed, model) and a resume
                       may not change
    randomness         OS entropy, independent derived seeds, the Gaussian noise sources
    audit              the statistics of the one-run privacy audit (ε estimate and lower bound)
    cli                the accounting commands of fed-dp (epsilon, calibrate)
    validation, atomic shared argument checks, atomic file writes
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name → (module, attribute); attribute None: the module itself.
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "Task": ("fed_dp.clients.task", "Task"),
    "Users": ("fed_dp.clients.task", "Users"),
    "Examples": ("fed_dp.clients.task", "Examples"),
    "load_task": ("fed_dp.clients.task", "load_task"),
    "build_task": ("fed_dp.clients.task", "build_task"),
    "losses": ("fed_dp.clients.losses", None),
    "evaluation": ("fed_dp.clients.evaluation", None),
    "PrivacyConfig": ("fed_dp.config", "PrivacyConfig"),
    "LocalTraining": ("fed_dp.config", "LocalTraining"),
    "AdaptiveClipConfig": ("fed_dp.adaptive_clipping", "AdaptiveClipConfig"),
    "RunConfig": ("fed_dp.run_config", "RunConfig"),
    "RunPlan": ("fed_dp.plan", "RunPlan"),
    "make_optimizer": ("fed_dp.optimizers", "make_optimizer"),
    "OPTIMIZERS": ("fed_dp.optimizers", "OPTIMIZERS"),
    "epsilon": ("fed_dp.accounting", "epsilon"),
    "epsilon_schedule": ("fed_dp.accounting", "epsilon_schedule"),
    "calibrate_noise_multiplier": ("fed_dp.accounting", "calibrate_noise_multiplier"),
    "resolve_privacy": ("fed_dp.accounting", "resolve_privacy"),
    "train": ("fed_dp.simulations.engine.inprocess", "train"),
    "TrainResult": ("fed_dp.simulations.engine.inprocess", "TrainResult"),
    "TrainingStopped": ("fed_dp.round_loop", "TrainingStopped"),
    "CheckpointWriteError": ("fed_dp.round_loop", "CheckpointWriteError"),
    "FolderInUseError": ("fed_dp.folder_lock", "FolderInUseError"),
    "UserLevelDP": ("fed_dp.server.flower_strategy", "UserLevelDP"),
    "DPResult": ("fed_dp.server.flower_strategy", "DPResult"),
    "model_arrays": ("fed_dp.server.flower_strategy", "model_arrays"),
    "centralized_evaluation": ("fed_dp.server.flower_strategy", "centralized_evaluation"),
    "LocalTrainer": ("fed_dp.clients.node", "LocalTrainer"),
    "train_reply": ("fed_dp.clients.replies", "train_reply"),
    "query_reply": ("fed_dp.clients.replies", "query_reply"),
    "hosted_users": ("fed_dp.clients.replies", "hosted_users"),
    "client_app": ("fed_dp.clients.app", "app"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'fed_dp' has no attribute {name!r}")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_PUBLIC))
