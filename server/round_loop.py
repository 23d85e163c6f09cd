"""The one round loop: every engine — the Flower Strategy and the in-process simulator — runs its rounds here.

    resume from the checkpoint folder (if it holds a checkpoint)
    for each remaining round t:
        plan            = begin_round(state)        # refuses a round over the ε budget (the run then ends)
        replies         = exchange(plan)            # Flower messages, or local training in this process
        state, metrics  = finish_round(state, plan, replies.contributions)
        checkpoint      (atomically, before anything of round t is evaluated, logged or returned)
        stop with NoRepliesError after ``max_empty_rounds`` rounds in a row in which users were sampled but
            none was counted: the budget is not spent on noise alone
        evaluate every ``eval_every`` rounds and after the last; log ε; hand the record to ``on_round``
    write results.json

The engines differ only in ``exchange`` (how the plan reaches users and their contributions come back) and in
``evaluate``; all DP math is in ``fed_dp.round``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fed_dp.accounting import BudgetExceededError
from fed_dp.checkpoint import resume, save_checkpoint
from fed_dp.round import Contribution, RoundPlan, ServerState, begin_round, finish_round

log = logging.getLogger("fed_dp.server")


class NoRepliesError(RuntimeError):
    """Several rounds in a row sampled users but counted none of them: the run stops before spending more."""


@dataclass
class RoundReplies:
    """What came back for a plan: contributions, why sampled users were not counted, and (simulations only)
    diagnostics of local training."""

    contributions: list[Contribution]
    dropped: list[str] = field(default_factory=list)
    client_metrics: dict[str, float] = field(default_factory=dict)


Exchange = Callable[[RoundPlan], RoundReplies]


@dataclass
class LoopResult:
    state: ServerState
    records: list[dict[str, Any]]
    stopped: str | None = None  # why the run ended before its last round (the ε budget), else None


def _evaluate_now(round_index: int, rounds: int, eval_every: int) -> bool:
    return eval_every > 0 and ((round_index + 1) % eval_every == 0 or round_index + 1 == rounds)


def _format_epsilon(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.4f}"


def run_rounds(
    state: ServerState,
    exchange: Exchange,
    *,
    rounds: int | None = None,
    evaluate: Callable[[int, torch.Tensor], dict[str, float]] | None = None,
    eval_every: int = 1,
    checkpoint_dir: str | Path | None = None,
    max_empty_rounds: int = 2,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> LoopResult:
    """Run rounds until ``rounds`` (default: the planned T) have been released, the budget refuses one, or
    replies stop coming. Returns the final state, one record per released round and why it stopped early.

    ``evaluate(rounds_done, params)`` gets the flat θ after a round (every ``eval_every`` rounds and after the
    last);
    ``on_round(record)`` is called after each round (progress bars). Raises :class:`NoRepliesError` (after
    saving the checkpoint, so the run can be resumed) when ``max_empty_rounds`` rounds in a row sampled users
    but counted none.
    """
    rounds = state.config.rounds if rounds is None else rounds
    if not 1 <= rounds <= state.config.rounds:
        raise ValueError(f"rounds must be in 1..{state.config.rounds} (the rounds the privacy plan accounts for), "
                         f"got {rounds}")
    records: list[dict[str, Any]] = []
    if checkpoint_dir:
        extra = resume(state, checkpoint_dir)
        if extra is not None:
            records = list(extra.get("records", []))
            log.info("resumed from %s at round %d (epsilon so far %.4g)", checkpoint_dir, state.round,
                     state.ledger.epsilon)
    stopped, empty = None, 0
    try:
        while state.round < rounds:
            started = time.perf_counter()
            try:
                plan = begin_round(state)  # refuses, before sampling, a round that would exceed the budget
            except BudgetExceededError as refusal:
                log.error("fed-dp stopped before round %d: %s", state.round + 1, refusal)
                stopped = str(refusal)
                break
            replies = exchange(plan)
            state, metrics = finish_round(state, plan, replies.contributions)
            metrics["round_seconds"] = time.perf_counter() - started  # sampling, exchange, server round
            metrics["dropped"] = list(replies.dropped)
            metrics.update(replies.client_metrics)
            records.append(metrics)
            if checkpoint_dir:
                save_checkpoint(state, checkpoint_dir, extra={"records": records})
            empty = empty + 1 if plan.cohort.numel() > 0 and metrics["replied_users"] == 0 else 0
            if empty >= max_empty_rounds:
                raise NoRepliesError(
                    f"no sampled user was counted in the last {empty} rounds (up to round {plan.round + 1}); "
                    f"stopping before spending more privacy budget on noise alone (epsilon so far "
                    f"{_format_epsilon(metrics['epsilon'])}). Why: {'; '.join(metrics['dropped']) or 'no replies'}. "
                    "Fix the nodes and start the run again with the same checkpoint folder to resume")
            if evaluate is not None and _evaluate_now(plan.round, rounds, eval_every):
                metrics.update(evaluate(state.round, state.params))
            log.info("round %d/%d: cohort %d, replied %d, epsilon %s, delta %g%s", plan.round + 1, rounds,
                     metrics["cohort_size"], metrics["replied_users"], _format_epsilon(metrics["epsilon"]),
                     metrics["delta"], "".join(f"\n  dropped: {p}" for p in metrics["dropped"]))
            if on_round is not None:
                on_round(metrics)
    finally:
        if checkpoint_dir:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            Path(checkpoint_dir, "results.json").write_text(json.dumps(records, indent=1, default=str))
    return LoopResult(state, records, stopped)
