"""``fed-dp audit``: a one-run empirical privacy check of a run configuration, with canary users.

    fed-dp audit [CONFIG] [--task MODULE:FUNCTION] [--set table.key=value ...] [--canaries 1000] [--json]
                 [--with-training] [--noise-scale S]

It runs the config's mechanism once in this process, as ``fed-dp simulate`` does, with m canary candidates
(docs/how-to/audit.md; Andrew et al. 2024): m orthonormal random directions c_i of the model's d parameters, each
inserted with probability ½ as an extra user of the population whose clipped update is always ζ_t·c_i whenever
the sampler picks it (held-out candidates are never inserted). The run is accounted as it ran: its population
is N real users plus the inserted canaries. Three scores per candidate:

* ``final-model``: the adversary sees θ_T only; the score of c_i is its coefficient when θ_T − θ_0 is regressed
  on all m candidate directions (least squares; this needs d ≥ 2m);
* ``all-iterates``: the adversary sees every model: score Σ_t coefficient_t(c_i) / ‖θ_t − θ_{t−1}‖, the same
  regression on each round's change, scaled per round;
* the noisy sums ỹ_t themselves (what the accountant's Gaussian mechanism releases; every model is their
  post-processing): u_i = Σ_t coefficient(c_i in ỹ_t)/ζ, the statistic of the hypothesis test.

For each threat model it reports the accounted ε, the Gaussian-fit ε estimate, the one-run lower bound at the
stated confidence, that bound's cap for m and δ and a verdict ("inconclusive" when the accounted ε is at or
above the cap). The hypothesis test (``fed_dp.audit.mechanism_test``) compares u's separation μ̂ with its exact
law under the accounted σ, q and T and gives a p-value and a verdict at the stated confidence.

Mode. By default the real users are sampled and counted but send zero updates (mechanism only): the scores see
the mechanism (sampling, clipping, noise, server optimizer) and nothing else, which is the setting of the
privacy proof and the one whose law the test knows exactly. ``--with-training`` trains the real users too;
their updates then enter the noisy sums with a law the test cannot know, so it is not run, and on the main job
they hide much of the canaries (μ̂ 0.33 against 0.76 without training: they add to the scores' spread and
partly undo the canaries' displacement; docs/how-to/audit.md).

``privacy.noise-multiplier = 0`` (the non-private baseline, as in ``fed-dp simulate``): the run adds no noise
and its accounted ε is infinite. ``noise_scale`` (``--noise-scale``, a self-test) adds that multiple of the configured noise while the
accounting keeps the configured σ: a deliberately broken mechanism that the audit must flag (0.25: four times
too little noise), never for training.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fed_dp.accounting import resolve_privacy
from fed_dp.audit import (gaussian_fit_epsilon, lower_bound_cap, lower_bound_verdict, mechanism_test,
                          one_run_lower_bound)
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.task import Task, initial_model
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


class AuditPrivatizer:
    """The run's privatizer, seen by the audit: it adds ``scale`` times the configured noise (1: the real
    mechanism; below 1, a deliberately weak mechanism for the audit's self-test, while the accounting still
    assumes the full noise) and adds to ``sums`` the candidates' coefficients P·ỹ_t/ζ in every noisy sum ỹ_t it
    releases (its first d entries: the sum of the updates, also under moment estimation). Same interface as
    ``Privatizer``."""

    def __init__(self, inner: Privatizer, scale: float, projector: torch.Tensor, clip_norm: float) -> None:
        self.inner, self.scale = inner, float(scale)
        self.projector, self.clip_norm = projector, float(clip_norm)
        self.sums = torch.zeros(projector.shape[0], dtype=torch.float64)

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        total = total.to(self.inner.device, self.inner.dtype)
        noisy = self.inner.privatize(total, noise_std)
        if self.scale != 1.0:
            noisy = total + self.scale * (noisy - total)
        self.sums.add_(self.projector @ noisy[: self.projector.shape[1]].double().cpu() / self.clip_norm)
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
    the hypothesis test of the mechanism, and the scores."""

    canaries: int
    inserted: int
    delta: float
    epsilon_accounted: float
    confidence: float
    privacy: PrivacyConfig
    mode: str = "mechanism-only"
    noise_scale: float = 1.0
    lower_bound_cap: float = 0.0
    mechanism_test: dict[str, Any] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    inserted_mask: torch.Tensor | None = None

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready object per threat model (infinite values, e.g. the accounted ε without noise, are null,
        so that strict JSON encoders accept them)."""
        return [_finite_or_none({
            "threat_model": name, "mode": self.mode, "epsilon_accounted": self.epsilon_accounted,
            "delta": self.delta, "canaries": self.canaries, "inserted": self.inserted,
            "confidence": self.confidence, "noise_scale": self.noise_scale,
            "lower_bound_cap": self.lower_bound_cap, **values, "mechanism_test": self.mechanism_test,
        }) for name, values in self.results.items()]


def _canary_directions(count: int, dim: int, seed: int) -> torch.Tensor:
    """``count`` orthonormal directions of R^d, uniformly random (Q of the QR decomposition of a d × count
    Gaussian matrix): a canary's update then has no component on any other candidate, and the noise's
    coefficients on them are independent (what ``fed_dp.audit.mechanism_test`` relies on)."""
    gaussian = torch.randn(dim, count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).T.contiguous().float()  # signs fixed: the uniform (Haar) law


def _projector(directions: torch.Tensor) -> torch.Tensor:
    """P = (CCᵀ)⁻¹C for the (m, d) candidate directions C: P·x are the least-squares coefficients of x on them."""
    c = directions.double()
    return torch.linalg.solve(c @ c.T, c)


def _untested_reason(privacy: PrivacyConfig, *, mechanism_only: bool, no_noise: bool) -> str | None:
    """Why the hypothesis test's law does not hold for this audit (None: it does)."""
    if no_noise:
        return "no noise is accounted (epsilon is infinite): nothing to test against"
    if not mechanism_only:
        return ("the real users' updates (the training's drift) enter the noisy sums with an unknown law; "
                "audit without --with-training to test the mechanism")
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


def run_audit(task: Task, privacy: PrivacyConfig, optimizer: ServerOptimizer, local: LocalTraining, *,
              canaries: int = 1000, seed: int = 0, confidence: float = 0.95, noise_scale: float = 1.0,
              no_noise: bool = False, mechanism_only: bool = False, device: str = "cpu",
              training: str = CLIENT_DEFAULTS.training, chunk_size: int | None = CLIENT_DEFAULTS.chunk_size,
              ) -> AuditResult:
    """Run ``task``'s mechanism once with ``canaries`` candidates and audit it (module docstring). ``no_noise``:
    add no noise at all (accounted ε = ∞); the configured σ is then only a placeholder for the code that needs
    one. ``mechanism_only``: the real users are sampled and counted but send zero updates (``fed-dp audit``'s
    default). ``noise_scale``: add that multiple of the configured noise (the self-test of a broken mechanism).
    ``device``, ``training``, ``chunk_size``: where and how users train (``LocalTrainer``, the config's
    ``[client]``)."""
    if not (isinstance(canaries, int) and canaries >= 4):
        raise ValueError(f"canaries must be an integer >= 4, got {canaries!r}")
    if not (isinstance(noise_scale, (int, float)) and math.isfinite(noise_scale) and noise_scale >= 0):
        raise ValueError(f"noise_scale must be a finite number >= 0 (1: the real mechanism), got {noise_scale!r}")
    if no_noise:
        noise_scale = 0.0
    with simulation():
        generator = torch.Generator().manual_seed(derive_seed(seed, "audit"))
        inserted = torch.rand(canaries, generator=generator) < 0.5
        inserted_ids = torch.nonzero(inserted).flatten()
        real = task.num_users
        privacy = resolve_privacy(privacy.replace(num_users=None), real + len(inserted_ids))
        model, layout, params = initial_model(task, seed)
        if layout.size < 2 * canaries:
            raise ValueError(f"the audit needs a model of at least 2 × canaries parameters to tell {canaries} "
                             f"canary directions apart; this one has d = {layout.size}. Use --canaries "
                             f"{max(4, layout.size // 2)} or fewer")
        directions = _canary_directions(canaries, layout.size, derive_seed(seed, "canaries"))
        projector = _projector(directions)
        trainer = LocalTrainer(task, local, device=device, training=training, chunk_size=chunk_size)
        state = init_server(privacy, optimizer, params, seed=seed)
        audited = AuditPrivatizer(state.privatizer, noise_scale, projector, privacy.clip_norm)
        state.privatizer = audited
        client_seed = derive_seed(seed, "local-training")

        def exchange(plan: RoundPlan) -> RoundReplies:
            cohort = plan.cohort
            users, canary_rows = cohort[cohort < real], inserted_ids[cohort[cohort >= real] - real]
            if mechanism_only:  # the real users reply zero updates (never clipped)
                zero = torch.zeros_like(plan.params)
                result = Contribution(zero, len(users), zero.clone() if plan.send_squares else None,
                                      unclipped=len(users), scaled=plan.scale is not None)
            else:
                result, _, _ = trainer.contribution(plan, users.tolist(), seed=client_seed)
            canary_updates = plan.clip_norm * directions[canary_rows]  # each already of norm ζ_t: clip is a no-op
            total = result.total.cpu() + canary_updates.sum(dim=0)
            squares = None
            if plan.send_squares:
                squares = result.total_squares.cpu() + canary_updates.square().sum(dim=0)
            count = result.count + len(canary_rows)
            unclipped = None if result.unclipped is None else result.unclipped + len(canary_rows)
            return RoundReplies([Contribution(total, count, squares, unclipped=unclipped, scaled=result.scaled)])

        per_round = torch.zeros(canaries, dtype=torch.float64)
        previous = {"params": state.params.clone()}

        def observe(rounds_done: int, theta: torch.Tensor) -> dict[str, float]:
            """Sees every released model (the all-iterates adversary)."""
            change = (theta - previous["params"]).double()
            if float(change.norm()) > 0:
                per_round.add_(projector @ change / change.norm())
            previous["params"] = theta.clone()
            return {}

        loop = run_rounds(state, exchange, evaluate=observe, eval_every=1, max_empty_rounds=10**9)
    final = loop.state.params
    scores = {"final-model": projector @ (final - params).double(), "all-iterates": per_round}
    accounted = math.inf if no_noise else float(loop.records[-1]["epsilon"])
    result = AuditResult(canaries=canaries, inserted=len(inserted_ids), delta=privacy.delta,
                         epsilon_accounted=accounted, confidence=confidence, privacy=privacy,
                         mode="mechanism-only" if mechanism_only else "with training", noise_scale=noise_scale,
                         lower_bound_cap=lower_bound_cap(canaries, privacy.delta, confidence=confidence),
                         scores=scores, inserted_mask=inserted)
    for name in THREAT_MODELS:
        estimate, mu = gaussian_fit_epsilon(scores[name][inserted], scores[name][~inserted], privacy.delta)
        bound = one_run_lower_bound(scores[name], inserted, privacy.delta, confidence=confidence)
        verdict = lower_bound_verdict(bound["epsilon_lower_bound"], result.lower_bound_cap, accounted, confidence)
        result.results[name] = {"epsilon_estimate": estimate, "mu": mu, **bound, "lower_bound_verdict": verdict}
    reason = _untested_reason(privacy, mechanism_only=mechanism_only, no_noise=no_noise)
    sigma = _accounted_noise_multiplier(privacy, optimizer, layout.size)
    if reason is None:
        result.mechanism_test = mechanism_test(audited.sums, inserted, noise_multiplier=sigma,
                                               rounds=len(loop.records), sampling_rate=privacy.sampling_rate,
                                               confidence=confidence)
    else:
        result.mechanism_test = {"verdict": "not tested", "reason": reason}
        if not no_noise:  # what the training's drift adds to the noise, in units of the accounted noise
            spread = float(audited.sums[~inserted].std()) / (sigma * math.sqrt(len(loop.records)))
            result.mechanism_test["held_out_spread"] = spread
    return result


#: ``[server]`` keys of a run configuration that the audit does not act on (it refuses them).
AUDIT_IGNORED_KEYS = ("server.checkpoint-dir", "server.max-empty-rounds", "server.noise-source")


def audit_config(config: dict[str, Any], *, canaries: int, confidence: float, optimizer: str | None = None,
                 task: Task | None = None, mechanism_only: bool = True, noise_scale: float = 1.0) -> AuditResult:
    """Audit a ``fed-dp simulate`` config (tables as read from TOML, ``--set`` applied): its task, privacy,
    local training and seed; its optimizer (``optimizer``, else the config's, else the first of
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
                     device=run.client.device, training=run.client.training, chunk_size=run.client.chunk_size)


def _format_test(test: dict[str, Any]) -> str:
    if test["verdict"] == "not tested":
        spread = (f"; held-out spread {test['held_out_spread']:.3f} of the accounted noise"
                  if "held_out_spread" in test else "")
        return f"mechanism test: not tested ({test['reason']}){spread}"
    return (f"mechanism test (one-sided, {test['confidence']:.0%}): the canaries' separation on the noisy sums is "
            f"mu = {test['mu']:.3f}, {test['mu_expected']:.3f} expected under the accounted sigma; held-out spread "
            f"{test['held_out_spread']:.3f} of the accounted noise; p = {test['p_value']:.3g}: {test['verdict']}")


def format_audit(result: AuditResult) -> str:
    """The audit as a table, one row per threat model, then the hypothesis test of the mechanism."""
    privacy = result.privacy
    mode = ("mechanism only (the real users send zero updates)" if result.mode == "mechanism-only"
            else "with training (the real users train)")
    lines = [
        f"canaries: {result.canaries} candidates, {result.inserted} inserted (each with probability 1/2); {mode}",
        f"population: N = {privacy.num_users - result.inserted} users + {result.inserted} canaries, "
        f"B = {privacy.expected_cohort}, T = {privacy.rounds}, "
        + ("no noise" if math.isinf(result.epsilon_accounted) else f"sigma = {privacy.noise_multiplier:.4f}")
        + f", delta = {result.delta:g}",
    ]
    if result.noise_scale != 1.0 and not math.isinf(result.epsilon_accounted):
        lines.append(f"SELF-TEST: the mechanism adds {result.noise_scale:g} x the accounted noise (--noise-scale); "
                     "the audit should flag it")
    level = f"{result.confidence:.0%}"
    lines += [
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
    lines += ["", _format_test(result.mechanism_test)]
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
