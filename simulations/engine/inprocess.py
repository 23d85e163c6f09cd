"""The in-process simulator: ``fed_dp.train(task, privacy, optimizer, local)`` trains a task with user-level DP.

    result = fed_dp.train(task, PrivacyConfig(expected_cohort=10, rounds=100, target_epsilon=3.0, delta=1e-5),
                          optimizer="dp-adambc", local=LocalTraining(batch_size=16, lr=0.1), seed=0)
    print(result.epsilon, result.records[-1])   # the last round's record; fed_dp.records lists every key

It runs the one round loop of every engine (``fed_dp.round_loop.run_rounds``: budget, checkpoints,
stop conditions, evaluation) with one difference from a Flower run: the plan reaches the users by a function
call instead of messages. This process acts as one node hosting every user: ``fed_dp.clients.node.LocalTrainer``
(the class a ClientApp uses) trains the sampled users — without a model per user when their update is one
gradient step, else vectorized over users on CUDA and one at a time on the CPU — and replies with the sum of their clipped updates and their count. Noise, the fixed denominator, the
optimizer and the accounting all happen in ``fed_dp.round``; nothing DP-critical is re-implemented here.

Under ``torchrun`` (an initialized ``torch.distributed`` group of several processes) rank 0 runs the loop and
every rank trains a share of each cohort (``fed_dp.simulations.engine.distributed``).

Users train on ``device``, and the server's step runs there too (``init_server(device=...)``): the noise is drawn on
the device (the torch source's own generator there; the secure source's keystream made ahead on the CPU and copied),
the sums, the optimizer and its state and the diagnostics stay on it, so nothing of d crosses to the host in a round
but what is published (a few numbers) and the checkpoints. In-memory users are moved to the device once per run.
(Under torchrun the workers' shares are gathered on rank 0's device as before.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fed_dp.accounting import resolve_privacy
from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.checkpoint import recorded_run
from fed_dp.clients.evaluation import evaluate_params, load_params
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.training_paths import path_metrics
from fed_dp.clients.task import Task, initial_model, model_fingerprint
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import ServerOptimizer, make_optimizer
from fed_dp.randomness import derive_seed, entropy_seed
from fed_dp.contribution import RoundPlan
from fed_dp.round import ServerState, init_server
from fed_dp.round_loop import RoundReplies, TrainingStopped, run_rounds
from fed_dp.plan import RunPlan
from fed_dp.run_config import (CLIENT_DEFAULTS, OPTIMIZER_DEFAULTS, RUN_DEFAULTS, SERVER_DEFAULTS, ClientSettings,
                               resolve_noise_source)
from fed_dp.run_setup import describe_run
from fed_dp.simulations.engine.progress import RoundProgress
from fed_dp.simulations.engine.distributed import Workers, current_workers, exchange_round, serve_rounds, share_seed, stop_workers

__all__ = ["TrainResult", "run_plan", "train"]


@dataclass
class TrainResult:
    """A finished simulation: the trained model, the user-level ε spent at δ (``"not private"`` for the
    noiseless baselines), the resolved privacy config (σ after calibration), one record per round, why the
    run stopped early (the ε budget) if it did, and the final server state.

    Records: one per released round t = 1 … T (``"round": t``), preceded, when the task evaluates, by the record
    of round 0 (the initial model's evaluation, ε 0). Public keys: ``round``, ``epsilon``, ``delta``,
    ``update_norm``, the optimizer's diagnostics, ``clip_norm`` / ``next_clip_norm`` (adaptive clipping) and the
    evaluation's metrics. What is computed from users' data outside the mechanism is kept under keys prefixed
    ``nonprivate_``: ``nonprivate_cohort_size``, ``nonprivate_train_loss``, ``nonprivate_fraction_clipped``,
    ``nonprivate_mean_update_norm``, ``nonprivate_round_seconds`` and the others of ``fed_dp.records.RECORD_KEYS``
    (the table of every key); they stay in memory and in the checkpoint's secret part, and ``results.json`` and
    the public checkpoint never hold them.
    """

    model: nn.Module
    params: torch.Tensor
    epsilon: float | str
    delta: float
    privacy: PrivacyConfig
    records: list[dict[str, Any]]
    stopped: str | None
    state: ServerState | None  # None on the ranks other than 0 of a distributed run (the noise state stays on 0)


def _progress(rounds: int, on_round: Callable[[dict[str, Any]], None] | None):
    """A progress display of the rounds (a bar on a terminal, plain lines in a log) and the ``on_round`` that
    feeds it, then calls the caller's."""
    bar = RoundProgress(rounds)

    def step(record: dict[str, Any]) -> None:
        bar.update(record)
        if on_round is not None:
            on_round(record)

    return bar, step


def train(
    task: Task,
    privacy: PrivacyConfig,
    optimizer: ServerOptimizer | str = OPTIMIZER_DEFAULTS.name,
    local: LocalTraining | None = None,
    *,
    adaptive_clipping: AdaptiveClipConfig | None = None,
    seed: int | None = None,
    training_seed: int | None = None,
    eval_every: int = RUN_DEFAULTS.eval_every,
    device: str | torch.device = CLIENT_DEFAULTS.device,
    training: str = CLIENT_DEFAULTS.training,
    chunk_size: int | None = CLIENT_DEFAULTS.chunk_size,
    checkpoint_dir: str | None = None,
    max_empty_rounds: int = SERVER_DEFAULTS.max_empty_rounds,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = False,
    noise_source: str = SERVER_DEFAULTS.noise_source,
    on_phase: Callable[[str, int], None] | None = None,
) -> TrainResult:
    """Train ``task`` with user-level DP in this process; returns the model, ε and one record per round.

    privacy: the mechanism; ``num_users`` may be left unset (the task's population is used; if set it must
        match), and ``target_epsilon`` instead of ``noise_multiplier`` calibrates σ first.
    optimizer: a server optimizer or its name (``fed_dp.optimizers.OPTIMIZERS``; the noiseless baselines
        are allowed here, in a simulation, and report ``"not private"``).
    local: local training of each user (default ``LocalTraining()``).
    seed: None (model, sampler, noise and local training from OS entropy) or an int in 0 … 2^63 − 1: a
        reproducible research run.
    training_seed: seeds only the model's initialization and the users' local training (default: ``seed``); the
        sampler and the noise still come from ``seed``. ``fed-dp simulate`` without ``run.seed`` writes this seed
        to its results and keeps ``seed`` (the cohorts and the noise) in memory only. With neither, a run that
        resumes a checkpoint takes the seed the checkpointed run drew.
    eval_every: evaluate with ``task.evaluate`` the initial model (round 0), every round t with t % k == 0 and the
        last round (0: never).
    device / training / chunk_size: where and how users train (``LocalTrainer``).
    checkpoint_dir: save every round there and resume from it. The run owns the folder while it runs (a second
        run on it is refused, naming this one) and records the optimizer, local training, seed, model, noise
        source and adaptive clipping there: a resume that changes any of them, or the privacy configuration, is
        refused with a ValueError before anything is released (``fed_dp.run_setup``).
    on_round: called with every round's record; ``progress``: show a progress bar.
    noise_source: ``"torch"`` (seeded: reproducible), ``"secure"`` (AES-CTR from OS entropy; needs seed=None) or
        ``"auto"`` (``server.noise-source``'s default: torch in a simulation).
    on_phase: called at each phase boundary of a round (``fed_dp.round_loop.PHASES``).

    The records (one per round, and round 0's evaluation): :class:`TrainResult`.
    A user whose examples fail to load or whose training raises stops the run with
    ``fed_dp.round_loop.TrainingStopped``, naming the round and the user, before that round is released; the
    model after the last released round is the error's ``result`` (a TrainResult) and, with ``checkpoint_dir``,
    committed there. A failure that is not one user's (every user tried fails alone, or only training them together
    fails) in the first round is a configuration error instead: ValueError, with the original error as its cause.

    The keywords are validated once, into one ``fed_dp.plan.RunPlan`` (the placement of users into a ``[client]``
    section), whose privacy is then resolved once; :func:`run_plan` runs it.
    """
    if not isinstance(task, Task):
        raise ValueError(f"train needs a fed_dp.Task, got {type(task).__name__}")
    client = ClientSettings(device=device, training=training, chunk_size=chunk_size)
    with simulation():  # the noiseless baselines are built here, in a simulation
        plan = RunPlan(privacy=privacy, optimizer=make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer,
                       local=local if local is not None else LocalTraining(), adaptive_clipping=adaptive_clipping,
                       seed=seed, training_seed=training_seed,
                       noise_source=resolve_noise_source(noise_source, flower_run=False, seeded=seed is not None),
                       checkpoint_dir=checkpoint_dir, eval_every=eval_every, max_empty_rounds=max_empty_rounds)
    # validated above, resolved once here (σ calibrated for a target ε), then passed on; under torchrun by rank 0
    # alone, the process that runs the rounds (the other ranks only train: run_plan does not read their privacy)
    workers = current_workers()
    if workers is None or workers.leader:
        plan = replace(plan, privacy=resolve_privacy(plan.privacy, task.num_users))
    return run_plan(task, plan, client, on_round=on_round, progress=progress, on_phase=on_phase)


def run_plan(task: Task, plan: RunPlan, client: ClientSettings = CLIENT_DEFAULTS, *,
             on_round: Callable[[dict[str, Any]], None] | None = None, progress: bool = False,
             on_phase: Callable[[str, int], None] | None = None) -> TrainResult:
    """Run a built plan (``fed_dp.plan.RunPlan``) on ``task`` in this process, users placed as ``client`` says
    (``[client]``: device, training path, chunk size): what :func:`train` does once it has built the plan from its
    keywords, and what ``fed-dp simulate`` calls with the plan of each optimizer.

    The plan's privacy must be resolved (``fed_dp.accounting.resolve_privacy``: :func:`train` does it once, and
    ``fed-dp simulate`` once for all its optimizers), for this task's population N; under torchrun on rank 0, which
    runs the rounds (the other ranks only train and take rank 0's result). Everything else is as
    :func:`train` says."""
    if not isinstance(task, Task):
        raise ValueError(f"run_plan needs a fed_dp.Task, got {type(task).__name__}")
    if not isinstance(plan, RunPlan):
        raise ValueError(f"run_plan needs a fed_dp.plan.RunPlan, got {type(plan).__name__}")
    workers = current_workers()  # under torchrun: rank 0 runs the loop, every rank trains a share of the cohort
    privacy = plan.privacy
    if workers is None or workers.leader:  # the other ranks only train: they never read the privacy
        privacy = privacy.require_resolved("run_plan")
        if privacy.num_users != task.num_users:
            raise ValueError(f"the plan's privacy was resolved for N = {privacy.num_users} users but the task has "
                             f"{task.num_users}; resolve it with this task's population")
    local = plan.local if plan.local is not None else LocalTraining()
    seed, checkpoint_dir = plan.seed, plan.checkpoint_dir
    with simulation():
        run_seed = _run_seed(seed, plan.training_seed, checkpoint_dir, workers)
        client_seed = derive_seed(run_seed, "local-training")  # independent of the sampler's and the noise's
        model, layout, params = initial_model(task, run_seed)
        # built from the same seed: its frozen parameters are the initial model's
        trainer = LocalTrainer(task, local, device=client.device, training=client.training,
                               chunk_size=client.chunk_size, seed=run_seed)
        if workers is not None and not workers.leader:
            served = serve_rounds(workers, trainer, params, client_seed)
            return _worker_result(workers, model, layout, served)
        state = init_server(privacy, plan.optimizer, params, seed=seed, adaptive_clipping=plan.adaptive_clipping,
                            noise_source=plan.noise_source, device=trainer.device)
        exchange = _exchange(trainer, workers, client_seed)
        evaluate = None
        if task.evaluate is not None:
            evaluate = lambda rounds_done, theta: evaluate_params(  # noqa: E731
                trainer.model, trainer.layout, theta.to(trainer.device), task.evaluate)
        bar, step = _progress(privacy.rounds, on_round) if progress else (None, on_round)
        setup = describe_run(optimizer=plan.optimizer, adaptive=None if state.clipper is None else state.clipper.config,
                             noise_source=plan.noise_source, seed=run_seed, model=model_fingerprint(model),
                             local=local) if checkpoint_dir else None
        try:
            loop = run_rounds(state, exchange, evaluate=evaluate, eval_every=plan.eval_every,
                              checkpoint_dir=checkpoint_dir, max_empty_rounds=plan.max_empty_rounds, on_round=step,
                              on_phase=on_phase, setup=setup)
        except TrainingStopped as stop:  # the model after the last released round comes back with the error
            stop.result = _stopped_result(model, layout, privacy, stop)
            _release_workers(workers)
            raise
        except BaseException:
            _release_workers(workers)
            raise
        finally:
            if bar is not None:
                bar.close()
    if workers is not None:
        stop_workers(workers)
    result = _result(model, layout, privacy, loop.state, loop.records, loop.stopped)
    if workers is not None:
        dist.broadcast_object_list([_public(result)], src=0)
    return result


def _run_seed(seed: int | None, training_seed: int | None, checkpoint_dir: str | None, workers: Workers | None) -> int:
    """The seed of the model and local training: ``training_seed``, else ``seed``, else drawn (or a resumed
    checkpoint's); under torchrun rank 0's, shared with every rank."""
    run_seed = training_seed if training_seed is not None else seed if seed is not None else _drawn_seed(
        checkpoint_dir if workers is None or workers.leader else None)
    if workers is not None:
        run_seed = share_seed(workers, run_seed)
    return run_seed


def _release_workers(workers: Workers | None) -> None:
    """Under torchrun, after the loop failed: the other ranks stop (between rounds they wait for a header, then for
    the result, which is None)."""
    if workers is not None:
        stop_workers(workers)
        dist.broadcast_object_list([None], src=0)


def _drawn_seed(checkpoint_dir: str | None) -> int:
    """The seed of the model and local training of a run given none: the one the run checkpointed in
    ``checkpoint_dir`` drew, when it resumes one (its frozen parameters and its local training then continue as
    if uninterrupted, and the resume matches the recorded description, ``fed_dp.run_setup``), else one from OS
    entropy."""
    recorded = recorded_run(checkpoint_dir) if checkpoint_dir else None
    setup = recorded[1] if recorded is not None else None
    return setup["seed"] if setup is not None and setup.get("seed") is not None else entropy_seed()


def _exchange(trainer: LocalTrainer, workers: Workers | None, client_seed: int) -> Callable[[RoundPlan], RoundReplies]:
    """The loop's exchange in this process: the trainer trains the whole cohort (under torchrun, rank 0's share,
    the other ranks theirs: :func:`~fed_dp.simulations.engine.distributed.exchange_round`)."""

    def exchange(plan: RoundPlan) -> RoundReplies:
        if workers is not None:
            return exchange_round(workers, trainer, plan, client_seed)
        result, metrics, path = trainer.contribution(plan, plan.cohort.tolist(), seed=client_seed,
                                                     source="simulation")
        # train_loss, mean_update_norm, fraction_clipped, and the path that ran: which users were sampled
        # decides it (one step or not), and an empty cohort never falls back from the vectorized path
        return RoundReplies([result], nonprivate={**metrics, **path_metrics(path)})

    return exchange


def _result(model: nn.Module, layout: Any, privacy: PrivacyConfig, state: Any, records: list[dict[str, Any]],
            stopped: str | None) -> TrainResult:
    """The run's TrainResult: ``model`` loaded with the state's θ, ε of the last record (0 before any)."""
    params = state.params.detach().cpu()  # the released model, on the host whatever device the server stepped on
    load_params(model, layout, params)
    final = records[-1] if records else {}
    return TrainResult(model=model, params=params, epsilon=final.get("epsilon", 0.0), delta=privacy.delta,
                       privacy=privacy, records=records, stopped=stopped, state=state)


def _stopped_result(model: nn.Module, layout: Any, privacy: PrivacyConfig, stop: TrainingStopped) -> TrainResult:
    """The run of ``stop`` up to its last released round, as a TrainResult (its ``stopped`` says why)."""
    return _result(model, layout, privacy, stop.state, stop.records, str(stop))


def _public(result: TrainResult) -> dict[str, Any]:
    """What rank 0 shares with the other ranks at the end: the released model and records, never the server
    state (noise seed and generator state stay on rank 0)."""
    return {"params": result.params, "epsilon": result.epsilon, "delta": result.delta, "privacy": result.privacy,
            "records": result.records, "stopped": result.stopped}


def _worker_result(workers: Workers, model: nn.Module, layout: Any, served: int) -> TrainResult:
    """A worker's TrainResult: rank 0's released model and records (``state`` is None: it stays on rank 0)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    shared = box[0]
    if shared is None:  # rank 0 failed before the end: its own exception says why
        raise RuntimeError(f"rank {workers.rank}: rank 0 stopped the run after {served} round(s); see its error")
    load_params(model, layout, shared["params"])
    return TrainResult(model=model, state=None, **shared)
