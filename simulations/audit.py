"""``fed-dp audit``: a one-run empirical privacy estimate of a run configuration, with canary users.

    fed-dp audit [CONFIG] [--task MODULE:FUNCTION] [--set table.key=value ...] [--canaries 1000] [--json]

It trains the config's task once in this process, as ``fed-dp simulate`` does, with m canary candidates
(ALGORITHMS §7; Andrew et al. 2024): each is a random unit direction c_i of the model's d parameters, inserted
with probability ½ as an extra user of the population whose clipped update is always ζ_t·c_i whenever the
sampler picks it (held-out candidates are never inserted). The run is accounted as it ran: its population is
N real users plus the inserted canaries. Two threat models score every candidate:

* ``final-model``: the adversary sees θ_T only; the score of c_i is its coefficient when θ_T − θ_0 is regressed
  on all m candidate directions (least squares: the cross-talk of the other canaries is removed, which the
  plain cosine of Andrew et al. 2024 cannot do when m is not far below d; this needs d ≥ 2m);
* ``all-iterates``: the adversary sees every model: score Σ_t coefficient_t(c_i) / ‖θ_t − θ_{t−1}‖, the same
  regression on each round's change, scaled per round.

Any score that does not look at which candidates were inserted keeps the lower bound valid; the Gaussian fit
assumes the scores of each group are roughly Gaussian, which these linear scores are.

and each reports the accounted ε, the Gaussian-fit ε estimate and the one-run lower bound at the stated
confidence (``fed_dp.audit``). ``privacy.noise-multiplier = 0`` is accepted here only: the run adds no noise and
its accounted ε is infinite. ``--mechanism-only``: the real users send zero updates, so the canaries are measured
against the mechanism alone (sampling, clipping, noise, server optimizer), without the drift of the training,
which on a small model hides them. ``noise_scale`` (Python only, for the audit's own tests) scales the noise
actually added while the accounting keeps the configured σ: a deliberately broken mechanism, never for training.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fed_dp.accounting import resolve_privacy
from fed_dp.audit import gaussian_fit_epsilon, one_run_lower_bound
from fed_dp.clients.node import LocalTrainer
from fed_dp.clients.task import Task, initial_model
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.noise import Privatizer
from fed_dp.optimizers import ServerOptimizer, make_optimizer
from fed_dp.randomness import derive_seed
from fed_dp.contribution import Contribution, RoundPlan
from fed_dp.round import init_server
from fed_dp.server.round_loop import RoundReplies, run_rounds

THREAT_MODELS = ("final-model", "all-iterates")


class ScaledNoise:
    """A privatizer whose noise is ``scale`` times the configured one (a deliberately weak mechanism for testing
    the audit's power: the accounting still assumes the full noise). Same interface as ``Privatizer``."""

    def __init__(self, inner: Privatizer, scale: float) -> None:
        self.inner, self.scale = inner, float(scale)

    def privatize(self, total: torch.Tensor, noise_std: float | None = None) -> torch.Tensor:
        total = total.to(self.inner.device, self.inner.dtype)
        return total + self.scale * (self.inner.privatize(total, noise_std) - total)

    def noise_variance(self, t: int | None = None) -> float:
        return self.scale**2 * self.inner.noise_variance(t)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


@dataclass
class AuditResult:
    """The audit of one run: accounted ε and, per threat model, the estimate, the lower bound and the scores."""

    canaries: int
    inserted: int
    delta: float
    epsilon_accounted: float
    confidence: float
    privacy: PrivacyConfig
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    inserted_mask: torch.Tensor | None = None

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready object per threat model."""
        return [{"threat_model": name, "epsilon_accounted": self.epsilon_accounted, "delta": self.delta,
                 "canaries": self.canaries, "inserted": self.inserted, "confidence": self.confidence, **values}
                for name, values in self.results.items()]


def _canary_directions(count: int, dim: int, seed: int) -> torch.Tensor:
    """``count`` independent uniformly random unit vectors of R^d (normalized Gaussians)."""
    directions = torch.randn(count, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (directions / directions.norm(dim=1, keepdim=True)).float()


def _projector(directions: torch.Tensor) -> torch.Tensor:
    """P = (CCᵀ)⁻¹C for the (m, d) candidate directions C: P·x are the least-squares coefficients of x on them."""
    c = directions.double()
    return torch.linalg.solve(c @ c.T, c)


def run_audit(task: Task, privacy: PrivacyConfig, optimizer: ServerOptimizer, local: LocalTraining, *,
              canaries: int = 1000, seed: int = 0, confidence: float = 0.95, noise_scale: float = 1.0,
              no_noise: bool = False, mechanism_only: bool = False) -> AuditResult:
    """Train ``task`` once with ``canaries`` candidates and audit it (module docstring). ``no_noise``: add no
    noise at all (accounted ε = ∞); the configured σ is then only a placeholder for the code that needs one.
    ``mechanism_only``: the real users are sampled and counted but send zero updates, so the scores see the
    mechanism (sampling, clipping, noise, server optimizer) without the training's own drift, which on a small
    model hides the canaries; the accounting is the same."""
    if not (isinstance(canaries, int) and canaries >= 4):
        raise ValueError(f"canaries must be an integer >= 4, got {canaries!r}")
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
        trainer = LocalTrainer(task, local, device="cpu")
        state = init_server(privacy, optimizer, params, seed=seed)
        if noise_scale != 1.0:
            state.privatizer = ScaledNoise(state.privatizer, noise_scale)
        client_seed = derive_seed(seed, "local-training")

        def exchange(plan: RoundPlan) -> RoundReplies:
            cohort = plan.cohort
            users, canary_rows = cohort[cohort < real], inserted_ids[cohort[cohort >= real] - real]
            if mechanism_only:  # the real users reply zero updates (never clipped)
                zero = torch.zeros_like(plan.params)
                result = Contribution(zero, len(users), zero.clone() if plan.send_squares else None,
                                      unclipped=len(users), scaled=plan.scale is not None)
            else:
                result, _, _ = trainer.contribution(round_index=plan.round, users=users.tolist(), params=plan.params,
                                                    clip_norm=plan.clip_norm, scale=plan.scale,
                                                    send_squares=plan.send_squares, seed=client_seed)
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
                         epsilon_accounted=accounted, confidence=confidence, privacy=privacy, scores=scores,
                         inserted_mask=inserted)
    for name in THREAT_MODELS:
        estimate, mu = gaussian_fit_epsilon(scores[name][inserted], scores[name][~inserted], privacy.delta)
        bound = one_run_lower_bound(scores[name], inserted, privacy.delta, confidence=confidence)
        result.results[name] = {"epsilon_estimate": estimate, "mu": mu, **bound}
    return result


def audit_config(config: dict[str, Any], *, canaries: int, confidence: float, optimizer: str | None = None,
                 task: Task | None = None, mechanism_only: bool = False) -> AuditResult:
    """Audit a ``fed-dp simulate`` config (tables as read from TOML, ``--set`` applied): its task, privacy,
    local training and seed; its optimizer (``optimizer``, else the config's, else the first of
    ``run.optimizers``). ``privacy.noise-multiplier = 0`` audits the run without noise."""
    from fed_dp.clients.task import build_task
    from fed_dp.simulations.runner import parse_experiment

    config = json.loads(json.dumps(config))  # a deep copy of plain data
    privacy_table = config.setdefault("privacy", {})
    no_noise = privacy_table.get("noise-multiplier") == 0
    if no_noise:
        if privacy_table.get("target-epsilon", 0) not in (0, -1):
            raise ValueError("privacy.noise-multiplier = 0 audits a run without noise; leave privacy.target-epsilon out")
        privacy_table["noise-multiplier"] = 1.0  # a placeholder: no noise is added, the accounted ε is ∞
    experiment = parse_experiment(config)
    name = optimizer or next(iter(experiment.runs))
    if name not in experiment.runs:
        raise ValueError(f"optimizer {name!r} is not among the config's {list(experiment.runs)}")
    run = experiment.runs[name]
    task = task if task is not None else build_task(run.task)
    seed = run.run.seed if run.run.seed is not None else 0
    return run_audit(task, run.privacy, run.optimizer.build(), run.local, canaries=canaries, seed=seed,
                     confidence=confidence, no_noise=no_noise, mechanism_only=mechanism_only)


def format_audit(result: AuditResult) -> str:
    """The audit as a table, one row per threat model."""
    privacy = result.privacy
    lines = [
        f"canaries: {result.canaries} candidates, {result.inserted} inserted (each with probability 1/2)",
        f"population: N = {privacy.num_users - result.inserted} users + {result.inserted} canaries, "
        f"B = {privacy.expected_cohort}, T = {privacy.rounds}, "
        + ("no noise" if math.isinf(result.epsilon_accounted) else f"sigma = {privacy.noise_multiplier:.4f}")
        + f", delta = {result.delta:g}",
        "",
        f"{'threat model':<13} {'accounted eps':>13} {'eps estimate':>12} {'mu':>6} "
        f"{f'lower bound ({result.confidence:.0%})':>18} {'correct guesses':>16}",
    ]
    for name, values in result.results.items():
        lines.append(f"{name:<13} {result.epsilon_accounted:>13.4f} {values['epsilon_estimate']:>12.4f} "
                     f"{values['mu']:>6.3f} {values['epsilon_lower_bound']:>18.4f} "
                     f"{values['correct']:>8}/{values['guesses']:<7}")
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
