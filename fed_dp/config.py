"""Frozen, validated configuration of the privacy mechanism.

One :class:`PrivacyConfig` drives the user sampler, the noise (privatizer) and the accounting event, so
the ε that is reported is the ε of what ran (docs/explanation/mechanism.md, Samplers and their accounting): ``make_sampler(config)``,
``make_privatizer(config, ...)`` and ``dp_event(config, rounds)`` all read the same object, and
combinations that no accounting covers are rejected here, before anything runs.

Notation (docs/explanation/mechanism.md): N = ``num_users``, B = ``expected_cohort`` (the fixed denominator),
T = ``rounds``, σ = ``noise_multiplier``, ζ = ``clip_norm``, b = ``bands``, k = ``max_participations``,
ℓ = ``buffers`` (of a BLT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from fed_dp.schema import setting
from fed_dp.validation import is_int as _is_int
from fed_dp.validation import is_real as _is_real
from fed_dp.validation import require as _require

SAMPLERS = ("poisson", "without-replacement", "all", "cyclic-poisson", "min-sep")
NOISES = ("independent", "bandmf", "blt")
#: Noises whose C is not the identity: they need a sampler with a minimum separation.
CORRELATED_NOISES = ("bandmf", "blt")
#: Most buffers a BLT may have (its parameters live in polynomials of this degree).
MAX_BUFFERS = 16
ACCOUNTANTS = ("pld", "rdp")
WORKLOADS = ("prefix-sum", "momentum")

#: Samplers whose participation pattern has a minimum separation, as BandMF needs (docs/explanation/mechanism.md: Noise; Samplers and their accounting).
SEPARATED_SAMPLERS = ("cyclic-poisson", "min-sep")


def _delta_below(num_users: int) -> float:
    """A conventional δ for N users: the largest power of ten at most 1/(10·N)."""
    return 10.0 ** math.floor(math.log10(1 / (10 * num_users)))


#: σ of a run configuration that gives neither ``privacy.noise-multiplier`` nor ``privacy.target-epsilon``
#: (``fed_dp.run_config``); the Python API asks for one of them.
DEFAULT_NOISE_MULTIPLIER = 1.0


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """The user-level DP mechanism of one training run (docs/explanation/mechanism.md).

    Fields:
        num_users: N, users in the population (user ids are ``0 .. N-1``). ``None``: the task's population,
            filled in by :func:`fed_dp.accounting.resolve_privacy` (``fed_dp.train`` and the Strategy do it).
        expected_cohort: B, expected users per round; the fixed denominator of the average.
        rounds: T, server rounds.
        noise_multiplier: σ; the noise std on the sum of clipped updates is σ·ζ (times the row norm of
            C⁻¹ for BandMF). Must be > 0: a run without noise is not private.
        target_epsilon: instead of σ, the user-level ε the whole run should have at ``delta``; σ is then
            calibrated with dp_accounting when the config is resolved (give one of the two).
        clip_norm: ζ, L2 bound on one user's whole contribution.
        delta: δ of the reported (ε, δ); below 1/N. δ ≥ 1/N is refused once N is known: a mechanism that publishes
            each user's whole data with probability δ is (0, δ)-DP, so such a δ lets about δ·N ≥ 1 users' data be
            released and the reported ε bounds nothing.
        allow_large_delta: accept δ ≥ 1/N anyway (a research replication at a small N); the run then warns,
            naming the population.
        sampler: ``poisson`` (rate q = B/N), ``without-replacement`` (exactly B of N), ``all``
            (every user every round; B must equal N), ``cyclic-poisson`` (users hashed into b groups,
            round t samples group t mod b at rate q_b = B·b/N), ``min-sep`` (deterministic: users split
            into m = N // B fixed groups visited in turn, participations at least m rounds apart).
        noise: ``independent`` Gaussian (C = I), ``bandmf`` (banded matrix factorization) or ``blt``
            (buffered linear Toeplitz, ``fed_dp.blt``). The correlated ones need a sampler with a minimum
            separation (``cyclic-poisson`` or ``min-sep``).
        bands: b, bands of C for BandMF; also the number of groups of ``cyclic-poisson``. Must be 1 for
            the samplers without separation.
        buffers: ℓ, buffers of a BLT (1 … 16); required for noise ``blt``, unset otherwise.
        max_participations: k for ``min-sep``; defaults to ⌈T/m⌉, the most a user can participate. A
            value below that is refused (it would under-count); a larger one is accepted (conservative;
            with BLT it changes nothing: its sensitivity counts every participation that fits in t rounds).
        accountant: ``pld`` (default, tighter) or ``rdp``. ``without-replacement`` needs ``rdp``.
        epsilon_budget: optional ε cap; a round that would exceed it is refused.
        workload: workload of the correlated-noise strategy (BandMF, BLT), ``prefix-sum`` or ``momentum``.
        momentum: μ of the momentum workload, in [0, 1).
    """

    expected_cohort: int = setting(help="B: expected users per round, the fixed denominator", config_default=10)
    rounds: int = setting(help="T: server rounds the accounting plans for", config_default=5)
    delta: float = setting(help="δ of (ε, δ); choose below 1/N", config_default=1e-5)
    num_users: int | None = setting(None, help="N; unset: the task's number of users (if set, it must equal it)")
    allow_large_delta: bool = setting(False, help="accept delta >= 1/N (refused otherwise: with such a delta a "
                                      "mechanism may publish a whole user's data; a run then warns, naming N)")
    noise_multiplier: float | None = setting(None, help=f"σ: noise std on the sum of clipped updates / ζ "
                                             f"({DEFAULT_NOISE_MULTIPLIER} in a run config that gives neither σ nor "
                                             "target-epsilon; 0: a non-private baseline, no noise, ε infinite)")
    target_epsilon: float | None = setting(None, help="calibrate σ with dp_accounting so that the whole run has "
                                           "this user-level ε at delta")
    clip_norm: float = setting(1.0, help="ζ: L2 bound of one user's whole update")
    sampler: str = setting("poisson", help="user sampler (docs/explanation/mechanism.md, Samplers and their accounting)", choices=SAMPLERS)
    noise: str = setting("independent", help="independent Gaussian, or bandmf or blt (correlated) noise",
                         choices=NOISES)
    bands: int = setting(1, help="b: BandMF bands = cyclic-poisson groups = required min-separation")
    buffers: int | None = setting(None, help="ℓ: buffers of the BLT strategy (noise blt; 1 … 16)")
    max_participations: int | None = setting(None, help="k for min-sep (unset: ceil(T / (N // B)))")
    accountant: str = setting("pld", help="pld (tighter) or rdp (faster per round; needed by without-replacement)",
                              choices=ACCOUNTANTS)
    epsilon_budget: float | None = setting(None, help="refuse any round that would take ε above this")
    workload: str = setting("prefix-sum", help="workload of the BandMF or BLT strategy", choices=WORKLOADS)
    momentum: float = setting(0.0, help="μ of the momentum workload")

    def __post_init__(self) -> None:
        self._validate_sizes()
        self._validate_privacy_parameters()
        self._validate_choices()
        self._validate_sampler_combination()

    # --- validation, one concern per method -------------------------------------------------------
    def _validate_sizes(self) -> None:
        optional = tuple(name for name in ("num_users", "max_participations") if getattr(self, name) is not None)
        for name in ("expected_cohort", "rounds", "bands") + optional:
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
        if self.num_users is not None:
            _require(
                self.expected_cohort <= self.num_users,
                f"expected_cohort (B = {self.expected_cohort}) must be <= num_users (N = {self.num_users})",
            )

    @property
    def non_private(self) -> bool:
        """True for the explicit non-private baseline (noise_multiplier = 0): no noise, ε infinite."""
        return self.noise_multiplier == 0

    def _validate_privacy_parameters(self) -> None:
        _require(
            (self.noise_multiplier is None) != (self.target_epsilon is None),
            "give exactly one of noise_multiplier (σ) and target_epsilon (σ is then calibrated for it); got "
            f"noise_multiplier = {self.noise_multiplier!r}, target_epsilon = {self.target_epsilon!r}",
        )
        if self.noise_multiplier is not None:
            _require(
                _is_real(self.noise_multiplier) and self.noise_multiplier >= 0,
                f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r} "
                "(0: the explicit non-private baseline, no noise at all; give target_epsilon to have σ calibrated)",
            )
            _require(
                self.noise_multiplier > 0 or self.epsilon_budget is None,
                f"epsilon_budget = {self.epsilon_budget!r} with noise_multiplier = 0: a run without noise has no "
                "privacy (ε is infinite), so no budget can hold; remove epsilon_budget for a non-private baseline, "
                "or give noise_multiplier > 0",
            )
        else:
            _require(
                _is_real(self.target_epsilon) and self.target_epsilon > 0,
                f"target_epsilon must be a finite number > 0, got {self.target_epsilon!r}",
            )
        _require(
            _is_real(self.clip_norm) and self.clip_norm > 0,
            f"clip_norm must be a finite number > 0, got {self.clip_norm!r}",
        )
        _require(
            _is_real(self.delta) and 0 < self.delta < 1,
            f"delta must be in (0, 1), got {self.delta!r} (typically below 1/num_users)",
        )
        if self.epsilon_budget is not None:
            _require(
                _is_real(self.epsilon_budget) and self.epsilon_budget > 0,
                f"epsilon_budget must be a finite number > 0 or None, got {self.epsilon_budget!r}",
            )
            _require(
                self.target_epsilon is None or self.target_epsilon <= self.epsilon_budget,
                f"target_epsilon = {self.target_epsilon!r} is above epsilon_budget = {self.epsilon_budget!r}: σ "
                "would be calibrated to spend the target over all the rounds, and the budget would stop the run "
                "part-way, as if it were done. Lower target_epsilon to at most the budget, or raise epsilon_budget",
            )
        _require(isinstance(self.allow_large_delta, bool),
                 f"allow_large_delta must be true or false, got {self.allow_large_delta!r}")
        _require(
            _is_real(self.momentum) and 0 <= self.momentum < 1,
            f"momentum must be in [0, 1), got {self.momentum!r}",
        )

    def _validate_choices(self) -> None:
        for name, allowed in (
            ("sampler", SAMPLERS),
            ("noise", NOISES),
            ("accountant", ACCOUNTANTS),
            ("workload", WORKLOADS),
        ):
            value = getattr(self, name)
            _require(value in allowed, f"{name} must be one of {', '.join(allowed)}; got {value!r}")

    def _validate_sampler_combination(self) -> None:
        sampler, noise = self.sampler, self.noise
        if noise in CORRELATED_NOISES:
            _require(
                sampler in SEPARATED_SAMPLERS,
                f"noise {noise!r} needs a sampler with minimum separation between a user's "
                f"participations (cyclic-poisson or min-sep); sampler {sampler!r} has none, so "
                f"{'BandMF' if noise == 'bandmf' else 'BLT'}'s correlated noise would have no valid accounting "
                "(docs/explanation/mechanism.md: Noise; Samplers and their accounting)",
            )
        if noise == "blt":
            _require(
                _is_int(self.buffers) and 1 <= self.buffers <= MAX_BUFFERS,
                f"noise 'blt' needs buffers (ℓ, the BLT's number of buffers of d floats each) as an integer in "
                f"1 … {MAX_BUFFERS}, got {self.buffers!r}; 4 is a good start",
            )
        else:
            _require(
                self.buffers is None,
                f"buffers = {self.buffers!r} only applies to noise 'blt' (noise is {noise!r}); leave it unset",
            )
        if noise == "bandmf":
            _require(
                self.bands <= self.rounds,
                f"bands (b = {self.bands}) must be <= rounds (T = {self.rounds}) for BandMF",
            )
        if sampler not in SEPARATED_SAMPLERS:
            _require(
                self.bands == 1,
                f"bands = {self.bands} has no meaning for sampler {sampler!r} with independent noise; "
                "set bands = 1, or use noise 'bandmf' with sampler cyclic-poisson or min-sep",
            )
        if self.noise not in CORRELATED_NOISES and self.workload != "prefix-sum":
            raise ValueError("workload only applies to noise 'bandmf' or 'blt' (correlated noise); leave it at 'prefix-sum'")
        if self.workload == "prefix-sum" and self.momentum != 0:
            raise ValueError("momentum > 0 requires workload 'momentum'")
        if sampler != "min-sep":
            _require(
                self.max_participations is None,
                f"max_participations only applies to sampler 'min-sep' (got sampler {sampler!r}); "
                "the other samplers' accounting already covers every participation",
            )
        if sampler == "without-replacement":
            _require(
                self.accountant == "rdp",
                "sampler 'without-replacement' is accounted with dp_accounting's RDP accountant only "
                "(replace-one adjacency); set accountant 'rdp'",
            )
        if self.num_users is None:
            return  # the checks below need N; they run when the population is filled in
        _require(
            self.allow_large_delta or self.delta < 1 / self.num_users,
            f"privacy.delta = {self.delta:g} is not below 1/N = {1 / self.num_users:.4g} (N = {self.num_users} "
            "users): a mechanism that publishes each user's whole data with probability delta satisfies (0, delta)-DP, "
            f"so this delta would let about {self.delta * self.num_users:.3g} users' data be released and the reported "
            f"epsilon would bound nothing. Choose privacy.delta below 1/N (e.g. {_delta_below(self.num_users):g}), "
            "or set privacy.allow-large-delta = true (Python: PrivacyConfig.allow_large_delta) to run anyway; the run then "
            "warns, naming the population",
        )
        if sampler == "all":
            _require(
                self.expected_cohort == self.num_users,
                f"sampler 'all' uses every user every round, so expected_cohort must equal num_users "
                f"({self.num_users}); got {self.expected_cohort}",
            )
        if sampler == "cyclic-poisson":
            _require(
                self.expected_cohort * self.bands <= self.num_users,
                f"cyclic-poisson samples one of b = {self.bands} groups per round at rate "
                f"q_b = B·b/N = {self.expected_cohort * self.bands / self.num_users:.4g} > 1; "
                "lower expected_cohort or bands, or add users",
            )
        if sampler == "min-sep":
            separation = self.num_users // self.expected_cohort
            _require(
                separation >= self.bands,
                f"min-sep: users are split into m = N // B = {separation} groups, so a user's "
                f"participations are {separation} rounds apart, which is < bands (b = {self.bands}); "
                "the BandMF sensitivity bound needs min-separation >= b. Lower B or b, or add users",
            )
            needed = math.ceil(self.rounds / separation)
            if self.max_participations is not None:
                _require(
                    _is_int(self.max_participations) and self.max_participations >= needed,
                    f"max_participations = {self.max_participations!r} is below the {needed} "
                    f"participations that {self.rounds} rounds with separation {separation} give a "
                    "user; it would under-count the privacy loss",
                )

    # --- resolution ----------------------------------------------------------------------------------
    @property
    def resolved(self) -> bool:
        """Whether the population N and σ are known (what samplers, noise and accounting need)."""
        return self.num_users is not None and self.noise_multiplier is not None

    def require_resolved(self, what: str) -> "PrivacyConfig":
        """This config, if resolved; else a ValueError saying what is missing and how to fill it in."""
        missing = [name for name in ("num_users", "noise_multiplier") if getattr(self, name) is None]
        _require(
            not missing,
            f"{what} needs a resolved PrivacyConfig, but {' and '.join(missing)} is not set yet: call "
            "fed_dp.accounting.resolve_privacy(config, num_users) (fed_dp.train and the Flower Strategy do "
            "this for you), or give num_users and noise_multiplier",
        )
        return self

    # --- derived quantities --------------------------------------------------------------------------
    @property
    def sampling_rate(self) -> float:
        """Probability that a given user is in the cohort of a round in which it can be sampled.

        q = B/N for poisson and without-replacement, q_b = B·b/N for cyclic-poisson (a user's group
        is sampled one round in b), 1 for all, and 1 for min-sep in its group's rounds.
        """
        if self.sampler == "cyclic-poisson":
            return self.expected_cohort * self.bands / self.num_users
        if self.sampler in ("all", "min-sep"):
            return 1.0
        return self.expected_cohort / self.num_users

    @property
    def workload_momentum(self) -> float:
        """μ of the strategy's workload: ``momentum`` for the momentum workload, 0 for prefix sums."""
        return self.momentum if self.workload == "momentum" else 0.0

    @property
    def min_separation(self) -> int:
        """Fewest rounds between two participations of one user (1 when there is no guarantee)."""
        if self.sampler == "cyclic-poisson":
            return self.bands
        if self.sampler == "min-sep":
            return self.num_users // self.expected_cohort
        return 1

    def participations(self, rounds: int | None = None) -> int:
        """Most participations of one user in the first ``rounds`` rounds (default T).

        For min-sep after the full T rounds this is ``max_participations`` when it was given.
        """
        rounds = self.rounds if rounds is None else rounds
        if self.sampler in ("cyclic-poisson", "min-sep"):
            needed = math.ceil(rounds / self.min_separation)
            if self.sampler == "min-sep" and self.max_participations is not None and rounds == self.rounds:
                return self.max_participations
            return needed
        return rounds

    def replace(self, **changes: Any) -> "PrivacyConfig":
        """A copy with some fields changed, validated again."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        _require(not unknown, f"unknown PrivacyConfig field(s): {', '.join(sorted(unknown))}")
        values.update(changes)
        return PrivacyConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class LocalTraining:
    """Local training of one user on its own examples, from the broadcast θ_{t−1} (docs/explanation/mechanism.md).

    The user takes minibatch SGD steps on ``loss(model, batch)``: ``epochs`` passes over its examples in
    shuffled minibatches of ``batch_size`` (the last one of an epoch may be shorter), or, with ``steps``, that
    many minibatches (epochs follow one another, each reshuffled). With ``max_examples`` a user trains on its
    first ``max_examples`` examples only. The step is ``torch.optim.SGD``'s (dampening 0, no Nesterov):

        g ← ∇loss + λ·θ          (λ = weight_decay)
        m ← g at the first step, μ·m + g after (μ = momentum; m = g when μ = 0)
        θ ← θ − η·m              (η = lr)

    Momentum buffers start at zero for every user and round (nothing of a user persists across rounds). Which
    minibatches a user with n examples takes is ``fed_dp.clients.training.local_schedule``.
    Δ_i = θ_i − θ_{t−1} is then clipped to ζ; none of this changes the privacy accounting, which bounds the
    whole update of a user by its clip, whatever the local work.
    """

    epochs: int = setting(1, help="passes over a user's examples per round")
    steps: int | None = setting(None, help="minibatch steps per round instead of epochs")
    batch_size: int = setting(16, help="minibatch size of local SGD")
    lr: float = setting(0.1, help="local learning rate")
    momentum: float = setting(0.0, help="local SGD momentum")
    weight_decay: float = setting(0.0, help="local SGD weight decay (L2)")
    max_examples: int | None = setting(None, help="train on a user's first k examples only")

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size") + tuple(n for n in ("steps", "max_examples") if getattr(self, n) is not None):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"local {name} must be an integer >= 1, got {value!r}")
        _require(
            self.steps is None or self.epochs == 1,
            f"give local epochs or local steps, not both (epochs = {self.epochs}, steps = {self.steps})",
        )
        _require(_is_real(self.lr) and self.lr > 0, f"local lr must be a finite number > 0, got {self.lr!r}")
        _require(
            _is_real(self.momentum) and 0 <= self.momentum < 1,
            f"local momentum must be in [0, 1), got {self.momentum!r}",
        )
        _require(
            _is_real(self.weight_decay) and self.weight_decay >= 0,
            f"local weight_decay must be a finite number >= 0, got {self.weight_decay!r}",
        )
