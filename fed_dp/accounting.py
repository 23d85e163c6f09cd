"""User-level ε with dp_accounting: accountants, calibration of σ, and the per-round ledger (ALGORITHMS §4).

The event always comes from :func:`fed_dp.sampling.dp_event` on the run's
:class:`~fed_dp.config.PrivacyConfig`; nothing here re-derives an accountant. PLD is the default
(tighter); RDP is offered, and required for sampling without replacement (replace-one adjacency).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

from fed_dp.config import PrivacyConfig
from fed_dp.sampling import dp_event, neighboring_relation

#: Smallest σ that calibration considers; a target ε reachable only below it is refused.
MIN_CALIBRATED_NOISE = 1e-2


class _ExcludedRdpOrderFilter(logging.Filter):
    """Drops dp_accounting's "failed to converge ... Excluding this order" warnings.

    They say that the RDP accountant skipped an order whose series did not converge; skipping an order
    can only make the RDP ε larger (more conservative), never smaller. The calibration search evaluates
    dozens of σ and would print them by the hundred. Every other warning passes through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Excluding this order" not in record.getMessage()


logging.getLogger("absl").addFilter(_ExcludedRdpOrderFilter())


class BudgetExceededError(RuntimeError):
    """Raised instead of running a round whose release would exceed the configured ε budget."""


def make_accountant(config: PrivacyConfig) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant of ``config.accountant`` kind under the sampler's neighbouring relation."""
    relation = neighboring_relation(config)
    if config.accountant == "pld":
        return pld.PLDAccountant(neighboring_relation=relation)
    return rdp.RdpAccountant(neighboring_relation=relation)


@functools.lru_cache(maxsize=4096)
def epsilon(config: PrivacyConfig, rounds: int | None = None) -> float:
    """User-level ε at ``config.delta`` after ``rounds`` rounds (default: the planned T).

    Memoized on the (frozen, hashable) config and the round count: a PLD evaluation costs about half a
    second whatever the round count (building the sampled-Gaussian PLD dominates), and a comparison of
    several optimizers asks for the same values once per optimizer.
    """
    accountant = make_accountant(config)
    accountant.compose(dp_event(config, rounds))
    return float(accountant.get_epsilon(config.delta))


def _calibrate(config: PrivacyConfig, target_epsilon: float, bracket: Any) -> float:
    """dp_accounting.calibrate_dp_mechanism with ``config``'s own event builder and accountant."""
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(config),
            lambda sigma: dp_event(config.replace(noise_multiplier=float(sigma))),
            target_epsilon,
            config.delta,
            bracket_interval=bracket,
        )
    )


def _pld_bracket(config: PrivacyConfig, target_epsilon: float, rdp_sigma: float) -> Any:
    """An interval [lo, hi] around the PLD solution, found without evaluating PLD at tiny σ.

    PLD is tighter than RDP, so σ_PLD ≤ σ_RDP: hi starts at σ_RDP and lo halves from σ_RDP/2 until
    ε_PLD(lo) > target. (Evaluating PLD at very small σ over many rounds needs tens of GiB, which is why
    dp_accounting's default bracket search from σ = 0 is not used.)
    """
    hi = rdp_sigma
    while epsilon(config.replace(noise_multiplier=hi)) > target_epsilon:  # rare: PLD discretization
        hi *= 1.25
    lo = hi / 2
    while epsilon(config.replace(noise_multiplier=lo)) <= target_epsilon:
        hi, lo = lo, lo / 2
        if lo < MIN_CALIBRATED_NOISE:
            raise ValueError(f"target epsilon {target_epsilon} needs σ < {MIN_CALIBRATED_NOISE}; choose a smaller epsilon")
    return dp_accounting.ExplicitBracketInterval(lo, hi)


def calibrate_noise_multiplier(config: PrivacyConfig, target_epsilon: float) -> float:
    """Smallest σ (to within 1e-6) whose T-round ε at ``config.delta`` is at most ``target_epsilon``.

    Uses ``dp_accounting.calibrate_dp_mechanism`` with the config's own event builder, which guarantees
    ε(σ) ≤ target. The search runs with RDP first (cheap at any σ); for PLD, the RDP answer is an upper
    end of a bracket in which PLD is solved. ``config.noise_multiplier`` is ignored.
    """
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    if config.noise_multiplier is None:  # a config that asks for calibration: search from a placeholder σ
        config = config.replace(target_epsilon=None, noise_multiplier=1.0)
    config.require_resolved("calibration")
    rdp_config = config.replace(accountant="rdp")
    if epsilon(rdp_config.replace(noise_multiplier=MIN_CALIBRATED_NOISE)) <= target_epsilon:
        raise ValueError(
            f"target epsilon {target_epsilon} is reached already with σ = {MIN_CALIBRATED_NOISE}; "
            "such a target gives no meaningful protection — choose a smaller epsilon"
        )
    rdp_sigma = _calibrate(
        rdp_config, target_epsilon, dp_accounting.LowerEndpointAndGuess(MIN_CALIBRATED_NOISE, 1.0)
    )
    if config.accountant == "rdp":
        return rdp_sigma
    return _calibrate(config, target_epsilon, _pld_bracket(config, target_epsilon, rdp_sigma))


def resolve_privacy(config: PrivacyConfig, num_users: int | None = None) -> PrivacyConfig:
    """The config with its population and σ filled in: what samplers, noise and accounting run on.

    ``num_users`` is the task's population N; it fills ``config.num_users`` when that is None and must
    equal it otherwise. With ``target_epsilon``, σ is calibrated now (:func:`calibrate_noise_multiplier`:
    the smallest σ whose T-round ε at δ is at most the target) and the result carries that σ, with
    ``target_epsilon`` cleared. A config that is already resolved is returned as it is.
    """
    if num_users is not None:
        if config.num_users is not None and config.num_users != num_users:
            raise ValueError(
                f"privacy.num_users = {config.num_users} but the task has {num_users} users; the sampler must "
                "draw from the users that exist (leave num_users unset to take the task's population)"
            )
        if config.num_users is None:
            config = config.replace(num_users=num_users)
    if config.num_users is None:
        raise ValueError("the population size is unknown: give num_users (the number of users of the task)")
    if config.target_epsilon is not None:
        sigma = calibrate_noise_multiplier(config, config.target_epsilon)
        config = config.replace(target_epsilon=None, noise_multiplier=sigma)
    return config


@dataclass(frozen=True)
class RoundRecord:
    """One released round: its index (0-based) and ε after it (no cohort size: it is computed from the
    population, outside the accounted release, and is not part of what the ledger publishes)."""

    round: int
    epsilon: float


class PrivacyLedger:
    """Per-round record of what was released, with ε so far, and the budget check.

    ε after t rounds is dp_accounting's ε of ``dp_event(config, t)``: the event of the sampler that
    actually ran. ``check_next_round`` raises :class:`BudgetExceededError` if running one more round
    would take ε above ``config.epsilon_budget``, before anything is released. Dropped users do not
    change the ledger: the round releases with the same noise and counts in full.
    """

    def __init__(self, config: PrivacyConfig, records: tuple[RoundRecord, ...] = ()) -> None:
        self.config = config.require_resolved("the privacy ledger")
        self._records: list[RoundRecord] = list(records)
        self._next_epsilon: tuple[int, float] | None = None  # (rounds, ε after rounds + 1), a memo

    @property
    def records(self) -> tuple[RoundRecord, ...]:
        return tuple(self._records)

    @property
    def rounds(self) -> int:
        return len(self._records)

    @property
    def epsilon(self) -> float:
        """ε spent so far (0 before the first round)."""
        return self._records[-1].epsilon if self._records else 0.0

    def epsilon_if_next_round(self) -> float:
        """ε after one more round (PLD costs up to a second at 10⁴ rounds, so it is computed once)."""
        if self._next_epsilon is None or self._next_epsilon[0] != self.rounds:
            self._next_epsilon = (self.rounds, epsilon(self.config, self.rounds + 1))
        return self._next_epsilon[1]

    def check_next_round(self) -> float:
        """ε after one more round; raises BudgetExceededError when it would exceed the budget."""
        if self.rounds >= self.config.rounds:
            raise BudgetExceededError(
                f"all {self.config.rounds} planned rounds have run; the accounting covers no more"
            )
        next_epsilon = self.epsilon_if_next_round()
        budget = self.config.epsilon_budget
        if budget is not None and next_epsilon > budget:
            raise BudgetExceededError(
                f"round {self.rounds + 1} would raise user-level ε from {self.epsilon:.4g} to "
                f"{next_epsilon:.4g}, above the budget {budget:.4g} (δ = {self.config.delta:g}); "
                "the round was not run. Stop here, or plan a larger noise_multiplier for the next run"
            )
        return next_epsilon

    def record_round(self) -> RoundRecord:
        """Account for one released round (after ``check_next_round`` passed) and return its record."""
        record = RoundRecord(self.rounds, self.check_next_round())
        self._records.append(record)
        return record

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "records": [r.__dict__.copy() for r in self._records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        """Restore a saved ledger; its rounds must be consecutive and its last ε is recomputed and checked.

        A checkpoint whose stored ε disagrees with dp_accounting (edited, or written by another
        configuration) is refused rather than trusted.
        """
        config = PrivacyConfig(**data["config"])
        records = tuple(RoundRecord(**r) for r in data["records"])
        if [r.round for r in records] != list(range(len(records))):
            raise ValueError("ledger records must be the consecutive rounds 0, 1, ...; this checkpoint is damaged")
        if records:
            expected = epsilon(config, len(records))
            if not math.isclose(records[-1].epsilon, expected, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(
                    f"ledger checkpoint says ε = {records[-1].epsilon!r} after {len(records)} rounds, but "
                    f"dp_accounting gives {expected!r} for its configuration; refusing a ledger that does not match"
                )
        return cls(config, records)
