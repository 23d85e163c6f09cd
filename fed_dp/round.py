"""The one private round, shared by every engine (docs/explanation/mechanism.md).

    state          = init_server(config, optimizer, params)    # optimizer, privatizer, sampler, ledger
    plan           = begin_round(state)                         # budget check, cohort, θ_{t−1}, s_t
    ... each node replies with a Contribution: the sum of its users' clipped updates and their count ...
    state, metrics = finish_round(state, plan, contributions)   # validate, re-clip, noise, optimizer, ledger

The Flower strategy, the in-process simulation engine and the tests all go through these functions, so the
DP-critical path exists once:

* the budget is checked before a cohort is drawn; a round over budget raises ``BudgetExceededError``;
* every contribution is validated (shape, dtype, finite values, count; an invalid one raises) and re-clipped
  to count·ζ (ζ per user; count·ζ bounds the sum a node reports for its count users). Replies that arrive
  over a network are read by ``fed_dp.clients.protocol`` first, which drops what it cannot count;
* Σ_t is the UNWEIGHTED sum; noise from the privatizer; the average divides by the constant B;
* the optimizer sees only g̃_t = −(Σ_t + w_t)/B (un-scaled by s_t for scale-then-privatize), plus what its
  ``needs`` ask for; the ledger records the round whatever the number of replies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from fed_dp.accounting import PrivacyLedger, check_plan
from fed_dp.adaptive_clipping import AdaptiveClipConfig, AdaptiveClipper, check_compatible, update_noise_multiplier
from fed_dp.aggregation import average_noise_variance, private_average, unscale
from fed_dp.clipping import clip_vector
from fed_dp.config import PrivacyConfig
from fed_dp.context import in_simulation, reported_epsilon
from fed_dp.contribution import Contribution, RoundPlan
from fed_dp.diagnostics import alignment_ratio
from fed_dp.moment_estimation import joint_privatizer, split_query, stack_query
from fed_dp.noise import NoNoise, Privatizer, make_privatizer
from fed_dp.optimizers import OptimizerState, RoundRelease, ServerOptimizer
from fed_dp.randomness import derive_seed, grid_step
from fed_dp.run_config import SERVER_DEFAULTS, resolve_noise_source
from fed_dp.run_setup import privacy_changes
from fed_dp.sampling import Sampler, make_sampler


@dataclass
class ServerState:
    """Explicit server state: everything a checkpoint must hold (see ``state_dict``).

    The privatizer, sampler and ledger are streams that each round advances in place; parameters and
    optimizer state are replaced by new tensors (never mutated in place).
    """

    config: PrivacyConfig
    optimizer: ServerOptimizer
    params: torch.Tensor
    opt_state: OptimizerState
    privatizer: Privatizer | NoNoise  # NoNoise: the non-private baseline (noise_multiplier = 0)
    sampler: Sampler
    ledger: PrivacyLedger
    round: int = 0
    clipper: AdaptiveClipper | None = None
    pending: RoundPlan | None = None  # the plan begun and not yet finished (a second begin_round is refused)

    def state_dict(self) -> dict[str, Any]:
        """What may be published: the round, the model, the optimizer state, the ε ledger (ε per round; no
        counts of sampled or replying users) and the current clip norm ζ_t (it is broadcast anyway)."""
        return {
            "round": self.round,
            "params": self.params.detach().cpu().clone(),
            "opt_state": self.opt_state._asdict(),
            "ledger": self.ledger.to_dict(),
            "clip_norm": None if self.clipper is None else self.clipper.clip_norm,
        }

    def secret_state_dict(self) -> dict[str, Any]:
        """What must stay with the server: the noise stream (source state and BandMF buffer), the sampler
        (seed, generator: every cohort) and the clip-bit noise. Its holder can remove the noise."""
        return {
            "round": self.round,
            "privatizer": self.privatizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "clipper": None if self.clipper is None else self.clipper.state_dict(),
        }

    def load_state_dict(self, data: dict[str, Any], secret: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` and ``secret_state_dict()`` of the same round: same model, optimizer
        state, noise stream, cohorts and ledger.

        The noise stream continues where it stopped (never reusing a noise vector); the configuration
        must be the one the checkpoint was written with.
        """
        if int(secret["round"]) != int(data["round"]):
            raise ValueError(f"the checkpoint is of round {data['round']} but its secret state of round "
                             f"{secret['round']}; they were not written together, refusing to resume")
        ledger = PrivacyLedger.from_dict(data["ledger"])
        if ledger.config != self.config:
            raise ValueError(f"the checkpoint was written with another privacy configuration "
                             f"({'; '.join(privacy_changes(ledger.config, self.config))}); refusing to resume")
        device, dtype = self.params.device, self.params.dtype
        params = data["params"]
        if tuple(params.shape) != tuple(self.params.shape):
            raise ValueError(f"checkpoint params have shape {tuple(params.shape)}, model has {tuple(self.params.shape)}: "
                             "a checkpoint holds the model's trainable parameters (requires_grad), so a resume must "
                             "build the same model and freeze the same parameters")
        self.params = params.to(device, dtype).clone()
        self.opt_state = OptimizerState(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data["opt_state"].items()}
        )
        self.privatizer.load_state_dict(secret["privatizer"])
        self.sampler.load_state_dict(secret["sampler"])
        self.ledger = ledger
        self.round = int(data["round"])
        self.pending = None
        if (self.clipper is None) != (secret.get("clipper") is None):
            raise ValueError("the checkpoint and this run disagree on adaptive clipping; refusing to resume")
        if self.clipper is not None:
            self.clipper.load_state_dict(secret["clipper"])


def init_server(
    config: PrivacyConfig,
    optimizer: ServerOptimizer,
    params: torch.Tensor,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    adaptive_clipping: AdaptiveClipConfig | None = None,
    noise_source: str = SERVER_DEFAULTS.noise_source,
) -> ServerState:
    """Build the server state. ``seed`` seeds sampler and noise (``None``: OS entropy, as for real runs),
    each through its own derived seed (``fed_dp.randomness.derive_seed(seed, "sampler" | "noise" |
    "adaptive-clipping")``), so no consumer's seed reveals another's. ``noise_source``: ``"torch"`` (seeded,
    reproducible), ``"secure"`` (AES-CTR keyed from OS entropy whatever the seed) or ``"auto"`` (the run
    configuration's default, ``server.noise-source``: torch here, where no Flower run decides otherwise; engines
    resolve auto with ``fed_dp.run_config.resolve_noise_source`` and pass what they chose) for the update and
    clip-bit noise.

    With ``adaptive_clipping`` (independent noise only) the clip norm follows the noisy clip bits of every
    round and the update noise uses σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), so that the pair costs one Gaussian
    with multiplier σ and the accounting is unchanged (fed_dp.adaptive_clipping).

    The plan is checked first (``fed_dp.accounting.check_plan``): a budget that could release no round is refused,
    and a budget that stops the run early, an ε too large to mean anything or an allowed δ ≥ 1/N are warned about.
    """
    if params.ndim != 1 or not params.dtype.is_floating_point:
        raise ValueError("params must be a flat floating-point vector (fed_dp.flat.ParamLayout.flatten)")
    config.require_resolved("init_server")
    # values the arithmetic cannot hold, before any accounting of them
    _check_magnitudes(config.clip_norm, config.noise_multiplier, config.num_users, params.dtype)
    check_plan(config)
    params = params.detach().to(device).clone()
    dim = params.numel()
    derived = (lambda purpose: None) if seed is None else (lambda purpose: derive_seed(seed, purpose))
    noise_source = resolve_noise_source(noise_source, flower_run=False, seeded=seed is not None)
    noise_seed = derived("noise") if noise_source == "torch" else None  # secure noise is keyed from OS entropy
    if optimizer.needs.squares:
        privatizer = joint_privatizer(config, dim, optimizer.ime_alpha, seed=noise_seed, device=device,
                                      dtype=params.dtype, source=noise_source)
    else:
        privatizer = make_privatizer(config, dim, seed=noise_seed, device=device, dtype=params.dtype,
                                     source=noise_source)
    clipper = None
    if adaptive_clipping is not None:
        check_compatible(config, adaptive_clipping)
        adaptive_clipping = adaptive_clipping.for_privacy(config)  # σ_b decided (its default needs σ)
        if optimizer.needs.squares:
            raise ValueError("adaptive clipping is not combined with independent moment estimation")
        clipper = AdaptiveClipper(adaptive_clipping, config.expected_cohort, source=noise_source,
                                  seed=derived("adaptive-clipping") if noise_source == "torch" else None)
    ledger = PrivacyLedger(config)
    return ServerState(
        config=config,
        optimizer=optimizer,
        params=params,
        opt_state=optimizer.init(params),
        privatizer=privatizer,
        sampler=make_sampler(config, seed=derived("sampler")),
        ledger=ledger,
        clipper=clipper,
    )


#: Headroom of :func:`_check_magnitudes`: the largest value of a round, squared, must stay this far below the
#: largest number of the model's dtype (sums of squares over coordinates, moments and norms are computed from it).
_HEADROOM = 2.0**32
#: How many noise standard deviations :func:`_check_magnitudes` counts on a released sum (a draw never exceeds
#: ``fed_dp.randomness.RADIUS_MAX`` ≈ 13.2; the rest covers correlated noise's row norms of C⁻¹).
_NOISE_SPAN = 64


def _check_magnitudes(clip: float, sigma: float, num_users: int, dtype: torch.dtype) -> None:
    """Refuse, before any round, a clip norm ζ = ``clip`` (with σ = ``sigma``, N = ``num_users``) whose round
    overflows the model's dtype or whose noise the noise source cannot draw. A round handles sums of up to N clipped
    updates, noise of std σζ on them, and squares of both (second moments, the noise variance (σζ/B)², Σu² for moment estimation); with ζ = 1e300, or ζ = 1e20 in
    float32, those are inf and the model turns to inf or NaN after round 1, its budget spent. The std σζ must be one
    the noise source can draw (``fed_dp.randomness.grid_step``)."""
    largest = clip * (num_users + _NOISE_SPAN * sigma)
    limit = math.sqrt(torch.finfo(dtype).max / _HEADROOM)
    advice = ("ζ bounds the norm of one user's whole update: choose it near the norms of users' updates (typically "
              "0.1 … 10; the clip-norm hint of a run says when it is far above them)")
    if largest > limit:
        raise ValueError(
            f"clip_norm ζ = {clip:g} (privacy.clip-norm) is too large for this run's {dtype} model: a round sums up "
            f"to N = {num_users} clipped updates and noise of std σζ = {sigma * clip:g}, and the squares of "
            f"such values (second moments, the noise variance, norms) must stay far below the largest {dtype} "
            f"({torch.finfo(dtype).max:.3g}), which needs ζ·(N + {_NOISE_SPAN}σ) ≤ {limit:.3g}; the model would "
            f"otherwise turn to inf or NaN. {advice}")
    if sigma > 0:
        try:
            grid_step(sigma * clip)  # the noise source's own check of the std it can draw
        except ValueError as error:
            raise ValueError(
                f"the noise std σζ = {sigma:g} × {clip:g} = {sigma * clip:g} (privacy.noise-multiplier × "
                f"privacy.clip-norm) is outside the range the noise can be drawn in ({error}). {advice}; σ = 0 is the "
                "non-private baseline") from error


def begin_round(state: ServerState) -> RoundPlan:
    """Refuse a round over budget, then draw the cohort and say what to broadcast.

    A round begun must be finished before the next begins: a second ``begin_round`` would let the sampler
    run ahead (a cohort drawn and never used) and is refused."""
    if state.pending is not None:
        raise ValueError(f"round {state.pending.round + 1} was begun and not finished; finish_round it first "
                         "(a second begin_round would draw another cohort for the same round)")
    state.ledger.check_next_round()
    cohort = state.sampler.next_cohort()
    state.pending = RoundPlan(
        round=state.round,
        cohort=cohort,
        params=state.params.clone(),
        clip_norm=state.config.clip_norm if state.clipper is None else state.clipper.clip_norm,
        scale=state.optimizer.scale(state.opt_state),
        send_squares=state.optimizer.needs.squares,
        send_clip_bits=state.clipper is not None,
    )
    return state.pending


def _rejection(c: Contribution, dim: int, plan: RoundPlan) -> str | None:
    """Why a reply is unusable, or None."""
    if not isinstance(c.count, int) or isinstance(c.count, bool) or c.count < 0:
        return f"count must be an integer >= 0, got {c.count!r}"
    for name, value in (("total", c.total), ("total_squares", c.total_squares)):
        if name == "total_squares" and not plan.send_squares:
            continue
        if not isinstance(value, torch.Tensor):
            return f"{name} is missing or not a tensor"
        if not value.dtype.is_floating_point:
            return f"{name} has dtype {value.dtype}, expected a floating-point vector"
        if tuple(value.shape) != (dim,):
            return f"{name} has shape {tuple(value.shape)}, expected ({dim},)"
        if not bool(torch.isfinite(value).all()):
            return f"{name} contains NaN or Inf"
    if plan.send_squares and bool((c.total_squares < 0).any()):
        return "total_squares has negative entries"
    if c.scaled != (plan.scale is not None):
        return ("not clipped in the broadcast s_t geometry (scale-then-privatize)" if plan.scale is not None
                else "clipped in a scaled geometry, but no s_t was broadcast")
    if plan.send_clip_bits:
        if c.unclipped is None:
            return "no clip bits (adaptive clipping needs the number of unclipped users)"
        if isinstance(c.unclipped, bool) or not isinstance(c.unclipped, int) or not 0 <= c.unclipped <= c.count:
            return f"clip-bit sum {c.unclipped!r} is not an integer in [0, count = {c.count}]"
    return None


def aggregate(plan: RoundPlan, contributions: list[Contribution], dim: int, device, dtype):
    """Validate and re-clip the contributions; return (Σu, Σu² or None, users counted, metrics).

    A contribution that is not a valid answer to ``plan`` (wrong shape or dtype, NaN/Inf, a bad count, no clip
    bits under adaptive clipping, more users than sampled) raises ValueError: engines turn what arrives over a
    network into contributions first and drop what they cannot read (``fed_dp.clients.protocol``), so an
    invalid contribution here is a programming error. An oversized one is re-clipped (enforcement of ζ):
    ``fed_dp.clipping.clip_vector`` leaves a sum whose ``l2_norm`` is ≤ count·ζ as it came and scales a
    larger one by the clip's guaranteed factor, without slack, so an honest node's sum of one clipped update is
    never scaled and a dishonest node gains nothing from rounding.

    Each contribution is enforced in its own precision, float32 or wider (never in bfloat16/float16, never
    after a narrowing that could overflow), and the sums are accumulated in float64, then
    rounded once to ``dtype``: the sum over nodes adds no rounding that grows with their number (docs/explanation/floating-point.md).
    """
    total = torch.zeros(dim, device=device, dtype=torch.float64)
    squares = torch.zeros(dim, device=device, dtype=torch.float64) if plan.send_squares else None
    counted, reclipped, unclipped = 0, 0, 0
    for c in contributions:
        if not isinstance(c, Contribution):
            raise ValueError(f"contributions must be fed_dp.round.Contribution objects, got {type(c).__name__}")
        reason = _rejection(c, dim, plan)
        if reason is None and counted + c.count > plan.cohort.numel():
            reason = f"more users ({counted + c.count}) than the {plan.cohort.numel()} sampled"
        if reason is not None:
            raise ValueError(f"invalid contribution from {c.source or 'a node'} in round {plan.round + 1}: {reason}")
        clipped, was_clipped = clip_vector(c.total.to(device), c.count * plan.clip_norm)
        reclipped += was_clipped
        total += clipped
        if squares is not None:
            sq, was_clipped = clip_vector(c.total_squares.to(device), c.count * plan.clip_norm**2)
            reclipped += was_clipped
            squares += sq
        counted += c.count
        unclipped += c.unclipped if plan.send_clip_bits else 0
    metrics = {"replied_users": counted, "reclipped_replies": reclipped, "unclipped_users": unclipped}
    return total.to(dtype), None if squares is None else squares.to(dtype), counted, metrics


def finish_round(
    state: ServerState, plan: RoundPlan, contributions: list[Contribution]
) -> tuple[ServerState, dict[str, Any]]:
    """Noise, average over B, step the optimizer, account. Returns the new state and the round's metrics.

    The metrics are what may be published — round (t = 1 … T), ε, δ, the update norm, the optimizer's diagnostics of ν̂
    (post-processing), adaptive clipping's ζ_t and ζ_{t+1} — plus, under ``"nonprivate"``, exact counts that
    are computed from users' data outside any accounted mechanism: ``cohort_size`` (|S_t|), ``replied_users``,
    ``reclipped_replies``, ``unclipped_users`` and, in simulations, ``alignment_ratio``. Engines keep those
    out of every published record (``fed_dp.round_loop``)."""
    if plan is not state.pending:
        raise ValueError(f"plan of round {plan.round + 1} is not the round begun on this server (round "
                         f"{state.round + 1}); call begin_round, then finish_round with its plan, once")
    config, optimizer = state.config, state.optimizer
    B, dim = config.expected_cohort, state.params.numel()
    total, squares, counted, counts = aggregate(
        plan, contributions, dim, state.params.device, state.params.dtype
    )
    second_moment = None
    if plan.send_squares:
        noisy_total, noisy_squares = split_query(
            state.privatizer.privatize(stack_query(total, squares, optimizer.ime_alpha)), optimizer.ime_alpha
        )
        average, second_moment = noisy_total / B, noisy_squares / B
        noise_variance = None
    else:
        if state.clipper is None:
            average = private_average(total, state.privatizer, B)
            noise_variance = average_noise_variance(state.privatizer, B, scale=plan.scale)
        else:  # σ_Δ·ζ_t this round (independent noise only, so a per-round scale is allowed)
            std = update_noise_multiplier(config.noise_multiplier, state.clipper.config.bit_noise_std) * plan.clip_norm
            average = private_average(total, state.privatizer, B, noise_std=std)
            noise_variance = (std / B) ** 2 if plan.scale is None else (std / B) ** 2 / plan.scale.square()
    clean = total / B
    if plan.scale is not None:
        average, clean = unscale(average, plan.scale), unscale(clean, plan.scale)
    release = RoundRelease(
        grad=-average,
        second_moment=second_moment,
        noise_variance=noise_variance,
        clean_grad=-clean if optimizer.needs.clean_aggregate else None,
    )
    step, opt_state, diagnostics = optimizer.update(release, state.opt_state, state.params)
    record = state.ledger.record_round()
    public: dict[str, Any] = {"round": plan.round + 1}  # the t-th release: rounds are numbered 1 … T
    if state.clipper is not None:  # ζ_t is broadcast; ζ_{t+1} comes from the noised bit sum
        public["clip_norm"] = plan.clip_norm
        public["next_clip_norm"] = state.clipper.step(counts["unclipped_users"], counted)
    state.pending = None
    new_state = replace(state, params=state.params + step, opt_state=opt_state, round=state.round + 1)
    public.update(diagnostics)  # post-processing of the noised release
    public.update(epsilon=reported_epsilon(record.epsilon, optimizer.private), delta=config.delta,
                  update_norm=float(torch.linalg.vector_norm(step)))
    if config.non_private:
        public["non_private"] = True
    elif state.clipper is None and plan.scale is None and not plan.send_squares and config.noise == "independent":
        public["noised_average_norm"] = float(torch.linalg.vector_norm(average))  # released: the clip hint reads it
    counts["cohort_size"] = plan.cohort.numel()
    if in_simulation():  # reads the un-noised sum: never computed outside simulations
        counts["alignment_ratio"] = alignment_ratio(total, counted, plan.clip_norm) if counted else math.nan
    public["nonprivate"] = counts
    return new_state, public
