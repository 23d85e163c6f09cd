"""The one round loop: every engine — the Flower Strategy and the in-process simulator — runs its rounds here.

    resume from the checkpoint folder (if it holds a committed checkpoint)
    a fresh run evaluates the initial model: the record of round 0 (ε 0, nothing released yet)
    for each remaining round t = 1 … T (round t is the t-th release):
        plan            = begin_round(state)        # refuses a round over the ε budget (the run then ends)
        replies         = exchange(plan)            # Flower messages, or local training in this process
        state, metrics  = finish_round(state, plan, replies.contributions)
                          (an exchange that aggregates, as Flower's aggregate_train does, calls this step
                           itself, once; if it returns without doing so, the loop does it: no round skips it)
        checkpoint      (public and secret parts committed atomically, before anything of round t is
                         evaluated, logged or handed to the caller)
        stop with NoRepliesError after ``max_empty_rounds`` rounds in a row in which users were sampled but
            none was counted: the budget is not spent on noise alone
        evaluate when t % eval_every == 0 and after the last round; mark the round published in published.json
            with its evaluated record (atomic); then log ε and hand the record to ``on_round``
        (a resumed run publishes a round committed but not marked published, evaluating it again from the
         committed state, and restores the evaluation of the round marked last: across a crash at any
         point every round is evaluated and in results.json once, and handed out at most once, exactly once
         unless the kill falls between its mark and its log line)
    write results.json

A run owns its checkpoint folder while it runs (``fed_dp.folder_lock``) and records with every commit the
description of the run (``fed_dp.run_setup``) that a resume must match.

What is published — results.json, logs, the public checkpoint — holds only what went through the accounted
mechanism or is public anyway: ε, δ, the update norm, the optimizer's diagnostics (post-processing), adaptive
clipping's ζ_t, evaluation on the server's held-out data. What is computed from users' data outside the
mechanism is not: exact counts (cohort size, replies, clipped users), local training losses, which nodes
failed, and the round's duration (it grows with the cohort: about 10 ms per user in process, and it shows
which node missed the deadline). It goes to the operator's ``secret/diagnostics.jsonl`` in the checkpoint
folder, in every engine; a simulation (``fed_dp.context.simulation()``) also keeps it in the records it
returns, under names starting ``nonprivate_``, and in the checkpoint's secret part, never in a published file.
Every key of a record, public or secret, with when it is present: ``fed_dp.records.RECORD_KEYS``.

The engines differ only in ``exchange`` (how the plan reaches users and their contributions come back) and in
``evaluate``; all DP math is in ``fed_dp.round``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fed_dp.accounting import BudgetExceededError, accounting_note, epsilon_schedule
from fed_dp.atomic import WriteError, reporting_writes, write_atomically
from fed_dp.checkpoint import (DIAGNOSTICS_NAME, RESULTS_NAME, SECRET_FOLDER, append_diagnostics, mark_published,
                               operator_log_file, read_diagnostics, read_published, repair_diagnostics,
                               resume_with_secret, save_checkpoint)
from fed_dp.clip_hint import ClipHint
from fed_dp.config import PrivacyConfig
from fed_dp.context import in_simulation, reported_epsilon
from fed_dp.contribution import Contribution, RoundPlan, UserTrainingError
from fed_dp.folder_lock import owning
from fed_dp.round import ServerState, begin_round, finish_round
from fed_dp.run_config import RUN_DEFAULTS, SERVER_DEFAULTS
from fed_dp.run_setup import SETUP_KEY

log = logging.getLogger("fed_dp.server")
#: Operator-only details of each round (which nodes failed or were late, how many sampled users were dropped): not
#: printed; in a deployment with a checkpoint folder they go to secret/operator.log (and, as numbers, to
#: secret/diagnostics.jsonl), for the operator alone.
private_log = logging.getLogger("fed_dp.private")
private_log.propagate = False
private_log.addHandler(logging.NullHandler())

#: The phase boundaries of a round, in order, at which ``run_rounds`` calls ``on_phase(phase, t)`` (t = 1 … T).
PHASES = ("sampled", "replied", "aggregated", "saved", "evaluated", "published")


class NoRepliesError(RuntimeError):
    """Several rounds in a row sampled users but counted none of them: the run stops before spending more."""


class TrainingStopped(RuntimeError):
    """A user failed to load or train (:class:`~fed_dp.contribution.UserTrainingError`, its ``__cause__``): the run
    stopped before releasing that round, so nothing of the partly trained round left this process and no budget
    was spent on it. ``state`` and ``records`` are the run after the last released round (the model so far; an
    engine may attach its own ``result``); with a checkpoint folder, that round is committed there."""

    def __init__(self, failure: UserTrainingError, state: ServerState, records: list[dict[str, Any]],
                 checkpoint_dir: str | Path | None) -> None:
        self.failure, self.state, self.records = failure, state, records
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        spent = _format_epsilon(records[-1]["epsilon"]) if records else "0"
        kept = (f"saved in {checkpoint_dir} (start the run again with it to resume, once the user's data or the "
                "task is fixed)" if checkpoint_dir else "returned with this error (its .result, or .state.params)")
        super().__init__(f"{failure}. The run stopped before releasing round {failure.round_number}: nothing of it "
                         f"was released; {state.round} round(s) were released before it (epsilon so far {spent}), and the model after "
                         f"round {state.round} is {kept}")


class CheckpointWriteError(WriteError):
    """Writing to the checkpoint folder failed during a run (a full disk, a folder made read-only): the run stopped
    there. What was committed stays, and nothing uncommitted was released (a round is handed out only after its
    commit), so the run resumes from the folder once the cause is fixed; the message says what became of the
    round."""


def _writing(checkpoint_dir: str | Path, what: str) -> Any:
    """:func:`fed_dp.atomic.reporting_writes` for the checkpoint folder: a failed write in the block stops the run
    with :class:`CheckpointWriteError` saying ``what`` became of it and how to resume."""
    return reporting_writes(f"{what}. Fix the cause (free space on its disk, make the folder writable) and start the "
                            "run again with the same checkpoint folder: it resumes there", checkpoint_dir,
                            CheckpointWriteError)


def _exchange_or_stop(exchange: Callable[[], "RoundReplies"], state: ServerState, records: list[dict[str, Any]],
                      checkpoint_dir: str | Path | None) -> "RoundReplies":
    """``exchange()`` (the round's exchange, bound to its plan); a user who failed to load or train stops the run
    (:class:`TrainingStopped`) rather than releasing a round without that user's contribution or repeating the
    failure round after round. A failure that is not any one user's (``UserTrainingError.not_the_users``: the task's
    loss, model or data loader, or the training path, fail for every user tried) before the first release is a
    configuration error: a ValueError, with the original error as its cause, as the other configuration errors."""
    try:
        return exchange()
    except UserTrainingError as failure:
        if failure.not_the_users and state.round == 0:
            raise ValueError(
                f"the task does not train: {failure} ({failure.not_the_users}). It is not one user's data but the "
                "task's model, loss or data loading, or the local training settings (local.*, client.training); fix "
                "them and run again. Nothing was released and no privacy budget was spent") from failure.original
        raise TrainingStopped(failure, state, records, checkpoint_dir) from failure


@dataclass
class RoundReplies:
    """What came back for a plan: the contributions; ``metrics``, public numbers of the exchange (e.g. which
    training path ran); ``nonprivate``, what depends on who was sampled or on users' data outside the
    mechanism: which nodes failed and why (``dropped``, with counts; ``failures``, without), counts, local
    training losses."""

    contributions: list[Contribution]
    metrics: dict[str, float] = field(default_factory=dict)
    nonprivate: dict[str, Any] = field(default_factory=dict)


Exchange = Callable[[RoundPlan], RoundReplies]
#: The core round on an exchange's replies (``finish_round``: re-clip, sum, noise, ÷B, optimizer step, ledger), given
#: to an exchange that aggregates (``run_rounds(..., exchange_aggregates=True)``); callable once per round. Returns
#: the new state and the round's public metrics.
Aggregate = Callable[[RoundReplies], tuple[ServerState, dict[str, Any]]]


@dataclass
class LoopResult:
    state: ServerState
    records: list[dict[str, Any]]
    stopped: str | None = None  # why the run ended before its last round (the ε budget), else None


def _why_no_replies(nonprivate: dict[str, Any], checkpoint_dir: str | None, simulated: bool) -> str:
    """The reasons of the last empty round for NoRepliesError. In a deployment with a checkpoint folder they stay
    in the operator's log (which nodes were asked depends on who was sampled, and an exception's text reaches the
    run's public status); without one there is no such log, so the message carries the first reason the nodes
    gave and how many failed — the operator's only way to learn why the run stopped — with every user id in it
    replaced by ``user <sampled>`` (:func:`_without_user_ids`): that a given user was sampled in a round is the
    secret that sampling keeps."""
    failures = nonprivate.get("failures", [])
    if simulated:
        return f"Why: {'; '.join(failures) or 'no replies'}"
    if checkpoint_dir:
        return f"Why, per node and round: {operator_log_file(checkpoint_dir)} (kept out of this message because " \
               "which nodes were asked depends on who was sampled)"
    first = (f"the first of {len(failures)} failure(s) of the last round: {_without_user_ids(failures[0])}"
             if failures else "no replies")
    return (f"Why: {first} (with server.checkpoint-dir set, every node's reason of every round goes to the "
            "operator's secret/operator.log instead of this message)")


def _without_user_ids(reason: str) -> str:
    """``reason`` with every ``user <number>`` (and ``users/<number>``, a path named after a user) replaced by
    ``user <sampled>``: a node's failure names the sampled user it failed on, which must not reach a public
    message."""
    return _USER_ID.sub(lambda match: f"{match.group(1)}<sampled>", reason)


_USER_ID = re.compile(r"(\buser[ _/#:=]*|\busers/)\d+")

NONPRIVATE = "nonprivate_"


def public_record(record: dict[str, Any]) -> dict[str, Any]:
    """What of a record may be published: every key but the ``nonprivate_`` ones."""
    return {key: value for key, value in record.items() if not key.startswith(NONPRIVATE)}


def nonprivate_part(record: dict[str, Any]) -> dict[str, Any]:
    """The ``nonprivate_`` keys of a record (a simulation's exact counts): they go to the secret part only."""
    return {key: value for key, value in record.items() if key.startswith(NONPRIVATE)}


def _write_results(folder: str | Path, records: list[dict[str, Any]]) -> None:
    """``results.json``: the published records (no ``nonprivate_`` key), written atomically."""
    text = json.dumps([public_record(record) for record in records], indent=1, default=str)
    write_atomically(Path(folder) / RESULTS_NAME, lambda handle: handle.write(text.encode()))


def _restore_diagnostics(folder: str | Path, last: dict[str, Any] | None) -> None:
    """Append the committed round's diagnostics (kept in the secret part) when a crash came between the commit
    and their append to ``secret/diagnostics.jsonl``, or during it: a torn last line is cut off first
    (``fed_dp.checkpoint.repair_diagnostics``), with a warning."""
    if repair_diagnostics(folder):
        log.warning("%s ended with a torn line (the process died while appending it); it was cut off and the "
                    "committed round's diagnostics are written again", Path(folder) / SECRET_FOLDER / DIAGNOSTICS_NAME)
    if last is not None and all(written["round"] != last["round"] for written in read_diagnostics(folder)[-1:]):
        append_diagnostics(folder, last)


def _evaluate_now(round_number: int, rounds: int, eval_every: int) -> bool:
    """Whether round t (1 … ``rounds``) is evaluated: t a multiple of ``eval_every``, or the last round."""
    return eval_every > 0 and (round_number % eval_every == 0 or round_number == rounds)


def initial_record(state: ServerState, evaluation: dict[str, float]) -> dict[str, Any]:
    """The record of round 0: the initial model's evaluation, before any release (ε 0, as Flower's
    ``evaluate(0, ...)`` before round 1)."""
    record = {"round": 0, "epsilon": reported_epsilon(0.0, state.optimizer.private), "delta": state.config.delta}
    if state.config.non_private:
        record.update(epsilon=reported_epsilon(math.inf, False), non_private=True)
    return {**record, **evaluation}


def _format_epsilon(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.4f}"


def _aggregate_once(state: ServerState, plan: RoundPlan,
                    finished: list[tuple[RoundReplies, ServerState, dict[str, Any]]]) -> Aggregate:
    """The :data:`Aggregate` of one round: ``finish_round`` on the replies, kept in ``finished``; a second call
    is refused (one noise draw and one ledger entry per round)."""
    def aggregate(replies: RoundReplies) -> tuple[ServerState, dict[str, Any]]:
        if finished:
            raise RuntimeError(f"round {plan.round + 1} is already aggregated: the core round runs once per round")
        new_state, metrics = finish_round(state, plan, replies.contributions)
        finished.append((replies, new_state, metrics))
        return new_state, {key: value for key, value in metrics.items() if key != "nonprivate"}

    return aggregate


def run_rounds(
    state: ServerState,
    exchange: Exchange | Callable[[RoundPlan, Aggregate], RoundReplies],
    *,
    rounds: int | None = None,
    evaluate: Callable[[int, torch.Tensor], dict[str, float]] | None = None,
    eval_every: int = RUN_DEFAULTS.eval_every,
    checkpoint_dir: str | Path | None = None,
    max_empty_rounds: int = SERVER_DEFAULTS.max_empty_rounds,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_phase: Callable[[str, int], None] | None = None,
    exchange_aggregates: bool = False,
    setup: dict[str, Any] | None = None,
) -> LoopResult:
    """Run rounds until ``rounds`` (default: the planned T) have been released, the budget refuses one, or
    replies stop coming. Returns the final state, one record per released round (``"round"``: t = 1 … T) and
    why it stopped early; with ``evaluate`` and ``eval_every > 0`` a fresh run's records start with round 0, the
    evaluation of the initial model (:func:`initial_record`).

    ``evaluate(t, params)`` gets the flat θ after round t: t = 0 (the initial model, in a fresh run), t a
    multiple of ``eval_every`` and the last round; ``on_round(record)`` is called after each released round
    (progress bars; not for round 0); ``on_phase(phase, t)``
    at each boundary of :data:`PHASES` (instrumentation, fault injection). Raises :class:`NoRepliesError`
    (after saving the checkpoint, so the run can be resumed) when ``max_empty_rounds`` rounds in a row
    sampled users but counted none.

    ``exchange_aggregates``: ``exchange(plan, aggregate)`` gets the round's :data:`Aggregate` and may call it
    (the Flower Strategy's ``aggregate_train`` does); the loop calls it on the returned replies when the exchange
    did not, so that every round the loop releases went through ``finish_round`` exactly once.

    With ``checkpoint_dir`` the run owns the folder while it runs (``fed_dp.folder_lock``: a second run on it gets
    ``FolderInUseError`` naming this one, before anything is resumed); ``setup`` (``fed_dp.run_setup.describe_run``)
    is recorded with every commit, and a resume whose privacy configuration or ``setup`` differs from the recorded
    ones is refused with a ValueError naming each difference. A write to the folder that fails (a full disk) stops
    the run with :class:`CheckpointWriteError`, after which it resumes from what was committed.
    """
    rounds = state.config.rounds if rounds is None else rounds
    if not 1 <= rounds <= state.config.rounds:
        raise ValueError(f"rounds must be in 1..{state.config.rounds} (the rounds the privacy plan accounts for), "
                         f"got {rounds}")
    phase = on_phase if on_phase is not None else (lambda name, index: None)
    with owning(checkpoint_dir) if checkpoint_dir else nullcontext():  # one run per folder (fed_dp.folder_lock)
        _announce_plan(state.config)
        publisher = _Publisher(rounds, evaluate, eval_every, checkpoint_dir, on_round, phase)
        records = _resumed_records(state, checkpoint_dir, publisher, setup) if checkpoint_dir else []
        try:
            loop = _rounds(state, exchange, rounds, evaluate, eval_every, checkpoint_dir, max_empty_rounds, publisher,
                           phase, exchange_aggregates, setup, records)
        except BaseException:
            if checkpoint_dir:  # a run that stopped: the records so far, if they can be written, never hiding why
                try:
                    _write_results(checkpoint_dir, records)
                except OSError as error:
                    log.error("%s could not be written (%s); the committed rounds are in the checkpoint",
                              Path(checkpoint_dir) / RESULTS_NAME, error)
            raise
        if checkpoint_dir:
            with _writing(checkpoint_dir, f"{RESULTS_NAME} after round {loop.state.round}, which is committed (start "
                          "the run again with the same folder to write it)"):
                _write_results(checkpoint_dir, records)
        return loop


def _rounds(state: ServerState, exchange: Any, rounds: int, evaluate: Any, eval_every: int,
            checkpoint_dir: str | Path | None, max_empty_rounds: int, publisher: "_Publisher",
            phase: Callable[[str, int], None], exchange_aggregates: bool, setup: dict[str, Any] | None,
            records: list[dict[str, Any]]) -> LoopResult:
    """The rounds of :func:`run_rounds` after the resume: round 0's evaluation in a fresh run, then each round
    until ``rounds`` are released or the budget refuses one (``records`` grows in place)."""
    simulated = in_simulation()
    if state.round == 0 and evaluate is not None and eval_every > 0:  # a fresh run: the initial model first
        evaluation = evaluate(0, state.params)
        if evaluation:  # an evaluation that returns nothing (a task without one) leaves no record
            records.append(initial_record(state, evaluation))
    operator_log = _open_operator_log(checkpoint_dir) if checkpoint_dir and not simulated else None
    stopped, empty = None, 0
    config = state.config
    hint = ClipHint(state.params.numel(), config.noise_multiplier * config.clip_norm / config.expected_cohort,
                    config.clip_norm) if not config.non_private else None
    try:
        while state.round < rounds:
            started = time.perf_counter()
            try:
                plan = begin_round(state)  # refuses, before sampling, a round that would exceed the budget
            except BudgetExceededError as refusal:
                log.error("fed-dp stopped before round %d: %s", state.round + 1, refusal)
                stopped = str(refusal)
                break
            phase("sampled", plan.round + 1)
            state, metrics, nonprivate = _exchanged_and_aggregated(state, plan, exchange, exchange_aggregates,
                                                                   records, checkpoint_dir, phase)
            phase("aggregated", plan.round + 1)
            # sampling, exchange, server round: it grows with the cohort, so it is the operator's, not published
            nonprivate["round_seconds"] = time.perf_counter() - started
            if simulated:  # research runs on data the researcher holds: diagnostics stay in memory, marked
                metrics.update({f"{NONPRIVATE}{key}": value for key, value in nonprivate.items()})
            records.append(metrics)
            if checkpoint_dir:
                _commit(state, checkpoint_dir, records, nonprivate, setup)
            phase("saved", plan.round + 1)
            for problem in nonprivate.get("dropped", []):
                private_log.warning("round %d: %s", plan.round + 1, problem)
            empty = _empty_rounds(empty, nonprivate, max_empty_rounds, metrics, checkpoint_dir, simulated)
            publisher.publish(state, metrics)
            phase("published", plan.round + 1)
            if hint is not None and "noised_average_norm" in metrics:
                advice = hint.observe(metrics["noised_average_norm"], metrics["round"])
                if advice is not None:
                    log.warning("%s", advice)
    finally:
        if operator_log is not None:
            private_log.removeHandler(operator_log)
            operator_log.close()
    return LoopResult(state, records, stopped)


#: Above this user-level ε a run protects nobody (e^ε > 10⁴³): :func:`_announce_plan` warns, naming σ.
WEAK_EPSILON = 100.0


def _announce_plan(config: PrivacyConfig) -> None:
    """Before the first round: say what is unusual about the plan. A non-private baseline (σ = 0) is labelled so;
    an ε schedule that takes long to compute is announced (``fed_dp.accounting.accounting_note``; it is computed
    here, once, and round 1 needs it anyway); a plan whose ε (at most the budget) exceeds :data:`WEAK_EPSILON`
    is warned about, with σ and ε named: σ = 1e-30 is accepted (it is a valid σ, and tests use tiny ones for
    near-noiseless runs) but must not pass without a word."""
    if config.non_private:
        log.warning("noise_multiplier = 0: this run adds NO noise and has NO privacy (epsilon is infinite); it is a "
                    "non-private baseline, and every record and result is labelled non_private")
        return
    note = accounting_note(config.rounds, config.accountant)
    if note is not None:
        log.info("fed-dp: %s", note)
    planned = epsilon_schedule(config).epsilons[-1]
    reachable = min(planned, config.epsilon_budget if config.epsilon_budget is not None else math.inf)
    if reachable > WEAK_EPSILON:
        log.warning("noise_multiplier σ = %g (privacy.noise-multiplier) gives a user-level epsilon of %.4g after %d "
                    "rounds (at delta %g): this run protects nobody (e^epsilon > %.0e). For a non-private baseline "
                    "set σ = 0 (then labelled non-private); for a private run choose σ for a target epsilon "
                    "(privacy.target-epsilon, or fed-dp calibrate)", config.noise_multiplier, planned, config.rounds,
                    config.delta, math.exp(min(WEAK_EPSILON, 700.0)))


@dataclass(frozen=True)
class _Publisher:
    """How a committed round is handed out (:meth:`publish`): evaluated when due, marked published in the
    checkpoint folder, logged, given to ``on_round``."""

    rounds: int
    evaluate: Callable[[int, torch.Tensor], dict[str, float]] | None
    eval_every: int
    checkpoint_dir: str | Path | None
    on_round: Callable[[dict[str, Any]], None] | None
    phase: Callable[[str, int], None]

    def publish(self, state: ServerState, record: dict[str, Any]) -> None:
        """Evaluate a committed round; mark it published with its evaluated record (durable before anything is
        handed out, so a crash can neither lose the evaluation nor hand the round out twice); log it and hand
        it to ``on_round``."""
        if self.evaluate is not None and _evaluate_now(record["round"], self.rounds, self.eval_every):
            record.update(self.evaluate(state.round, state.params))
        self.phase("evaluated", record["round"])
        if self.checkpoint_dir:
            with _writing(self.checkpoint_dir, f"round {record['round']} is committed, but it could not be marked "
                          "published; it is evaluated and handed out when the run resumes"):
                mark_published(self.checkpoint_dir, public_record(record))
        log.info("round %d/%d: epsilon %s, delta %g", record["round"], self.rounds,
                 _format_epsilon(record["epsilon"]), record["delta"])
        if self.on_round is not None:
            self.on_round(record)


def _resumed_records(state: ServerState, checkpoint_dir: str | Path, publisher: _Publisher,
                     setup: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Resume ``state`` from the checkpoint folder when it holds one and return the records so far (public and
    secret parts joined); a round committed just before a crash and never marked published is published now
    (evaluated, handed out). A folder without a checkpoint: a fresh run, no records. A checkpoint of another
    configuration or ``setup`` is refused (``fed_dp.run_setup.check_resume``)."""
    restored = resume_with_secret(state, checkpoint_dir, setup)
    if restored is None:
        return []
    extra, secret_extra = restored
    hidden = secret_extra.get("records", [])
    records = [{**record, **(hidden[i] if i < len(hidden) else {})}
               for i, record in enumerate(extra.get("records", []))]
    log.info("resumed from %s at round %d (epsilon so far %.4g)", checkpoint_dir, state.round, state.ledger.epsilon)
    _restore_diagnostics(checkpoint_dir, secret_extra.get("diagnostics"))
    published = read_published(checkpoint_dir)
    if records and published is not None and published["round"] == records[-1]["round"]:
        records[-1].update(published["record"])  # its evaluation, done after its commit
    elif records:
        publisher.publish(state, records[-1])  # committed just before a crash, never marked published
    return records


def _open_operator_log(checkpoint_dir: str | Path) -> logging.FileHandler:
    """A deployment's operator log (``secret/operator.log``): the private logger's lines, which name nodes and
    sampled users, go there and nowhere public."""
    handler = logging.FileHandler(operator_log_file(checkpoint_dir), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    private_log.addHandler(handler)
    return handler


def _exchanged_and_aggregated(state: ServerState, plan: RoundPlan, exchange: Any, exchange_aggregates: bool,
                              records: list[dict[str, Any]], checkpoint_dir: str | Path | None,
                              phase: Callable[[str, int], None]) -> tuple[ServerState, dict[str, Any], dict[str, Any]]:
    """One round's exchange and its one ``finish_round`` (by the exchange when it aggregates, else here; phase
    "replied" in between): the new state, the round's metrics (the replies' own metrics added) and its non-private
    diagnostics."""
    finished: list[tuple[RoundReplies, ServerState, dict[str, Any]]] = []
    aggregate = _aggregate_once(state, plan, finished)
    replies = _exchange_or_stop(
        (lambda: exchange(plan, aggregate)) if exchange_aggregates else (lambda: exchange(plan)),
        state, records, checkpoint_dir)
    phase("replied", plan.round + 1)
    if not finished:
        aggregate(replies)
    replies, state, metrics = finished[0]
    nonprivate = {**metrics.pop("nonprivate"), **replies.nonprivate}
    metrics.update(replies.metrics)
    return state, metrics, nonprivate


def _commit(state: ServerState, checkpoint_dir: str | Path, records: list[dict[str, Any]],
            nonprivate: dict[str, Any], setup: dict[str, Any] | None) -> None:
    """Commit a round before anything of it is published: the checkpoint (public records and the run's
    description, ``fed_dp.run_setup``; the non-private parts and the round's diagnostics in the secret part), then
    the diagnostics appended to ``secret/diagnostics.jsonl``. A failed write stops the run with
    :class:`CheckpointWriteError`, saying what became of the round."""
    t = records[-1]["round"]
    diagnostics = {"round": t, **nonprivate}
    extra = {"records": [public_record(r) for r in records], **({SETUP_KEY: setup} if setup is not None else {})}
    with _writing(checkpoint_dir, f"round {t} could not be saved, so nothing of it was released; the rounds before "
                  "it are committed"):
        save_checkpoint(state, checkpoint_dir, extra=extra,
                        secret_extra={"records": [nonprivate_part(r) for r in records], "diagnostics": diagnostics})
    with _writing(checkpoint_dir, f"round {t} is committed, but its diagnostics were not written; it is handed out "
                  "when the run resumes"):
        append_diagnostics(checkpoint_dir, diagnostics)


def _empty_rounds(empty: int, nonprivate: dict[str, Any], max_empty_rounds: int, metrics: dict[str, Any],
                  checkpoint_dir: str | Path | None, simulated: bool) -> int:
    """The count of rounds in a row that sampled users but counted none, this round included; NoRepliesError (the
    checkpoint is saved already, so the run resumes) when it reaches ``max_empty_rounds``."""
    empty = empty + 1 if nonprivate["cohort_size"] > 0 and nonprivate["replied_users"] == 0 else 0
    if empty >= max_empty_rounds:  # the failure path says why: the run is broken and stops here
        raise NoRepliesError(
            f"no reply could be counted in the last {empty} rounds (up to round {metrics['round']}); "
            f"stopping before spending more privacy budget on noise alone (epsilon so far "
            f"{_format_epsilon(metrics['epsilon'])}). {_why_no_replies(nonprivate, checkpoint_dir, simulated)}. "
            "Fix the nodes and start the run again with the same checkpoint folder to resume")
    return empty
