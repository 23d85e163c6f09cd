"""Contract tests over every registered sampler, server optimizer and noise mechanism (issue 41 item 4).

Each test is parametrized over a registry, read at collection time (``fed_dp.sampling.SAMPLERS``,
``fed_dp.optimizers.OPTIMIZERS``, ``fed_dp.config.NOISES``), so a new registration is held to the same interface and
properties without a line here, unless it needs settings of its own (the ``*_SETTINGS`` tables say which, and a
registration whose settings the base configuration does not satisfy fails with the config's own error).

Expected values come from first principles, not from the code under test: a sampler's participation bound and rate
from the dp_accounting event it reports (read here, node by node), the noise law from the strategy matrix C (the
released stream times C must be σζ times i.i.d. standard normals). Statistical checks use fixed seeds and 5-sigma
bounds: a run is deterministic, and the bound says how far from the law the fixed draw may lie.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import dp_accounting
import pytest
import torch

from fed_dp.config import NOISES, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.noise import make_privatizer
from fed_dp.optimizers import OPTIMIZERS, OptimizerState, RoundNeeds, RoundRelease, ServerOptimizer, make_optimizer
from fed_dp.sampling import SAMPLERS, Sampler, dp_event, make_sampler


def _saved_and_loaded(state):
    """``state`` through torch.save and torch.load, as a checkpoint file holds it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --- samplers ------------------------------------------------------------------------------------------------------
N, B, T, SIGMA = 120, 12, 60, 1.3  # N divisible by B, T by the cyclic groups: each cohort law is exact
#: Settings a sampler needs beyond the base configuration (the config's validation says why).
SAMPLER_SETTINGS = {
    "without-replacement": {"accountant": "rdp"},  # replace-one adjacency: RDP only
    "all": {"expected_cohort": N},
    "cyclic-poisson": {"bands": 4},
}


def _sampler_config(name: str) -> PrivacyConfig:
    settings = {"num_users": N, "expected_cohort": B, "rounds": T, "noise_multiplier": SIGMA, "delta": 1e-3,
                "sampler": name, **SAMPLER_SETTINGS.get(name, {})}
    return PrivacyConfig(**settings)


def _cohorts(sampler: Sampler, rounds: int) -> list[torch.Tensor]:
    return [sampler.next_cohort() for _ in range(rounds)]


def _event_law(event: dp_accounting.DpEvent, sensitivity: float) -> tuple[float, float, int | None]:
    """(k, p, m) of an event of T rounds: at most k unit-sensitivity participations of one user, each composed step
    including a given user with probability p, and m the fixed sample size of a sampled-without-replacement step.

    A Gaussian event with multiplier σ' stands for (σ/σ')² / s² participations, s the sum's sensitivity to one
    user's contribution under the sampler's relation (2ζ for replace-one, ζ for add/remove): σ' = σ/√k covers k."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return (SIGMA / event.noise_multiplier) ** 2 / sensitivity**2, 1.0, None
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        k, p, m = _event_law(event.event, sensitivity)
        return k * event.count, p, m
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        k, _, m = _event_law(event.event, sensitivity)
        return k, event.sampling_probability, m
    if isinstance(event, dp_accounting.SampledWithoutReplacementDpEvent):
        k, _, _ = _event_law(event.event, sensitivity)
        assert event.source_dataset_size == N, "the event samples from another population than the sampler's"
        return k, event.sample_size / event.source_dataset_size, event.sample_size
    raise AssertionError(f"teach _event_law the event {type(event).__name__} to check this sampler's accounting")


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_is_built_from_its_config_and_has_the_interface(name):
    config = _sampler_config(name)
    sampler = make_sampler(config, seed=1)
    assert isinstance(sampler, SAMPLERS[name]) and isinstance(sampler, Sampler) and sampler.name == name
    assert isinstance(sampler.neighboring_relation, dp_accounting.NeighboringRelation)
    assert isinstance(sampler.guarantee, str) and sampler.guarantee
    assert isinstance(dp_event(config, T), dp_accounting.DpEvent)
    cohort = sampler.next_cohort()
    assert cohort.dtype == torch.int64 and cohort.ndim == 1
    assert torch.equal(cohort, torch.unique(cohort))  # sorted, no user twice
    assert cohort.numel() == 0 or (0 <= int(cohort.min()) and int(cohort.max()) < N)
    other = next(cls for other_name, cls in SAMPLERS.items() if other_name != name)
    with pytest.raises(ValueError):  # a sampler class refuses a config that names another sampler
        other(config, seed=1)


def test_every_sampler_the_config_offers_is_registered():
    from fed_dp.config import SAMPLERS as CHOICES

    assert sorted(CHOICES) == sorted(SAMPLERS)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_draws_what_its_event_accounts_for(name):
    """The event of T rounds read node by node: no user participates more often than it allows, the rate it
    accounts is the configured B/N, and the cohorts drawn have that rate (a fixed size where the event has one)."""
    config = _sampler_config(name)
    sampler = make_sampler(config, seed=7)
    sensitivity = 2.0 if sampler.neighboring_relation == dp_accounting.NeighboringRelation.REPLACE_ONE else 1.0
    k, p, fixed_size = _event_law(dp_event(config, T), sensitivity)
    cohorts = _cohorts(sampler, T)
    participations = Counter(int(user) for cohort in cohorts for user in cohort)
    total = sum(participations.values())
    assert max(participations.values()) <= k + 1e-9, (max(participations.values()), k)
    assert N * k * p == pytest.approx(T * config.expected_cohort, rel=1e-9)  # the accounted rate is the configured one
    if p == 1 or fixed_size is not None:  # no Poisson sampling: every cohort has exactly B users
        assert {c.numel() for c in cohorts} == {config.expected_cohort}
    else:
        assert abs(total - T * config.expected_cohort) <= 5 * math.sqrt(T * config.expected_cohort)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_is_determined_by_its_seed(name):
    config = _sampler_config(name)
    first, again, other = (_cohorts(make_sampler(config, seed=s), T) for s in (3, 3, 4))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    everyone = all(c.numel() == N for c in first)  # a sampler that takes every user has nothing to draw
    assert everyone or not all(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_resumed_from_its_checkpoint_draws_the_same_cohorts(name):
    config = _sampler_config(name)
    original = make_sampler(config, seed=5)
    _cohorts(original, 7)
    resumed = make_sampler(config, seed=6)
    resumed.load_state_dict(_saved_and_loaded(original.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(_cohorts(original, T - 7), _cohorts(resumed, T - 7)))
    with pytest.raises(ValueError):  # the accounting covers T rounds, no more
        resumed.next_cohort()
    with pytest.raises(ValueError):
        make_sampler(config, seed=5).load_state_dict({**original.state_dict(), "sampler": "another-sampler"})


# --- server optimizers ---------------------------------------------------------------------------------------------
DIM = 64
PHI = 1e-2  # Φ_t, the per-coordinate noise variance a bias-corrected optimizer is given every round
#: |g| with g² far below float32's largest number (a round's magnitude check keeps squares 2^32 below it) and a
#: subnormal-squared one, mixed with zeros.
EXTREME = 1e14


def _optimizer(name: str) -> ServerOptimizer:
    with simulation():  # the noiseless baselines exist only in simulations
        return make_optimizer(name)


def _release(optimizer: ServerOptimizer, grad: torch.Tensor) -> RoundRelease:
    """What a round hands ``optimizer``: exactly what its ``needs`` ask for."""
    needs = optimizer.needs
    return RoundRelease(grad=grad, second_moment=grad.square() if needs.squares else None,
                        noise_variance=PHI if needs.noise_variance else None,
                        clean_grad=grad if needs.clean_aggregate else None)


def _grads(rounds: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(DIM, generator=generator) for _ in range(rounds)]


def _run(optimizer, params, state, grads):
    steps = []
    for grad in grads:
        step, state, metrics = optimizer.update(_release(optimizer, grad), state, params)
        assert isinstance(metrics, dict)
        params = params + step
        steps.append(step)
    return params, state, steps


def _tensors(state: OptimizerState) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state._asdict().items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_has_the_interface_and_its_state_the_parameters_shape(name):
    optimizer = _optimizer(name)
    assert isinstance(optimizer, ServerOptimizer) and isinstance(optimizer.needs, RoundNeeds)
    assert optimizer.private == (not optimizer.needs.clean_aggregate)  # only the clean aggregate is not private
    assert optimizer.describe().startswith(type(optimizer).__name__)
    params = torch.randn(DIM, generator=torch.Generator().manual_seed(1))
    state = optimizer.init(params)
    assert isinstance(state, OptimizerState) and state.step == 0
    for rounds in range(1, 4):
        scale = optimizer.scale(state)
        if optimizer.needs.broadcast_scale:
            assert scale.shape == params.shape and bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
        else:
            assert scale is None
        step, state, _ = optimizer.update(_release(optimizer, _grads(1, rounds)[0]), state, params)
        assert step.shape == params.shape and step.dtype == params.dtype and state.step == rounds
        for key, value in _tensors(state).items():  # moments per coordinate (Φ's sum may be one scalar)
            assert value.shape == params.shape or (key == "phi" and value.ndim == 0), (key, value.shape)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_zero_update_is_a_fixed_point(name):
    """Zero pseudo-gradients (and squares) from the initial state move nothing: at θ = 0 for every optimizer, at
    any θ for those without weight decay (decoupled decay shrinks θ by itself)."""
    optimizer = _optimizer(name)
    anywhere = torch.randn(DIM, generator=torch.Generator().manual_seed(2))
    for params in [torch.zeros(DIM)] + ([anywhere] if getattr(optimizer, "weight_decay", 0) == 0 else []):
        final, _, steps = _run(optimizer, params, optimizer.init(params), [torch.zeros(DIM)] * 3)
        assert all(torch.equal(step, torch.zeros(DIM)) for step in steps), name
        assert torch.equal(final, params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_gives_finite_steps_on_extreme_and_zero_inputs(name):
    optimizer = _optimizer(name)
    pattern = torch.tensor([0.0, EXTREME, -EXTREME, 1e-30, -1e-30, 1.0, 0.0, -EXTREME])
    grads = [pattern.repeat(DIM // pattern.numel()).roll(shift) for shift in range(4)] + [torch.zeros(DIM)]
    params = torch.zeros(DIM)
    _, state, steps = _run(optimizer, params, optimizer.init(params), grads)
    assert all(bool(torch.isfinite(step).all()) for step in steps), name
    assert all(bool(torch.isfinite(value).all()) for value in _tensors(state).values())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_leaves_its_inputs_untouched_and_is_deterministic(name):
    optimizer = _optimizer(name)
    params = torch.randn(DIM, generator=torch.Generator().manual_seed(3))
    _, state, _ = _run(optimizer, params, optimizer.init(params), _grads(2))
    release = _release(optimizer, _grads(1, 9)[0])
    before = (params.clone(), {k: v.clone() for k, v in _tensors(state).items()}, release.grad.clone())
    first = optimizer.update(release, state, params)
    second = optimizer.update(release, state, params)
    assert torch.equal(params, before[0]) and torch.equal(release.grad, before[2])
    assert all(torch.equal(_tensors(state)[k], v) for k, v in before[1].items())
    assert torch.equal(first[0], second[0])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_resumed_from_its_checkpointed_state_continues_the_same_steps(name):
    """The state as ``fed_dp.round.ServerState`` checkpoints it (``_asdict``, torch.save, ``OptimizerState(**…)``)."""
    optimizer = _optimizer(name)
    params = torch.randn(DIM, generator=torch.Generator().manual_seed(4))
    grads = _grads(5, seed=11)
    _, _, straight = _run(optimizer, params, optimizer.init(params), grads)
    middle, state, _ = _run(optimizer, params, optimizer.init(params), grads[:2])
    resumed = OptimizerState(**_saved_and_loaded(state._asdict()))
    _, _, continued = _run(optimizer, middle, resumed, grads[2:])
    assert all(torch.equal(a, b) for a, b in zip(straight[2:], continued))


# --- noise mechanisms ----------------------------------------------------------------------------------------------
NOISE_DIM, NOISE_ROUNDS, CLIP = 20_000, 8, 0.7
#: Settings a noise needs beyond the base configuration (correlated noise: a sampler with a minimum separation).
NOISE_SETTINGS = {"bandmf": {"sampler": "min-sep", "bands": 2}, "blt": {"sampler": "min-sep", "buffers": 2}}


def _noise_config(name: str) -> PrivacyConfig:
    return PrivacyConfig(num_users=100, expected_cohort=10, rounds=NOISE_ROUNDS, noise_multiplier=SIGMA,
                         clip_norm=CLIP, delta=1e-4, noise=name, **NOISE_SETTINGS.get(name, {}))


def _privatizer(name: str, seed: int):
    return make_privatizer(_noise_config(name), NOISE_DIM, seed=seed)


def _strategy_matrix(privatizer) -> torch.Tensor:
    """C, T×T float64: the privatizer's strategy (the identity for independent noise)."""
    if privatizer.strategy is None:
        return torch.eye(NOISE_ROUNDS, dtype=torch.float64)
    return privatizer.strategy.dense().to(torch.float64)


def _stream(privatizer, steps: int) -> torch.Tensor:
    return torch.stack([privatizer.next_noise() for _ in range(steps)])


def test_every_noise_the_config_offers_builds_a_privatizer():
    assert list(NOISES) and all(_privatizer(name, 0) is not None for name in NOISES)


@pytest.mark.parametrize("name", NOISES)
def test_a_privatizer_has_the_interface_and_releases_the_dimension(name):
    privatizer = _privatizer(name, seed=1)
    for method in ("privatize", "next_noise", "noise_variance", "state_dict", "load_state_dict"):
        assert callable(getattr(privatizer, method)), method
    assert privatizer.dim == NOISE_DIM and privatizer.index == 0
    assert privatizer.horizon is None or privatizer.horizon >= NOISE_ROUNDS
    total = torch.ones(NOISE_DIM)
    released = privatizer.privatize(total)
    assert released.shape == (NOISE_DIM,) and released.dtype == torch.float32 and privatizer.index == 1
    assert torch.equal(total, torch.ones(NOISE_DIM)) and not torch.equal(released, total)
    with pytest.raises(ValueError):
        privatizer.privatize(torch.ones(NOISE_DIM + 1))


@pytest.mark.parametrize("name", NOISES)
def test_the_noise_stream_is_sigma_zeta_times_C_inverse_Z(name):
    """C·W = σζ·Z with Z i.i.d. N(0, 1): the T×T sample covariance of (C·W)/(σζ) over the d coordinates is the
    identity within 5 standard errors (diagonal √(2/d), off-diagonal √(1/d)). C is lower-triangular with largest
    column norm 1, so one participation has sensitivity ζ and the noise is σ times it."""
    privatizer = _privatizer(name, seed=2)
    C = _strategy_matrix(privatizer)
    assert torch.equal(C, torch.tril(C))
    assert float(C.norm(dim=0).max()) == pytest.approx(1.0, rel=1e-9)
    unit = C @ _stream(privatizer, NOISE_ROUNDS) / (SIGMA * CLIP)
    covariance = unit @ unit.T / NOISE_DIM
    identity = torch.eye(NOISE_ROUNDS, dtype=torch.float64)
    off_diagonal = (covariance - identity).masked_fill(identity.bool(), 0)
    assert float((covariance.diagonal() - 1).abs().max()) < 5 * math.sqrt(2 / NOISE_DIM)
    assert float(off_diagonal.abs().max()) < 5 / math.sqrt(NOISE_DIM)


@pytest.mark.parametrize("name", NOISES)
def test_the_reported_noise_variance_is_sigma_zeta_squared_times_the_row_norm_of_C_inverse(name):
    privatizer = _privatizer(name, seed=3)
    row_norms = torch.linalg.inv(_strategy_matrix(privatizer)).square().sum(dim=1)
    for t in range(NOISE_ROUNDS):
        assert privatizer.noise_variance(t) == pytest.approx((SIGMA * CLIP) ** 2 * float(row_norms[t]), rel=1e-9)


@pytest.mark.parametrize("name", NOISES)
def test_a_noise_stream_is_determined_by_its_seed(name):
    first, again, other = (_stream(_privatizer(name, seed), 3) for seed in (4, 4, 5))
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("name", NOISES)
def test_a_noise_stream_resumed_from_its_checkpoint_continues_it(name):
    original = _privatizer(name, seed=6)
    _stream(original, 3)
    resumed = _privatizer(name, seed=7)
    resumed.load_state_dict(_saved_and_loaded(original.state_dict()))
    assert resumed.index == 3
    assert torch.equal(_stream(original, NOISE_ROUNDS - 3), _stream(resumed, NOISE_ROUNDS - 3))
    if resumed.horizon is not None:  # a correlated strategy is built for T steps: no step past it
        with pytest.raises(ValueError):
            resumed.next_noise()
