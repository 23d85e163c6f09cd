"""``fed-dp audit``: a one-run empirical privacy check of a run configuration, with canary users.

    fed-dp audit [CONFIG] [--task MODULE:FUNCTION] [--set table.key=value ...] [--canaries 1000] [--json]
                 [--with-training] [--noise-scale S] [--canary-kind trained|injected]

It runs the config's mechanism once in this process, as ``fed-dp simulate`` does, with m canary candidates
(docs/how-to/audit.md; Andrew et al. 2024): m orthonormal random directions c_i, each inserted with
probability ½ as an extra user of the population (held-out candidates are never inserted). The run is
accounted as it ran: its population is N real users plus the inserted canaries. Three scores per candidate:

* ``final-model``: the adversary sees θ_T only; the score of c_i is its coefficient when θ_T − θ_0 is regressed
  on all m candidate directions (least squares);
* ``all-iterates``: the adversary sees every model: score Σ_t coefficient_t(c_i) / ‖θ_t − θ_{t−1}‖, the same
  regression on each round's change, scaled per round;
* the noisy sums ỹ_t themselves (what the accountant's Gaussian mechanism releases; every model is their
  post-processing): u_i = Σ_t coefficient(c_i in ỹ_t)/ζ, the statistic of the two hypothesis tests.

For each threat model it reports the accounted ε, the Gaussian-fit ε estimate, the one-run lower bound, that
bound's cap for m and δ and a verdict ("inconclusive" when the accounted ε is at or above the cap). Two tests
compare u with its exact law under the accounted σ, q and T (``fed_dp.audit``): the mechanism test (the
separation μ̂ of the inserted from the held-out canaries, with its power: against half the accounted noise,
and the smallest under-noising it detects with 80% power) and the clip test (the largest inserted score). The
verdicts are corrected together: Bonferroni over the F verdicts of the audit (the two lower bounds, and the two
tests where their law holds), each at confidence 1 − (1 − c)/F, so that an honest run gets a "leaks" verdict
with probability at most 1 − c.

Canaries trained by the clients (``canary_kind = "trained"``, the default). Every canary is a user with data,
trained and clipped by the run's own client code (``LocalTrainer``, with the config's local training, device,
``client.training`` path and chunk size: the one-step, vectorized or sequential path), its data chosen so that
its update before the clip is at least K·ζ along its direction (K = ``canary_norm``, by default 10·(B + 10σ),
:func:`default_canary_norm`). The canaries live in coordinates of their own: the audited model is the task's
model (its parameters first, as the run has them) plus a k × k linear map W without bias (k = ⌈√m⌉,
initialised to 0, reached by canary users only), and the candidates are m orthonormal rank-one matrices a_p b_qᵀ
of W (A, B Haar-random orthogonal matrices, m distinct cells (p, q) drawn at random). A canary's examples are n copies of
(b_q, s·a_p) with the loss −⟨s·a_p, W b_q⟩ (mean over a minibatch): its gradient is the constant −s·a_p b_qᵀ
whatever the minibatch, so each local step moves W along c_i; s = Kζ/η (η the local learning rate) makes the
first step alone of norm Kζ, and further steps (epochs, momentum) add along the same direction. n is the first
real user's number of examples, so a canary trains on the path a real user of that size takes: the canary
model is the task's model plus one linear layer, so the choice of path (BatchNorm, dropout, convolutions on a
CPU, the one-step path's layers) is the task model's, except that the canary loss is one the one-step path
takes (it has ``per_example``) and the CPU's size limit for vectorizing counts the k² extra parameters. The
audit reports the paths that ran. The canaries are trained as one node of their own, in the order the sampler
drew them.

Why a skipped clip is flagged. A clip skipped for a user changes what is released only when that user's update
is above ζ, and the audit can attribute a release only to users whose updates it knows: the canaries. Clipped,
a canary contributes ζ·c_i (a float32 clip rounds it down, not up), so the tests' laws hold. A canary whose
clip is skipped leaves its client with at least Kζ along c_i; the server then re-clips the node's sum S to nζ
(n: the users the node reports, real ones included; ``fed_dp.round``), and since ‖S‖ ≤ (n − 1)ζ + ‖Δ‖ when the
others are clipped, the release still carries at least e·ζ along c_i, e = nK/(n − 1 + K)
(:func:`unclipped_score`: about n when K ≫ n; the in-process engine and this audit send the whole cohort as one
node). That round's coefficient of the canary is then at least e + σ·ξ, and the clip test (the largest
coefficient of an inserted canary in any one noisy sum) flags one such release with probability at least
``power_one_unclipped`` = Φ̄((x* − e)/σ), x* its critical value (below 1 + 7σ for up to 10⁹ canary-rounds at the
default levels; the audit reports the power with e at the smallest node of the run: ≥ 0.998 once e ≥ 1 + 10σ). The
mean-based mechanism test sees it less: it sums over the rounds, and the node's re-clip also shrinks the users
of that round. A bug that skips the clip for a share of a node's users chosen by anything but their data (a
position in a chunk, an index, chance) skips the canaries' node in the same share, since the canaries go
through the same code. The real users add nothing along the canaries' coordinates:
with the mechanism only (the default) they send zero updates, whose clip is the identity, so a skip there
releases nothing more and there is nothing to detect; with training (``--with-training``) they train the task's
model on their data through the same code (their clip runs, and a bug that skips it skips canaries too), and
their updates, unknown to the audit, are 0 on W: the noisy sums' coefficients on the candidates keep their
exact law, and both tests run in both modes.

Limits of trained canaries: scale-then-privatize is refused (users clip s_t ⊙ Δ, so a canary's released
direction would depend on s_t: audit it with injected canaries); with local weight decay λ the canary's update
also shrinks its other coordinates (−ηλθ per step), so its part along c_i after the clip is below ζ (the tests
err towards "consistent") and the shrinking of W adds a relative ηλ·‖W‖/(Kζ) per local step along the other
candidates.

Injected canaries (``canary_kind = "injected"``): the candidates are directions of the model's own d parameters
(this needs d ≥ 2m), and an inserted canary adds ζ_t·c_i to the round's sum after the clients, without any
client code: no clip runs for them, so a client's clip is not audited. With training the real users' updates
enter the candidates' coefficients with a law the tests cannot know, so they are not run; on the main job those
updates hide much of the canaries (μ̂ 0.33 against 0.76 without training: they add to the scores' spread and
partly undo the canaries' displacement; docs/how-to/audit.md).

Mode. By default the real users are sampled and counted but send zero updates (mechanism only); ``--with-training``
trains them too. ``privacy.noise-multiplier = 0`` (the non-private baseline, as in ``fed-dp simulate``): the run
adds no noise and its accounted ε is infinite. ``noise_scale`` (``--noise-scale``, a self-test) adds that
multiple of the configured noise while the accounting keeps the configured σ: a deliberately broken mechanism
that the audit must flag (0.25: four times too little noise), never for training.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fed_dp.accounting import resolve_privacy
from fed_dp.audit import (bonferroni_confidence, clip_test, confidence_label, detectable_noise_scale,
                          gaussian_fit_epsilon, lower_bound_cap, lower_bound_verdict, mechanism_test,
                          mechanism_test_power, one_run_lower_bound)
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.task import Task, Users, initial_model
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.noise import Privatizer
from fed_dp.optimizers import ServerOptimizer
from fed_dp.moment_estimation import noise_stds
from fed_dp.randomness import derive_seed
from fed_dp.sampling import neighboring_relation
from fed_dp.contribution import Contribution, RoundPlan
from fed_dp.round import init_server
from fed_dp.round_loop import RoundReplies, run_rounds
from fed_dp.run_config import CLIENT_DEFAULTS
from fed_dp.schema import UNSET

THREAT_MODELS = ("final-model", "all-iterates")
#: Where the canaries come from (module docstring): users trained and clipped by the clients, or updates of norm ζ
#: added to the sum after them.
CANARY_KINDS = ("trained", "injected")


@dataclass(frozen=True)
class CanarySpace:
    """Where the m candidates live in the flat model: coordinates [offset, offset + width) (all of θ for injected
    canaries, the probe W for trained ones). ``directions``: their (m, width) orthonormal rows (float32);
    ``projector``: P = (CCᵀ)⁻¹C (float64), so that P·x are the least-squares coefficients of x on them."""

    offset: int
    directions: torch.Tensor
    projector: torch.Tensor

    @classmethod
    def of(cls, offset: int, directions: torch.Tensor) -> "CanarySpace":
        c = directions.double()
        return cls(offset, directions, torch.linalg.solve(c @ c.T, c))

    def coefficients(self, flat: torch.Tensor) -> torch.Tensor:
        """P·x of the candidates' coordinates of a flat vector (of θ's size or longer: a joint query's first
        part is the sum of the updates), float64 on the CPU."""
        width = self.projector.shape[1]
        return self.projector @ flat[self.offset : self.offset + width].double().cpu()


class AuditPrivatizer:
    """The run's privatizer, seen by the audit: it adds ``scale`` times the configured noise (1: the real
    mechanism; below 1, a deliberately weak mechanism for the audit's self-test, while the accounting still
    assumes the full noise) and, of the candidates' coefficients P·ỹ_t/ζ in every noisy sum ỹ_t it releases (its
    first entries: the sum of the updates, also under moment estimation), keeps their ``sums`` over the rounds
    and their ``maxima`` (the largest of any one round). Same interface as ``Privatizer``."""

    def __init__(self, inner: Privatizer, scale: float, space: CanarySpace, clip_norm: float) -> None:
        self.inner, self.scale = inner, float(scale)
        self.space, self.clip_norm = space, float(clip_norm)
        self.sums = torch.zeros(space.projector.shape[0], dtype=torch.float64)
        self.maxima = torch.full_like(self.sums, -math.inf)

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        total = total.to(self.inner.device, self.inner.dtype)
        noisy = self.inner.privatize(total, noise_std)
        if self.scale != 1.0:
            noisy = total + self.scale * (noisy - total)
        coefficients = self.space.coefficients(noisy) / self.clip_norm
        self.sums.add_(coefficients)
        torch.maximum(self.maxima, coefficients, out=self.maxima)
        return noisy

    def noise_variance(self, t: int | None = None) -> float:
        return self.scale**2 * self.inner.noise_variance(t)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


#: Samplers under which each user is in a round's cohort with probability q independently of the other rounds
#: (the law ``fed_dp.audit.mechanism_test`` assumes; conservative for without-replacement).
TESTED_SAMPLERS = ("poisson", "without-replacement", "all")


def _finite_or_none(value: Any) -> Any:
    """JSON has no infinity: an infinite or NaN float becomes null (nested dicts too)."""
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class AuditResult:
    """The audit of one run: accounted ε, per threat model the estimate, the lower bound, its cap and verdict,
    the mechanism and clip tests, how the verdicts are corrected together, and the scores.

    ``verdict_confidence``: the confidence of each of the ``verdicts`` verdicts (Bonferroni: all of them hold
    together at ``confidence``); ``canary_paths``: the client paths that trained the canaries (trained canaries)."""

    canaries: int
    inserted: int
    delta: float
    epsilon_accounted: float
    confidence: float
    privacy: PrivacyConfig
    mode: str = "mechanism-only"
    noise_scale: float = 1.0
    canary_kind: str = "trained"
    canary_norm: float = 1.0
    canary_paths: tuple[str, ...] = ()
    verdicts: int = 2
    verdict_confidence: float = 0.95
    lower_bound_cap: float = 0.0
    mechanism_test: dict[str, Any] = field(default_factory=dict)
    clip_test: dict[str, Any] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    inserted_mask: torch.Tensor | None = None

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready object per threat model (infinite values, e.g. the accounted ε without noise, are null,
        so that strict JSON encoders accept them)."""
        return [_finite_or_none({
            "threat_model": name, "mode": self.mode, "epsilon_accounted": self.epsilon_accounted,
            "delta": self.delta, "canaries": self.canaries, "inserted": self.inserted,
            "canary_kind": self.canary_kind, "canary_norm": self.canary_norm, "canary_paths": list(self.canary_paths),
            "confidence": self.confidence, "verdicts": self.verdicts, "verdict_confidence": self.verdict_confidence,
            "noise_scale": self.noise_scale, "lower_bound_cap": self.lower_bound_cap, **values,
            "mechanism_test": self.mechanism_test, "clip_test": self.clip_test,
        }) for name, values in self.results.items()]


def _canary_directions(count: int, dim: int, seed: int) -> torch.Tensor:
    """``count`` orthonormal directions of R^d, uniformly random (Q of the QR decomposition of a d × count
    Gaussian matrix): a canary's update then has no component on any other candidate, and the noise's
    coefficients on them are independent (what ``fed_dp.audit.mechanism_test`` relies on)."""
    gaussian = torch.randn(dim, count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).T.contiguous().float()  # signs fixed: the uniform (Haar) law


def probe_width(canaries: int) -> int:
    """k = ⌈√m⌉: the side of the probe W, whose k² ≥ m cells hold the m rank-one candidates."""
    return math.isqrt(canaries - 1) + 1


def _rank_one_candidates(count: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, directions): ``count`` orthonormal rank-one k × k matrices a_i b_iᵀ, with a_i, b_i columns of two
    Haar-random orthogonal matrices A, B at distinct cells (p_i, q_i) drawn at random: ⟨a_i b_iᵀ, a_j b_jᵀ⟩ =
    ⟨a_i, a_j⟩⟨b_i, b_j⟩ = [i = j]. ``a``, ``b``: (m, k) float64; ``directions``: (m, k²) float32, row-major
    as the probe's weight is flattened."""
    a_basis = _canary_directions(width, width, derive_seed(seed, "rows")).double()
    b_basis = _canary_directions(width, width, derive_seed(seed, "columns")).double()
    cells = torch.randperm(width * width, generator=torch.Generator().manual_seed(derive_seed(seed, "cells")))[:count]
    a, b = a_basis[cells // width], b_basis[cells % width]
    return a, b, torch.einsum("ip,iq->ipq", a, b).reshape(count, width * width).float()


class CanaryProbe(nn.Module):
    """The audited model with trained canaries: the task's ``model`` (its parameters first, in the run's order) and
    ``probe``, a k × k linear map without bias initialised to 0. Calling it applies the probe only: only canary
    users call it (the real users train the task's model itself)."""

    def __init__(self, model: nn.Module, width: int) -> None:
        super().__init__()
        self.model = model
        self.probe = nn.Linear(width, width, bias=False)
        nn.init.zeros_(self.probe.weight)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.probe(inputs)


def _canary_terms(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example terms of :func:`canary_loss`: a_j = −⟨target_j, W·input_j⟩, b_j = 1."""
    inputs, targets = batch
    return -(model(inputs) * targets).sum(dim=-1), torch.ones(inputs.shape[0], dtype=inputs.dtype, device=inputs.device)


def canary_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """−mean_j ⟨target_j, W·input_j⟩: for a canary's n copies of (b, s·a) its gradient in W is the constant −s·abᵀ
    (module docstring)."""
    numerators, _ = _canary_terms(model, batch)
    return numerators.mean()


canary_loss.per_example = _canary_terms  # type: ignore[attr-defined]  # the one-step path's per-example form


def default_canary_norm(noise_multiplier: float, expected_cohort: int) -> float:
    """K = 10·(B + 10σ): a canary's update before its clip, over ζ. What one unclipped release keeps after the
    server's re-clip of its node, e = nK/(n − 1 + K) (:func:`unclipped_score`), is then about n, not limited by
    K (e ≥ 0.9n for a node of n ≤ B users), and K is ten times more than the clip test's critical value can be
    (below 1 + 7σ, ``fed_dp.audit``)."""
    return 10.0 * (expected_cohort + 10.0 * noise_multiplier)


def unclipped_score(canary_norm: float, node: int) -> float:
    """e = nK/(n − 1 + K): the least a canary's release carries along its direction, over ζ, when its clip is
    skipped (update ≥ Kζ) and the other n − 1 users the node reports are clipped: the server re-clips the node's
    sum S to nζ (``fed_dp.round``), and ‖S‖ ≤ (n − 1)ζ + ‖Δ‖ keeps nζ·‖Δ‖/‖S‖ ≥ e (module docstring)."""
    return node * canary_norm / (node - 1 + canary_norm)


def _trained_canaries(task: Task, inserted_ids: torch.Tensor, canaries: int, seed: int, *, step: float,
                      offset: int) -> tuple[Task, CanarySpace]:
    """The task of the inserted canaries and the space of the m candidates, in the probe's coordinates after the
    task model's ``offset`` parameters (module docstring). Canary j of the task is candidate ``inserted_ids[j]``:
    n copies (n: the first real user's number of examples) of the input b_i and the target ``step``·a_i; its
    model is a :class:`CanaryProbe` of the task's model."""
    width = probe_width(canaries)
    a, b, directions = _rank_one_candidates(canaries, width, seed)
    copies = len(task.users[0])
    ids = inserted_ids.tolist()
    users = Users.in_memory([(b[i].float().expand(copies, width).clone(),
                              (step * a[i]).float().expand(copies, width).clone()) for i in ids],
                            ids=[f"canary-{i}" for i in ids])
    canary_task = Task(model=lambda: CanaryProbe(task.build_model(), width), users=users, loss=canary_loss,
                       name="audit-canaries")
    return canary_task, CanarySpace.of(offset, directions)


def _untested_reason(privacy: PrivacyConfig, *, mechanism_only: bool, no_noise: bool, canary_kind: str) -> str | None:
    """Why the hypothesis tests' law does not hold for this audit (None: it does)."""
    if no_noise:
        return "no noise is accounted (epsilon is infinite): nothing to test against"
    if not mechanism_only and canary_kind == "injected":
        return ("the real users' updates (the training's drift) enter the injected canaries' coefficients with an "
                "unknown law; audit with trained canaries, or without --with-training, to test the mechanism")
    if privacy.noise != "independent":
        return f"the test's law is derived for independent noise, not {privacy.noise}; the lower bound only"
    if privacy.sampler not in TESTED_SAMPLERS:
        return (f"the test's law assumes every user sampled with probability q in every round, which the "
                f"{privacy.sampler} sampler does not do; the lower bound only")
    return None


def _accounted_noise_multiplier(privacy: PrivacyConfig, optimizer: ServerOptimizer, dim: int) -> float:
    """The accounted noise std on the sum of updates over ζ: σ, or σ·Δ/Δ₁ for the joint query of independent
    moment estimation (``fed_dp.moment_estimation.noise_stds``), computed from the config, not the privatizer."""
    if not optimizer.needs.squares:
        return privacy.noise_multiplier
    first, _ = noise_stds(privacy.noise_multiplier, privacy.clip_norm, optimizer.ime_alpha,
                          neighboring_relation(privacy), dim)
    return first / privacy.clip_norm


def _padded(result: Contribution, width: int) -> Contribution:
    """A contribution to the task's model, extended with zeros on the probe's ``width`` coordinates."""
    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t.cpu(), t.new_zeros(width, device="cpu")])
    return replace(result, total=pad(result.total), total_squares=pad(result.total_squares))


def _summed(parts: list[Contribution]) -> Contribution:
    """The contributions of the real users and of the canaries as one node's reply (on the CPU)."""
    squares = [p.total_squares for p in parts]
    unclipped = [p.unclipped for p in parts]
    return Contribution(sum(p.total.cpu() for p in parts), sum(p.count for p in parts),
                        None if any(s is None for s in squares) else sum(s.cpu() for s in squares),
                        unclipped=None if any(u is None for u in unclipped) else sum(unclipped),
                        scaled=parts[0].scaled)


def run_audit(task: Task, privacy: PrivacyConfig, optimizer: ServerOptimizer, local: LocalTraining, *,
              canaries: int = 1000, seed: int = 0, confidence: float = 0.95, noise_scale: float = 1.0,
              no_noise: bool = False, mechanism_only: bool = False, device: str = "cpu",
              training: str = CLIENT_DEFAULTS.training, chunk_size: int | None = CLIENT_DEFAULTS.chunk_size,
              canary_kind: str = "trained", canary_norm: float | None = None) -> AuditResult:
    """Run ``task``'s mechanism once with ``canaries`` candidates and audit it (module docstring); ``confidence``:
    of all its verdicts together (Bonferroni: each at 1 − (1 − c)/F, ``AuditResult.verdict_confidence``).
    ``no_noise``: add no noise at all (accounted ε = ∞); the configured σ is then only a placeholder for the code
    that needs one. ``mechanism_only``: the real users are sampled and counted but send zero updates (``fed-dp audit``'s
    default). ``noise_scale``: add that multiple of the configured noise (the self-test of a broken mechanism).
    ``device``, ``training``, ``chunk_size``: where and how users train (``LocalTrainer``, the config's
    ``[client]``), canaries included. ``canary_kind``: ``"trained"`` (users trained and clipped by the clients)
    or ``"injected"`` (:data:`CANARY_KINDS`); ``canary_norm``: K, a trained canary's update before its clip over
    ζ (default :func:`default_canary_norm` of the accounted σ and B)."""
    _check_audit_arguments(canaries, noise_scale, canary_kind, canary_norm, optimizer)
    trained = canary_kind == "trained"
    if no_noise:
        noise_scale = 0.0
    with simulation():
        generator = torch.Generator().manual_seed(derive_seed(seed, "audit"))
        inserted = torch.rand(canaries, generator=generator) < 0.5
        inserted_ids = torch.nonzero(inserted).flatten()
        real = task.num_users
        privacy = resolve_privacy(privacy.replace(num_users=None), real + len(inserted_ids))
        if canary_norm is None:
            canary_norm = default_canary_norm(privacy.noise_multiplier, privacy.expected_cohort)
        _, real_layout, real_params = initial_model(task, seed)
        if trained:  # s = Kζ/η: the first local step alone moves W by Kζ
            canary_task, space = _trained_canaries(task, inserted_ids, canaries, derive_seed(seed, "canaries"),
                                                   step=canary_norm * privacy.clip_norm / local.lr,
                                                   offset=real_layout.size)
            _, layout, params = initial_model(canary_task, seed)  # θ_0 of the task's model, then W = 0
            canary_trainer = LocalTrainer(canary_task, local, device=device, training=training, chunk_size=chunk_size,
                                          seed=seed)  # frozen parameters as initial_model built them
        else:
            layout, params = real_layout, real_params
            space = _injected_canaries(canaries, layout.size, derive_seed(seed, "canaries"))
        extra = layout.size - real_layout.size  # the probe's coordinates (0 for injected canaries)
        trainer = None if mechanism_only else LocalTrainer(task, local, device=device, training=training,
                                                           chunk_size=chunk_size, seed=seed)
        state = init_server(privacy, optimizer, params, seed=seed)
        audited = AuditPrivatizer(state.privatizer, noise_scale, space, privacy.clip_norm)
        state.privatizer = audited
        client_seed = derive_seed(seed, "local-training")
        paths: Counter[str] = Counter()
        nodes: list[int] = []  # the users the node reports in each round that trained canaries

        def exchange(plan: RoundPlan) -> RoundReplies:
            cohort = plan.cohort
            users, canary_users = cohort[cohort < real], cohort[cohort >= real] - real
            if trainer is None:  # the real users reply zero updates (their clip is the identity)
                zero = torch.zeros_like(plan.params).cpu()
                parts = [Contribution(zero, len(users), zero.clone() if plan.send_squares else None,
                                      unclipped=len(users), scaled=plan.scale is not None)]
            else:
                scale = None if plan.scale is None else plan.scale[: real_layout.size]
                mine, _, _ = trainer.contribution(replace(plan, params=plan.params[: real_layout.size], scale=scale),
                                                  users.tolist(), seed=client_seed)
                parts = [_padded(mine, extra)]
            if trained and len(canary_users):
                theirs, _, path = canary_trainer.contribution(plan, canary_users.tolist(), seed=client_seed)
                paths[path] += 1
                nodes.append(len(cohort))
                parts.append(theirs)
            elif len(canary_users):  # injected: each already of norm ζ_t (in θ's coordinates), after the clients
                updates = plan.clip_norm * space.directions[inserted_ids[canary_users]]
                parts.append(Contribution(updates.sum(dim=0), len(canary_users),
                                          updates.square().sum(dim=0) if plan.send_squares else None,
                                          unclipped=len(canary_users), scaled=plan.scale is not None))
            return RoundReplies([_summed(parts)])

        observe = _AllIterates(space, state.params, canaries)
        loop = run_rounds(state, exchange, evaluate=observe, eval_every=1, max_empty_rounds=10**9)
    scores = {"final-model": space.coefficients(loop.state.params - params), "all-iterates": observe.scores}
    accounted = math.inf if no_noise else float(loop.records[-1]["epsilon"])
    reason = _untested_reason(privacy, mechanism_only=mechanism_only, no_noise=no_noise, canary_kind=canary_kind)
    verdicts = len(THREAT_MODELS) + (2 if reason is None else 0)
    each = bonferroni_confidence(confidence, verdicts)
    result = AuditResult(canaries=canaries, inserted=len(inserted_ids), delta=privacy.delta,
                         epsilon_accounted=accounted, confidence=confidence, privacy=privacy,
                         mode="mechanism-only" if mechanism_only else "with training", noise_scale=noise_scale,
                         canary_kind=canary_kind, canary_norm=float(canary_norm) if trained else 1.0,
                         canary_paths=tuple(sorted(paths)), verdicts=verdicts, verdict_confidence=each,
                         lower_bound_cap=lower_bound_cap(canaries, privacy.delta, confidence=each),
                         scores=scores, inserted_mask=inserted)
    _estimate_and_bound(result)
    sigma = _accounted_noise_multiplier(privacy, optimizer, layout.size)
    released = loop.state.round  # T: the noisy sums released (the records also hold round 0, the initial model)
    law = {"noise_multiplier": sigma, "rounds": released, "sampling_rate": privacy.sampling_rate,
           "confidence": each}
    if reason is None:
        _statistical_tests(result, audited, law, canary_norm, nodes)
    else:
        result.mechanism_test = result.clip_test = {"verdict": "not tested", "reason": reason}
        if not no_noise:  # what the training's drift adds to the noise, in units of the accounted noise
            spread = float(audited.sums[~inserted].std()) / (sigma * math.sqrt(released))
            result.mechanism_test = {**result.mechanism_test, "held_out_spread": spread}
    return result


def _check_audit_arguments(canaries: Any, noise_scale: Any, canary_kind: Any, canary_norm: Any,
                           optimizer: ServerOptimizer) -> None:
    """The ValueErrors of :func:`run_audit` for arguments it cannot audit with, before anything runs."""
    if not (isinstance(canaries, int) and canaries >= 4):
        raise ValueError(f"canaries must be an integer >= 4, got {canaries!r}")
    if not (isinstance(noise_scale, (int, float)) and math.isfinite(noise_scale) and noise_scale >= 0):
        raise ValueError(f"noise_scale must be a finite number >= 0 (1: the real mechanism), got {noise_scale!r}")
    if canary_kind not in CANARY_KINDS:
        raise ValueError(f"canary_kind must be one of {', '.join(CANARY_KINDS)}, got {canary_kind!r}")
    if canary_norm is not None and not (isinstance(canary_norm, (int, float)) and math.isfinite(canary_norm)
                                        and canary_norm >= 1):
        raise ValueError(f"canary_norm must be a finite number >= 1 (a multiple of the clip norm), got {canary_norm!r}")
    if canary_kind == "trained" and optimizer.needs.broadcast_scale:
        raise ValueError("trained canaries cannot audit scale-then-privatize: users clip s_t ⊙ Δ, so a canary's "
                         "released direction would depend on s_t; audit it with injected canaries "
                         "(--canary-kind injected)")


def _injected_canaries(canaries: int, size: int, seed: int) -> CanarySpace:
    """The directions of injected canaries in the model's own d = ``size`` coordinates; a ValueError when d is too
    small to tell them apart."""
    if size < 2 * canaries:
        raise ValueError(f"injected canaries need a model of at least 2 × canaries parameters to tell "
                         f"{canaries} canary directions apart; this one has d = {size}. Use "
                         f"--canaries {max(4, size // 2)} or fewer, or trained canaries")
    return CanarySpace.of(0, _canary_directions(canaries, size, seed))


class _AllIterates:
    """The all-iterates adversary's scores: sees every released model (a ``run_rounds`` evaluation) and adds each
    round's change, projected on the canary directions and divided by its norm."""

    def __init__(self, space: CanarySpace, params: torch.Tensor, canaries: int) -> None:
        self.space, self.previous = space, params.clone()
        self.scores = torch.zeros(canaries, dtype=torch.float64)

    def __call__(self, rounds_done: int, theta: torch.Tensor) -> dict[str, float]:
        change = (theta - self.previous).double()
        if float(change.norm()) > 0:
            self.scores.add_(self.space.coefficients(change) / change.norm())
        self.previous = theta.clone()
        return {}


def _estimate_and_bound(result: AuditResult) -> None:
    """For each threat model, from its scores: the ε estimate of a Gaussian fit, the one-run lower bound and its
    verdict against the accounted ε."""
    inserted, delta, each = result.inserted_mask, result.delta, result.verdict_confidence
    for name in THREAT_MODELS:
        scores = result.scores[name]
        estimate, mu = gaussian_fit_epsilon(scores[inserted], scores[~inserted], delta)
        bound = one_run_lower_bound(scores, inserted, delta, confidence=each)
        verdict = lower_bound_verdict(bound["epsilon_lower_bound"], result.lower_bound_cap, result.epsilon_accounted,
                                      each)
        result.results[name] = {"epsilon_estimate": estimate, "mu": mu, **bound, "lower_bound_verdict": verdict}


def _statistical_tests(result: AuditResult, audited: AuditPrivatizer, law: dict[str, Any], canary_norm: float,
               nodes: list[int]) -> None:
    """The mechanism test (with its power at half the noise and the noise scale it detects with power 0.8) and the
    clip test, on the noisy sums and per-round maxima the audited privatizer kept."""
    inserted, groups = result.inserted_mask, (result.inserted, result.canaries - result.inserted)
    result.mechanism_test = {**mechanism_test(audited.sums, inserted, **law),
                             "power_half_noise": mechanism_test_power(*groups, **law, noise_scale=0.5),
                             "noise_scale_80": detectable_noise_scale(*groups, **law, power=0.8)}
    result.clip_test = clip_test(audited.maxima, inserted, **law,
                                 unclipped_score=unclipped_score(canary_norm, min(nodes)) if nodes else None)


#: ``[server]`` keys of a run configuration that the audit does not act on (it refuses them).
AUDIT_IGNORED_KEYS = ("server.checkpoint-dir", "server.max-empty-rounds", "server.noise-source")


def audit_config(config: dict[str, Any], *, canaries: int, confidence: float, optimizer: str | None = None,
                 task: Task | None = None, mechanism_only: bool = True, noise_scale: float = 1.0,
                 canary_kind: str = "trained") -> AuditResult:
    """Audit a ``fed-dp simulate`` config (tables as read from TOML, ``--set`` applied): its task, privacy,
    local training, ``[client]`` and seed; its optimizer (``optimizer``, else the config's, else the first of
    ``run.optimizers``). ``privacy.noise-multiplier = 0`` audits the run without noise."""
    from fed_dp.clients.task import build_task
    from fed_dp.simulations.experiments.runner import parse_experiment, refuse_keys

    refuse_keys(config, AUDIT_IGNORED_KEYS, "fed-dp audit", "the audit runs its rounds in memory with the seeded "
                "noise it measures (no checkpoints, no secure noise, no stop on empty rounds)")
    config = json.loads(json.dumps(config))  # a deep copy of plain data
    privacy_table = config.setdefault("privacy", {})
    no_noise = privacy_table.get("noise-multiplier") == 0
    if no_noise:
        if privacy_table.get("target-epsilon", UNSET) != UNSET:
            raise ValueError("privacy.noise-multiplier = 0 audits a run without noise; leave privacy.target-epsilon "
                             "out (or unset it: --set 'privacy.target-epsilon=\"\"')")
        privacy_table["noise-multiplier"] = 1.0  # a placeholder: no noise is added, the accounted ε is ∞
    experiment = parse_experiment(config, command="fed-dp audit")
    name = optimizer or next(iter(experiment.runs))
    if name not in experiment.runs:
        raise ValueError(f"optimizer {name!r} is not among the config's {list(experiment.runs)}")
    run = experiment.runs[name]
    if run.adaptive.enabled:
        raise ValueError("fed-dp audit measures the mechanism with a fixed clip norm; adaptive clipping (its clip "
                         "bits and moving ζ) is not audited: set adaptive.enabled = false or remove [adaptive]")
    task = task if task is not None else build_task(run.task)
    seed = run.run.seed if run.run.seed is not None else 0
    return run_audit(task, run.privacy, run.optimizer.build(), run.local, canaries=canaries, seed=seed,
                     confidence=confidence, no_noise=no_noise, mechanism_only=mechanism_only, noise_scale=noise_scale,
                     device=run.client.device, training=run.client.training, chunk_size=run.client.chunk_size,
                     canary_kind=canary_kind)


def _format_tests(result: AuditResult) -> list[str]:
    """The mechanism test with its power, and the clip test (or why they were not run)."""
    test, clip = result.mechanism_test, result.clip_test
    if test["verdict"] == "not tested":
        spread = (f"; held-out spread {test['held_out_spread']:.3f} of the accounted noise"
                  if "held_out_spread" in test else "")
        return [f"mechanism and clip tests: not tested ({test['reason']}){spread}"]
    level = confidence_label(test["confidence"])
    scale = test["noise_scale_80"]
    lines = [
        f"mechanism test (one-sided, {level}): the canaries' separation on the noisy sums is mu = {test['mu']:.3f}, "
        f"{test['mu_expected']:.3f} expected under the accounted sigma; held-out spread {test['held_out_spread']:.3f} "
        f"of the accounted noise; p = {test['p_value']:.3g}: {test['verdict']}",
        f"  its power (exact law at the accounted sigma, q, T and these canaries): {test['power_half_noise']:.4f} "
        "against half the accounted noise; 80% power from noise scale "
        + (f"{scale:.3f} ({1 / scale:.3f}x too little noise, or every canary released at {1 / scale:.3f} x zeta)"
           if scale > 0 else "none (no under-noising reaches it)"),
        f"clip test (one-sided, {level}): the largest coefficient of an inserted canary in one noisy sum is "
        f"{clip['max_score']:.2f} (threshold {clip['threshold']:.2f}); p = {clip['p_value']:.3g}: {clip['verdict']}",
    ]
    if "power_one_unclipped" in clip:
        lines.append(f"  one canary release with its clip skipped (>= {result.canary_norm:.0f} x zeta from the client, "
                     f">= {clip['unclipped_score']:.1f} x zeta after the node's re-clip) is flagged with probability "
                     f">= {clip['power_one_unclipped']:.4f}")
    return lines


def format_audit(result: AuditResult) -> str:
    """The audit as a table, one row per threat model, then the tests of the mechanism and of the clip."""
    privacy = result.privacy
    mode = ("mechanism only (the real users send zero updates)" if result.mode == "mechanism-only"
            else "with training (the real users train)")
    kind = (f"trained and clipped by the clients ({', '.join(result.canary_paths) or 'none sampled'}), each "
            f"update {result.canary_norm:.0f} x zeta or more before its clip" if result.canary_kind == "trained"
            else "injected at zeta after the clients (no client clip)")
    lines = [
        f"canaries: {result.canaries} candidates, {result.inserted} inserted (each with probability 1/2); {mode}",
        f"canary updates: {kind}",
        f"population: N = {privacy.num_users - result.inserted} users + {result.inserted} canaries, "
        f"B = {privacy.expected_cohort}, T = {privacy.rounds}, "
        + ("no noise" if math.isinf(result.epsilon_accounted) else f"sigma = {privacy.noise_multiplier:.4f}")
        + f", delta = {result.delta:g}",
    ]
    if result.noise_scale != 1.0 and not math.isinf(result.epsilon_accounted):
        lines.append(f"SELF-TEST: the mechanism adds {result.noise_scale:g} x the accounted noise (--noise-scale); "
                     "the audit should flag it")
    level = confidence_label(result.verdict_confidence)
    lines += [
        f"verdicts: {result.verdicts}, corrected together (Bonferroni): each at confidence {level}, all of them "
        f"together at {confidence_label(result.confidence)}",
        f"lower bound cap: {result.lower_bound_cap:.4f} (the most {result.canaries} canaries can certify at "
        f"delta = {result.delta:g}, {level}); at an accounted epsilon at or above it the bound is inconclusive",
        "",
        f"{'threat model':<13} {'accounted eps':>13} {'eps estimate':>12} {'mu':>6} "
        f"{f'lower bound ({level})':>17} {'correct guesses':>16}  lower bound verdict",
    ]
    for name, values in result.results.items():
        lines.append(f"{name:<13} {result.epsilon_accounted:>13.4f} {values['epsilon_estimate']:>12.4f} "
                     f"{values['mu']:>6.3f} {values['epsilon_lower_bound']:>17.4f} "
                     f"{values['correct']:>8}/{values['guesses']:<7}  {values['lower_bound_verdict']}")
    lines += ["", *_format_tests(result)]
    return "\n".join(lines)


def plot_audit(result: AuditResult, path: Path) -> Path:
    """Histograms of the canary scores, inserted against held out, one panel per threat model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result.scores), figsize=(6 * len(result.scores), 4))
    for ax, (name, scores) in zip(axes, result.scores.items()):
        values = result.results[name]
        bins = torch.linspace(float(scores.min()), float(scores.max()), 41).tolist()
        ax.hist(scores[~result.inserted_mask].tolist(), bins=bins, alpha=0.6, label="held out", density=True)
        ax.hist(scores[result.inserted_mask].tolist(), bins=bins, alpha=0.6, label="inserted", density=True)
        ax.set_title(f"{name}: estimate ε = {values['epsilon_estimate']:.2f}, lower bound "
                     f"{values['epsilon_lower_bound']:.2f} (accounted {result.epsilon_accounted:.2f})", fontsize=9)
        ax.set_xlabel("canary score")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
