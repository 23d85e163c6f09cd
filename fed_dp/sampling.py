"""User samplers and the dp_accounting event of each (docs/explanation/mechanism.md, Samplers and their accounting).

Every sampler is built from a :class:`~fed_dp.config.PrivacyConfig` and builds its own accounting event
from that same config, so the sampler that picks the cohort and the event that accounts for it cannot
disagree. Neighbouring datasets differ by one user's entire data (user-level DP).

| sampler | adjacency | event after t rounds |
|---|---|---|
| poisson (q = B/N) | add/remove | SelfComposed(PoissonSampled(q, Gaussian(σ)), t) |
| without-replacement | replace-one | SelfComposed(SampledWithoutReplacement(N, B, Gaussian(σ/2)), t) |
| all | add/remove | SelfComposed(Gaussian(σ), t) |
| cyclic-poisson (q_b = B·b/N) | add/remove | SelfComposed(PoissonSampled(q_b, Gaussian(σ)), ⌈t/b⌉) |
| min-sep (k participations) | add/remove | Gaussian(σ/√k) |
| cyclic-poisson or min-sep with BLT noise | add/remove | Gaussian(σ/sens_t) |

Replacing one user's clipped contribution moves the sum by up to 2ζ, and dp_accounting defines the noise
multiplier as noise std over the L2 sensitivity of the chosen relation, hence σ/2 for replace-one.
The cyclic-poisson event is amplified BandMF (Choquette-Choo et al. 2023, Thm. 4); min-sep is its
deterministic counterpart (sensitivity √k for column-normalized C with min-separation ≥ b, §2).

With BLT noise (``fed_dp.blt``) the event after t rounds is Gaussian(σ/sens_t), sens_t the BLT's
sensitivity with every participation that the sampler's min-separation m allows in t rounds (m = b
groups for cyclic-poisson, m = N // B for min-sep). A BLT is not banded, so the per-epoch decomposition
behind amplified BandMF does not apply and cyclic Poisson sampling gets no amplification credit: the
event is that of a user sampled in every round of its group.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any, ClassVar

import dp_accounting
import torch

from fed_dp.blt import config_sensitivity_squared
from fed_dp.config import PrivacyConfig
from fed_dp.randomness import entropy_seed
from fed_dp.validation import check_int

NeighboringRelation = dp_accounting.NeighboringRelation


def stable_group(user_id: int | str, groups: int) -> int:
    """Group of a user for cyclic sampling: BLAKE2b of the id's decimal/str form, modulo ``groups``.

    Stable across processes, machines and Python versions (unlike ``hash``).
    """
    digest = hashlib.blake2b(str(user_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % groups


class Sampler:
    """Base class: draws the cohort of each round with an explicit ``torch.Generator``.

    State (``state_dict``): the seed, the number of rounds sampled so far and the generator state, so
    a restored sampler continues with exactly the cohorts the original would have drawn.
    """

    name: ClassVar[str]
    neighboring_relation: ClassVar[NeighboringRelation] = NeighboringRelation.ADD_OR_REMOVE_ONE
    #: The neighbouring datasets of the proved guarantee, in words (what the accountant's relation stands for).
    guarantee: ClassVar[str] = "add or remove one user"

    def __init__(self, config: PrivacyConfig, seed: int | None = None) -> None:
        if config.sampler != self.name:
            raise ValueError(f"{type(self).__name__} needs sampler {self.name!r}, config has {config.sampler!r}")
        self.config = config.require_resolved("the user sampler")
        self.seed = entropy_seed() if seed is None else int(seed)
        self.seeded_explicitly = seed is not None
        self.rounds_sampled = 0
        self._generator = torch.Generator().manual_seed(self.seed)
        self._build_groups()

    def _build_groups(self) -> None:
        """Structures derived from the config and the seed (none for the plain samplers)."""

    # --- accounting --------------------------------------------------------------------------------
    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        """The dp_accounting event of ``rounds`` rounds of this sampler with σ = config.noise_multiplier."""
        raise NotImplementedError

    # --- sampling ----------------------------------------------------------------------------------
    def _cohort(self, round_index: int) -> torch.Tensor:
        raise NotImplementedError

    def next_cohort(self) -> torch.Tensor:
        """Sorted int64 user ids of the next round's cohort (round index = ``rounds_sampled``)."""
        if self.rounds_sampled >= self.config.rounds:
            raise ValueError(
                f"all {self.config.rounds} configured rounds have been sampled; the accounting covers "
                "no more. Plan a longer run (rounds) instead of sampling past it"
            )
        cohort = self._cohort(self.rounds_sampled)
        self.rounds_sampled += 1
        return cohort

    # --- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.name,
            "seed": self.seed,
            "seeded_explicitly": self.seeded_explicitly,
            "rounds_sampled": self.rounds_sampled,
            "generator_state": self._generator.get_state().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved sampler: adopts its seed (and seed-derived groups), round count and generator."""
        if state.get("sampler") != self.name:
            raise ValueError(f"sampler state is for {state.get('sampler')!r}, this sampler is {self.name!r}")
        if int(state["seed"]) != self.seed:
            self.seed = int(state["seed"])
            self._build_groups()
        self.rounds_sampled = int(state["rounds_sampled"])
        self.seeded_explicitly = bool(state["seeded_explicitly"])
        self._generator.set_state(state["generator_state"])


def _poisson_subset(candidates: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Each candidate independently with probability ``rate``."""
    keep = torch.rand(candidates.numel(), generator=generator, dtype=torch.float64) < rate
    return candidates[keep]


class PoissonSampler(Sampler):
    """Every user independently with probability q = B/N each round (add/remove adjacency)."""

    name = "poisson"

    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                config.sampling_rate, dp_accounting.GaussianDpEvent(config.noise_multiplier)
            ),
            rounds,
        )

    def _cohort(self, round_index: int) -> torch.Tensor:
        users = torch.arange(self.config.num_users, dtype=torch.int64)
        return _poisson_subset(users, self.config.sampling_rate, self._generator)


class WithoutReplacementSampler(Sampler):
    """Exactly B of the N users, uniformly without replacement (replace-one adjacency, RDP only)."""

    name = "without-replacement"
    neighboring_relation = NeighboringRelation.REPLACE_ONE
    guarantee = "replace one user"

    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        # Sensitivity of the sum under replace-one is 2ζ: the multiplier relative to it is σ/2.
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                config.num_users,
                config.expected_cohort,
                dp_accounting.GaussianDpEvent(config.noise_multiplier / 2),
            ),
            rounds,
        )

    def _cohort(self, round_index: int) -> torch.Tensor:
        perm = torch.randperm(self.config.num_users, generator=self._generator)
        return torch.sort(perm[: self.config.expected_cohort]).values


class AllUsersSampler(Sampler):
    """Every user every round (cross-silo); B = N."""

    name = "all"

    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(config.noise_multiplier), rounds
        )

    def _cohort(self, round_index: int) -> torch.Tensor:
        return torch.arange(self.config.num_users, dtype=torch.int64)


class CyclicPoissonSampler(Sampler):
    """Users hashed into b groups (``stable_group``); round t Poisson-samples group t mod b at q_b = B·b/N.

    A user's participations are then at least b rounds apart, as BandMF needs, and amplification by
    sampling still applies (Choquette-Choo et al. 2023, Thm. 4): a user can be sampled in ⌈t/b⌉ of the
    first t rounds.
    """

    name = "cyclic-poisson"

    def _build_groups(self) -> None:
        bands = self.config.bands
        groups = torch.tensor([stable_group(u, bands) for u in range(self.config.num_users)], dtype=torch.int64)
        users = torch.arange(self.config.num_users, dtype=torch.int64)
        self.groups = [users[groups == g] for g in range(bands)]

    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                config.sampling_rate, dp_accounting.GaussianDpEvent(config.noise_multiplier)
            ),
            math.ceil(rounds / config.bands),
        )

    def _cohort(self, round_index: int) -> torch.Tensor:
        members = self.groups[round_index % self.config.bands]
        return _poisson_subset(members, self.config.sampling_rate, self._generator)


class MinSepSampler(Sampler):
    """Deterministic participation: users split once into m = N // B fixed groups, visited in turn.

    The split is a seeded random permutation cut into m near-equal groups; round t takes group t mod m,
    so a user participates at most k = ⌈T/m⌉ times, m ≥ b rounds apart. With column-normalized C the
    sensitivity of k participations is √k (docs/explanation/mechanism.md, Noise), accounted as Gaussian(σ/√k).

    The schedule is fixed in advance from the public N, B and seed, so the guarantee is the one proved for
    deterministic-participation BandMF: **zero-out** adjacency, one user's data present or replaced by zeros
    within that schedule (not add/remove: removing a user would change the schedule). For the Gaussian event
    the accountant's ε is the same under either relation, so dp_accounting is asked with add/remove; the
    label (:attr:`guarantee`) says what is proved. Groups hold ⌊N/m⌋ or ⌈N/m⌉ users; the average still
    divides by the configured B (fixed denominator).
    """

    name = "min-sep"
    guarantee = "zero out one user's data (fixed participation schedule)"

    def _build_groups(self) -> None:
        perm = torch.randperm(self.config.num_users, generator=torch.Generator().manual_seed(self.seed))
        self.groups = [torch.sort(g).values for g in torch.tensor_split(perm, self.config.min_separation)]

    @classmethod
    def dp_event(cls, config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
        k = config.participations(rounds)
        return dp_accounting.GaussianDpEvent(config.noise_multiplier / math.sqrt(k))

    def _cohort(self, round_index: int) -> torch.Tensor:
        return self.groups[round_index % len(self.groups)].clone()


SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls
    for cls in (PoissonSampler, WithoutReplacementSampler, AllUsersSampler, CyclicPoissonSampler, MinSepSampler)
}


def sampler_class(sampler: str) -> type[Sampler]:
    """The :class:`Sampler` subclass named ``sampler`` (``PrivacyConfig.sampler``: one of ``fed_dp.config.SAMPLERS``).

    It needs the name only; a whole ``PrivacyConfig``, what it took before, is still accepted with a
    DeprecationWarning."""
    if isinstance(sampler, PrivacyConfig):
        warnings.warn("sampler_class(config) is deprecated: pass the sampler's name, sampler_class(config.sampler)",
                      DeprecationWarning, stacklevel=2)
        sampler = sampler.sampler
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[sampler]


def make_sampler(config: PrivacyConfig, seed: int | None = None) -> Sampler:
    """The sampler named by ``config.sampler`` (seeded from OS entropy unless ``seed`` is given)."""
    return sampler_class(config.sampler)(config, seed)


def dp_event(config: PrivacyConfig, rounds: int | None = None) -> dp_accounting.DpEvent:
    """The accounting event of ``rounds`` rounds (default: the planned T) of ``config``'s mechanism."""
    config.require_resolved("the accounting event")
    rounds = config.rounds if rounds is None else check_int("rounds", rounds, minimum=1)
    if config.noise == "blt":
        return blt_dp_event(config, rounds)
    return sampler_class(config.sampler).dp_event(config, rounds)


def blt_dp_event(config: PrivacyConfig, rounds: int) -> dp_accounting.DpEvent:
    """Gaussian(σ/sens_t) after t = ``rounds`` rounds of BLT noise (module docstring; ``fed_dp.blt``).

    The noise is calibrated to one participation (σζ·C⁻¹Z with C's largest column norm 1); the several
    participations a user can have enter only here, through sens_t ≥ 1.
    """
    if not (1 <= rounds <= config.rounds):
        raise ValueError(f"a BLT run of T = {config.rounds} rounds is accounted for 1 … T rounds, got {rounds}")
    return dp_accounting.GaussianDpEvent(config.noise_multiplier / math.sqrt(config_sensitivity_squared(config)[rounds - 1]))


def neighboring_relation(config: PrivacyConfig) -> NeighboringRelation:
    """The adjacency under which ``config``'s sampler is accounted (dp_accounting's relation)."""
    return sampler_class(config.sampler).neighboring_relation


def guarantee(config: PrivacyConfig) -> str:
    """The neighbouring relation of ``config``'s guarantee as proved, in words: add or remove one user, replace
    one user (sampling without replacement), or zero out one user's data (min-sep's fixed schedule)."""
    return sampler_class(config.sampler).guarantee
