"""Randomness: derived seeds are independent secrets; the secure noise source is N(0, 1), unpredictable across
instances, and resumes exactly; the noise source reaches every noise of the round."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from scipy import stats

from fed_dp.config import PrivacyConfig
from fed_dp.noise import Privatizer
from fed_dp.optimizers import make_optimizer
from fed_dp.randomness import RADIUS_MAX, SecureNormal, TorchNormal, derive_seed, gaussian_from_words, make_noise_source
from fed_dp.round import init_server


def test_derived_seeds_are_sha256_of_purpose_and_seed_and_differ_by_purpose():
    expected = int.from_bytes(hashlib.sha256(b"fed-dp/noise/7").digest()[:8], "big") >> 1
    assert derive_seed(7, "noise") == expected  # recomputed here from the documented construction
    seeds = {derive_seed(7, p) for p in ("noise", "sampler", "local-training", "adaptive-clipping")}
    assert len(seeds) == 4 and 7 not in seeds and all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError):
        derive_seed(-1, "noise")


def test_the_server_uses_derived_seeds_so_the_clients_seed_reveals_neither_noise_nor_cohorts():
    config = PrivacyConfig(num_users=50, expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-5,
                           accountant="rdp")
    state = init_server(config, make_optimizer("dp-sgd"), torch.zeros(8), seed=7)
    assert state.privatizer.seed == derive_seed(7, "noise") and state.sampler.seed == derive_seed(7, "sampler")
    # a noise stream seeded with what a client knows (the raw seed or its own derived seed) is another stream
    for guess in (7, derive_seed(7, "local-training")):
        assert not torch.equal(Privatizer(None, noise_std=1.0, dim=8, seed=guess).next_noise(),
                               Privatizer(None, noise_std=1.0, dim=8, seed=state.privatizer.seed).next_noise())


def test_draws_of_any_count_have_that_count():
    for source in (SecureNormal(), TorchNormal(1)):
        assert [tuple(source.normal(n, torch.float32).shape) for n in (1, 7, 2, 0)] == [(1,), (7,), (2,), (0,)]


def _words(pairs: list[tuple[int, int, int]]) -> torch.Tensor:
    """The int64 words of pairs given as (a, b, angle word): the radius uniform is U = a·2⁶³ + b, a and b the top 63 bits
    of their words (a word w = 2·a here), and the angle θ = (word >> 11)·2π·2⁻⁵³."""
    columns = list(zip(*pairs))
    return torch.tensor([2 * v - 2**64 if 2 * v >= 2**63 else 2 * v for v in columns[0]]
                        + [2 * v - 2**64 if 2 * v >= 2**63 else 2 * v for v in columns[1]] + list(columns[2]),
                        dtype=torch.int64)


def _radius(u_index: int) -> float:
    """The radius sqrt(−2 ln u) of u = (U + 1)·2⁻¹²⁶, from Python's integers: ln u = ln(U + 1) − 126 ln 2 for u ≤ ½,
    log1p(−v) with v = (2¹²⁶ − U − 1)/2¹²⁶ (a correctly rounded integer quotient) above."""
    numerator, denominator = u_index + 1, 2**126
    if 2 * numerator <= denominator:
        return math.sqrt(-2 * (math.log(numerator) - 126 * math.log(2)))
    return math.sqrt(-2 * math.log1p(-((denominator - numerator) / denominator)))


def test_the_transform_reaches_its_documented_extremes_from_the_extreme_words():
    """Box–Muller on 126-bit radius uniforms: U = 0 gives u = 2⁻¹²⁶, r = sqrt(2·126·ln 2) ≈ 13.2 (a float32 uniform
    stopped at 5.8σ, a 53-bit one at 8.6σ); the angle word 0 is θ = 0 (the pair is (+r, 0)), the angle word 2⁶² is
    θ = π/2 ((0, +r)); U = 2¹²⁶ − 1 is u = 1, r = 0. A 10⁷-draw test could not see these tails."""
    radius_max = math.sqrt(2 * 126 * math.log(2))
    assert RADIUS_MAX == pytest.approx(radius_max, rel=1e-15)
    values = gaussian_from_words(_words([(0, 0, 0), (0, 0, 2**62)]))  # two pairs: (r cos θ) of both, then (r sin θ)
    first, second = values.view(2, 2)
    assert first[0].item() == pytest.approx(radius_max, rel=1e-12) and abs(second[0].item()) < 1e-12
    assert abs(first[1].item()) < 1e-12 and second[1].item() == pytest.approx(radius_max, rel=1e-12)
    top = 2**63 - 1
    assert torch.equal(gaussian_from_words(_words([(top, top, 0)])), torch.zeros(2, dtype=torch.float64))
    source = SecureNormal()
    source._bytes = lambda count: torch.zeros(count, dtype=torch.uint8)  # an all-zero keystream: every U is 0
    assert source.normal(3, torch.float64)[0].item() == pytest.approx(radius_max, rel=1e-12)


@pytest.mark.parametrize("u_index", [0, 1, 2**20, 2**70, 2**125 - 1, 2**125, 2**126 - 2**70, 2**126 - 2**20,
                                     2**126 - 3, 2**126 - 2])
def test_neighbouring_radius_words_give_radii_finer_than_the_grid(u_index):
    """Both values of a pair share one radius, so the radii themselves must be fine for the pair's outputs to be
    reachable under any shift of both coordinates: each radius is the one of its U (relative 10⁻¹², from Python's
    integers here), and the step to the next U's radius is below 2⁻³⁶ (the grid, in units of the std) up to r = 11.3
    (a pair beyond: probability e^(−r²/2) < 10⁻²⁷), below a float32 cell of the output (2⁻²⁴·r) up to 12.3, and tiny near
    r = 0 (u near 1, where ln u = log1p(−v) keeps v's bits: a 63-bit uniform left radii √k·2⁻²⁶ there)."""
    pair = _words([(u_index >> 63, u_index & (2**63 - 1), 0), ((u_index + 1) >> 63, (u_index + 1) & (2**63 - 1), 0)])
    here, following = gaussian_from_words(pair)[:2].tolist()  # angle 0: the values are the radii
    assert here == pytest.approx(_radius(u_index), rel=1e-12, abs=1e-300)
    assert following == pytest.approx(_radius(u_index + 1), rel=1e-12, abs=1e-300)
    if here < 11.3:
        assert here - following < 2.0**-36
    elif here < 12.3:
        assert here - following < 2.0**-24 * here
    if u_index >= 2**126 - 3:
        assert following < 2.0**-60


@pytest.mark.parametrize("make", [lambda: TorchNormal(3), SecureNormal], ids=["torch", "secure"])
def test_both_sources_are_standard_normal_in_float64_with_float64_resolution(make):
    """KS against N(0, 1) on 200,001 draws (accepts at p > 1e-5; rejects the scales 0.95 and 1.05 at p < 1e-9); the
    draws are float64 values that float32 cannot hold (the grid of a release needs a resolution finer than 2⁻³⁶ of the
    std: a float32 sample would be a multiple of 2⁻²⁴ of its magnitude)."""
    draws = make().normal(200_001)
    assert draws.dtype == torch.float64 and draws.shape == (200_001,)
    assert stats.kstest(draws.numpy(), "norm").pvalue > 1e-5
    for wrong in (0.95, 1.05):
        assert stats.kstest(draws.numpy() / wrong, "norm").pvalue < 1e-9
    assert float((draws.float().double() != draws).double().mean()) > 0.999


def test_a_seeded_source_is_reproducible_and_another_seed_is_another_stream():
    a, b = TorchNormal(5), TorchNormal(5)
    assert torch.equal(a.normal(70_001), b.normal(70_001))  # more than one block of values
    assert torch.equal(a.normal(3), b.normal(3)) and not torch.equal(TorchNormal(6).normal(3), TorchNormal(5).normal(3))


def test_secure_normal_instances_differ_and_resume_exactly():
    a, b = SecureNormal(), SecureNormal()
    assert not torch.equal(a.normal(16, torch.float32), b.normal(16, torch.float32))
    a.normal(5, torch.float32)
    saved = a.state_dict()
    expected = [a.normal(9, torch.float32) for _ in range(3)]
    restored = SecureNormal()
    restored.load_state_dict(saved)
    assert all(torch.equal(x, restored.normal(9, torch.float32)) for x in expected)
    with pytest.raises(ValueError, match="kind"):
        TorchNormal(1).load_state_dict(saved)


def test_secure_keystream_made_ahead_gives_the_same_draws_and_state():
    """prefetch() makes the next draw's keystream in a background thread: the values, their order and the state are
    those of a twin source that never prefetched, whatever the sizes asked next (a part of what was made, more than
    it, a resume in between); a resume discards what was made ahead and makes it again from the counter."""
    a, b = SecureNormal(), SecureNormal()
    b.load_state_dict(a.state_dict())
    for made, asked in ((1000, 1000), (1000, 300), (10, 2_001), (64, 7)):
        a.prefetch(made)
        assert torch.equal(a.normal(asked), b.normal(asked)) and a.state_dict() == b.state_dict()
    a.prefetch(500)
    saved = a.state_dict()  # what was made ahead is not consumed
    assert saved == b.state_dict()
    resumed = SecureNormal()
    resumed.load_state_dict(saved)
    a.load_state_dict(saved)  # discards the keystream made ahead; the next draws make it again
    for n in (500, 3):
        drawn = a.normal(n)
        assert torch.equal(drawn, b.normal(n)) and torch.equal(drawn, resumed.normal(n))


def test_secure_source_feeds_the_privatizer_and_takes_no_seed():
    privatizer = Privatizer(None, noise_std=2.0, dim=50_000, source="secure")
    assert privatizer.seed is None and isinstance(privatizer._source, SecureNormal)
    assert float(privatizer.next_noise().std()) == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError, match="cannot take a seed"):
        make_noise_source("secure", seed=3)
    with pytest.raises(ValueError, match="'torch' or 'secure'"):
        make_noise_source("mersenne", seed=None)
    config = PrivacyConfig(num_users=50, expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-5,
                           accountant="rdp")
    state = init_server(config, make_optimizer("dp-sgd"), torch.zeros(8), seed=7, noise_source="secure")
    assert isinstance(state.privatizer._source, SecureNormal)  # secure noise, seeded sampler
    assert state.sampler.seed == derive_seed(7, "sampler")
