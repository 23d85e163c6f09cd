"""What one round broadcasts (:class:`RoundPlan`) and what a node sends back (:class:`Contribution`).

Plain records shared by the server's round (``fed_dp.round``) and the clients, kept apart from the round so that a
client process imports neither the accountant nor the noise: a ClientApp process starts about 0.9 s sooner on
these 2-core machines without dp_accounting and scipy, and Flower starts one per message in a deployment.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Contribution:
    """One node's reply: Σ of its users' clipped updates (scaled geometry for STP), their count, and,
    when the optimizer needs them, Σ of their coordinate-wise squares."""

    total: torch.Tensor
    count: int
    total_squares: torch.Tensor | None = None
    source: str = ""
    unclipped: int | None = None  # Σ 1[‖Δ_i‖ ≤ ζ_t] of these users, for adaptive clipping
    scaled: bool = False  # clipped as s_t ⊙ Δ_i (scale-then-privatize), as the broadcast asked


@dataclass(frozen=True)
class RoundPlan:
    """What round t broadcasts: the cohort (user ids), θ_{t−1}, s_t (STP) and whether users send squares.

    ``round`` is t − 1, the number of rounds released before this one: the index that messages carry and
    local-training seeds derive from. Everything shown to people numbers rounds t = 1 … T (records, logs,
    errors, Flower's ``server_round``); round 0 is the initial model, before any release."""

    round: int
    cohort: torch.Tensor
    params: torch.Tensor
    clip_norm: float
    scale: torch.Tensor | None
    send_squares: bool
    send_clip_bits: bool = False


class UserTrainingError(RuntimeError):
    """Loading or training one user failed: the message names the round (1-based, as the logs count) and the user
    (sampler index, and the user's id when it differs); the original error is ``original`` (and, where it is
    raised from it, the ``__cause__``).

    ``not_the_users`` is empty when the failure is that user's (other users load and train); otherwise it says why
    the failure is the task's or the settings' rather than any one user's data (every user tried fails alone, or
    each trains alone and only training them together fails): the round loop then reports a configuration error
    (ValueError) when it happens before the first release, instead of stopping a run."""

    def __init__(self, round_number: int, user: int, user_id: Hashable, cause: BaseException, *,
                 not_the_users: str = "") -> None:
        self.round_number, self.user, self.user_id = round_number, user, user_id
        self.original, self.not_the_users = cause, not_the_users
        who = f"user {user}" + (f" (id {user_id!r})" if user_id != user else "")
        super().__init__(f"round {round_number}, {who}: {type(cause).__name__}: {cause}")
