"""Privatizers: the noise scale, BandMF streaming vs the dense C⁻¹Z, variance reports, checkpoints.

Expected values are computed here from first principles (σζ/B, dense triangular solves of C), never
taken from the code under test.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from scipy import stats

from fed_dp.aggregation import private_average, unscale
from fed_dp.config import PrivacyConfig
from fed_dp.noise import Privatizer, make_privatizer
from fed_dp.randomness import TorchNormal
from fed_dp.factorization import banded_from_dense, toeplitz_strategy

SIGMA, CLIP, COHORT = 1.3, 0.7, 25
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _zero_round_noise(privatizer: Privatizer, dim: int) -> torch.Tensor:
    return private_average(torch.zeros(dim), privatizer, COHORT).double()


def _std_bound(n: int) -> float:
    """5-sigma relative bound on a sample std of n i.i.d. Gaussians: sd(s)/s ≈ 1/sqrt(2n)."""
    return 5 / math.sqrt(2 * n)


# --- independent noise ------------------------------------------------------------------------------
def test_independent_noise_std_on_zero_aggregate_is_sigma_zeta_over_B():
    dim = 200_000
    privatizer = Privatizer(None, noise_std=SIGMA * CLIP, dim=dim, seed=11)
    noise = _zero_round_noise(privatizer, dim)
    expected = SIGMA * CLIP / COHORT
    assert abs(noise.std().item() / expected - 1) < _std_bound(dim)
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(dim)


def test_ks_accepts_the_right_scale_and_rejects_wrong_ones():
    dim = 20_000
    privatizer = Privatizer(None, noise_std=SIGMA * CLIP, dim=dim, seed=12)
    noise = _zero_round_noise(privatizer, dim).numpy()
    scale = SIGMA * CLIP / COHORT
    assert stats.kstest(noise / scale, "norm").pvalue > 1e-3
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(noise / (scale * wrong), "norm").pvalue < 1e-6


def test_make_privatizer_scales_by_sigma_times_clip_norm():
    config = PrivacyConfig(
        num_users=1000, expected_cohort=COHORT, rounds=5, noise_multiplier=SIGMA, clip_norm=CLIP, delta=1e-5
    )
    privatizer = make_privatizer(config, dim=50_000, seed=3)
    noise = _zero_round_noise(privatizer, 50_000)
    assert abs(noise.std().item() / (SIGMA * CLIP / COHORT) - 1) < _std_bound(50_000)
    assert privatizer.noise_variance() == pytest.approx((SIGMA * CLIP) ** 2)


def test_fixed_denominator_does_not_depend_on_who_replied():
    """Δ̃ = (Σ + w)/B with B fixed: 3 replies out of B expected still divide by B."""
    dim = 64
    total = torch.randn(dim, generator=torch.Generator().manual_seed(0))  # sum of 3 users' updates
    got = private_average(total, Privatizer(None, noise_std=1.0, dim=dim, seed=5), COHORT)
    twin_noise = Privatizer(None, noise_std=1.0, dim=dim, seed=5).next_noise()
    torch.testing.assert_close(got, ((total + twin_noise) / COHORT).float())


def test_private_average_leaves_the_input_untouched():
    total = torch.ones(10)
    private_average(total, Privatizer(None, noise_std=1.0, dim=10, seed=1), 4)
    assert torch.equal(total, torch.ones(10))


def test_unscale_divides_by_the_broadcast_scale():
    average = torch.tensor([1.0, 2.0, 3.0])
    scale = torch.tensor([0.5, 2.0, 4.0])
    torch.testing.assert_close(unscale(average, scale), torch.tensor([2.0, 1.0, 0.75]))
    with pytest.raises(ValueError, match="positive"):
        unscale(average, torch.tensor([1.0, 0.0, 1.0]))


# --- BandMF ----------------------------------------------------------------------------------------------
def _random_banded(rounds: int, bands: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.zeros(rounds, rounds, dtype=torch.float64)
    for r in range(bands):
        values = torch.rand(rounds - r, generator=g, dtype=torch.float64) * (2.0 if r == 0 else 0.6) + (
            0.5 if r == 0 else -0.3
        )
        dense += torch.diag(values, -r)
    return dense


STRATEGIES = {
    "toeplitz": lambda: toeplitz_strategy([1.0, 0.5, 0.375, 0.3125], rounds=12),
    "general": lambda: banded_from_dense(_random_banded(12, 4, seed=7), bands=4),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_streaming_bandmf_equals_dense_inverse_times_z(name):
    strategy = STRATEGIES[name]()
    rounds, dim, seed = strategy.rounds, 257, 21
    privatizer = Privatizer(strategy, noise_std=1.0, dim=dim, seed=seed, dtype=torch.float64)
    streamed = torch.stack([privatizer.next_noise() for _ in range(rounds)])
    source = TorchNormal(seed)  # the same draws, one z_t per round
    z = torch.stack([source.normal(dim) for _ in range(rounds)])
    dense = torch.linalg.solve_triangular(strategy.dense(), z, upper=False)
    torch.testing.assert_close(streamed, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_bandmf_float32_matches_dense_to_single_precision(device):
    strategy = STRATEGIES["toeplitz"]()
    privatizer = Privatizer(strategy, noise_std=2.0, dim=1000, seed=4, device=device)
    streamed = torch.stack([privatizer.next_noise() for _ in range(strategy.rounds)]).double().cpu()
    source = TorchNormal(4, device)
    z = torch.stack([source.normal(1000) for _ in range(strategy.rounds)]).cpu()
    dense = 2.0 * torch.linalg.solve_triangular(strategy.dense(), z, upper=False)
    torch.testing.assert_close(streamed, dense, rtol=1e-5, atol=1e-5)


def test_bandmf_noise_std_per_round_is_sigma_zeta_row_norm_over_B():
    strategy = STRATEGIES["general"]()
    dim = 40_000
    privatizer = Privatizer(strategy, noise_std=SIGMA * CLIP, dim=dim, seed=8)
    row_norms = torch.linalg.inv(strategy.dense()).norm(dim=1)  # independent: dense inverse
    for t in range(strategy.rounds):
        noise = _zero_round_noise(privatizer, dim)
        expected = SIGMA * CLIP * row_norms[t].item() / COHORT
        assert abs(noise.std().item() / expected - 1) < _std_bound(dim), t
        assert privatizer.noise_variance(t) == pytest.approx((SIGMA * CLIP * row_norms[t].item()) ** 2, rel=1e-10)
        if t in (0, strategy.rounds - 1):
            sample = noise[:10_000].numpy()
            assert stats.kstest(sample / expected, "norm").pvalue > 1e-3
            for wrong in (2 / 3, 3 / 2):
                assert stats.kstest(sample / (expected * wrong), "norm").pvalue < 1e-6


def test_bandmf_noise_is_correlated_across_rounds_as_C_inverse_says():
    """Monte Carlo covariance of (y_0, y_1) over coordinates equals (C⁻¹C⁻ᵀ)[0, 1]."""
    strategy = STRATEGIES["toeplitz"]()
    privatizer = Privatizer(strategy, noise_std=1.0, dim=200_000, seed=9, dtype=torch.float64)
    y0, y1 = privatizer.next_noise(), privatizer.next_noise()
    inverse = torch.linalg.inv(strategy.dense())
    expected = (inverse @ inverse.T)[0, 1].item()
    assert abs((y0 * y1).mean().item() - expected) < 5 * math.sqrt(2 / 200_000)
    assert expected < -0.1  # the strategy has anti-correlated noise, so the check is not vacuous


def test_save_and_restore_reproduce_the_exact_continuation():
    strategy = STRATEGIES["general"]()
    original = Privatizer(strategy, noise_std=0.9, dim=500, seed=31)
    before = [original.next_noise() for _ in range(5)]
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = Privatizer(strategy, noise_std=0.9, dim=500, seed=999)  # different seed, then overwritten
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.index == 5 and restored.seed == 31
    for _ in range(strategy.rounds - 5):
        expected, got = original.next_noise(), restored.next_noise()
        assert torch.equal(expected, got)
        assert all(not torch.equal(got, old) for old in before)  # no noise vector is reused


def test_restoring_into_another_mechanism_is_refused():
    state = Privatizer(STRATEGIES["general"](), noise_std=1.0, dim=10, seed=1).state_dict()
    with pytest.raises(ValueError, match="strategy"):
        Privatizer(STRATEGIES["toeplitz"](), noise_std=1.0, dim=10).load_state_dict(state)
    with pytest.raises(ValueError, match="noise_std"):
        Privatizer(STRATEGIES["general"](), noise_std=2.0, dim=10).load_state_dict(state)


def test_bandmf_refuses_steps_past_its_horizon_and_per_round_scales():
    strategy = toeplitz_strategy([1.0, 0.4], rounds=3)
    privatizer = Privatizer(strategy, noise_std=1.0, dim=4, seed=0)
    with pytest.raises(ValueError, match="same scale"):
        privatizer.next_noise(noise_std=2.0)
    for _ in range(3):
        privatizer.next_noise()
    with pytest.raises(ValueError, match="T = 3"):
        privatizer.next_noise()


def test_independent_noise_accepts_a_per_round_scale():
    a = Privatizer(None, noise_std=1.0, dim=1000, seed=2).next_noise(noise_std=3.0)
    b = Privatizer(None, noise_std=1.0, dim=1000, seed=2).next_noise()
    torch.testing.assert_close(a, 3.0 * b)


def test_unseeded_privatizers_draw_from_os_entropy():
    a = Privatizer(None, noise_std=1.0, dim=100)
    b = Privatizer(None, noise_std=1.0, dim=100)
    assert not a.seeded_explicitly and not b.seeded_explicitly
    assert a.seed != b.seed
    assert not torch.equal(a.next_noise(), b.next_noise())
    assert Privatizer(None, noise_std=1.0, dim=1, seed=3).seeded_explicitly


def test_make_privatizer_builds_the_optimized_bandmf_strategy(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = PrivacyConfig(
        num_users=1000, expected_cohort=10, rounds=20, noise_multiplier=1.0, delta=1e-5,
        sampler="cyclic-poisson", noise="bandmf", bands=4,
    )
    privatizer = make_privatizer(config, dim=8, seed=0)
    assert privatizer.strategy is not None and privatizer.strategy.bands == 4
    assert privatizer.strategy.rounds == 20
    assert list(tmp_path.iterdir()), "the optimized strategy is cached on disk"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"noise_std": 0.0, "dim": 3}, "noise_std"),
        ({"noise_std": 1.0, "dim": 0}, "dim"),
        ({"noise_std": float("inf"), "dim": 3}, "noise_std"),
    ],
)
def test_privatizer_validates_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Privatizer(None, **kwargs)


def test_privatize_refuses_a_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        Privatizer(None, noise_std=1.0, dim=3, seed=0).privatize(torch.zeros(4))


# --- BLT -------------------------------------------------------------------------------------------
from fed_dp.blt import BLTStrategy  # noqa: E402

BLT = BLTStrategy((0.25, 0.2, 0.1), (0.95, 0.6, 0.3), 14)
# θ of both signs near the bound |θ| < 2, like the optimized min-sep BLTs (T = 2,000, m = 64, 3 buffers)
MIXED_BLT = BLTStrategy((1.0066, -1.9677, 1.4421), (0.8563, 0.9265, 0.9583), 60)


def _dense_blt(strategy: BLTStrategy) -> torch.Tensor:
    """C = C̃/‖c‖ built by explicit loops from θ, ω (not from the code under test)."""
    T = strategy.rounds
    c = [1.0] + [sum(th * om ** (t - 1) for th, om in zip(strategy.theta, strategy.omega)) for t in range(1, T)]
    C = torch.zeros(T, T, dtype=torch.float64)
    for t in range(T):
        for j in range(t + 1):
            C[t, j] = c[t - j]
    return C / math.sqrt(sum(v * v for v in c))


@pytest.mark.parametrize("strategy", [BLT, MIXED_BLT])
def test_streaming_blt_equals_dense_inverse_times_z(strategy):
    rounds, dim, seed = strategy.rounds, 300, 5
    privatizer = Privatizer(strategy, noise_std=1.7, dim=dim, seed=seed, dtype=torch.float64)
    assert privatizer.buffer.shape == (3, dim)  # ℓ buffers of d floats, nothing of size T
    streamed = torch.stack([privatizer.next_noise() for _ in range(rounds)])
    source = TorchNormal(seed)
    z = torch.stack([source.normal(dim) for _ in range(rounds)])
    dense = 1.7 * torch.linalg.solve_triangular(_dense_blt(strategy), z, upper=False)
    torch.testing.assert_close(streamed, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", [BLT, MIXED_BLT])
@pytest.mark.parametrize("device", DEVICES)
def test_streaming_blt_float32_matches_dense_to_single_precision(device, strategy):
    privatizer = Privatizer(strategy, noise_std=0.5, dim=1000, seed=6, device=device)
    streamed = torch.stack([privatizer.next_noise() for _ in range(strategy.rounds)]).double().cpu()
    source = TorchNormal(6, device)
    z = torch.stack([source.normal(1000) for _ in range(strategy.rounds)]).cpu()
    dense = 0.5 * torch.linalg.solve_triangular(_dense_blt(strategy), z, upper=False)
    torch.testing.assert_close(streamed, dense, rtol=1e-5, atol=1e-5)


def test_blt_noise_std_per_round_is_sigma_zeta_row_norm_over_B():
    dim = 40_000
    privatizer = Privatizer(BLT, noise_std=SIGMA * CLIP, dim=dim, seed=8)
    row_norms = torch.linalg.inv(_dense_blt(BLT)).norm(dim=1)
    for t in range(BLT.rounds):
        noise = _zero_round_noise(privatizer, dim)
        expected = SIGMA * CLIP * row_norms[t].item() / COHORT
        assert abs(noise.std().item() / expected - 1) < _std_bound(dim), t
        assert privatizer.noise_variance(t) == pytest.approx((SIGMA * CLIP * row_norms[t].item()) ** 2, rel=1e-10)
    sample = noise[:10_000].numpy()
    assert stats.kstest(sample / expected, "norm").pvalue > 1e-3
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(sample / (expected * wrong), "norm").pvalue < 1e-6


def test_blt_save_and_restore_mid_stream_continue_exactly():
    original = Privatizer(BLT, noise_std=0.9, dim=500, seed=31)
    before = [original.next_noise() for _ in range(6)]
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = Privatizer(BLT, noise_std=0.9, dim=500, seed=7)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.index == 6 and torch.equal(restored.buffer, original.buffer)
    for _ in range(BLT.rounds - 6):
        expected, got = original.next_noise(), restored.next_noise()
        assert torch.equal(expected, got)
        assert all(not torch.equal(got, old) for old in before)
    with pytest.raises(ValueError, match="T = 14"):
        restored.next_noise()


def test_blt_state_is_refused_by_another_mechanism():
    state = Privatizer(BLT, noise_std=1.0, dim=10, seed=1).state_dict()
    other = BLTStrategy((0.25, 0.2, 0.1), (0.95, 0.6, 0.31), 14)
    with pytest.raises(ValueError, match="strategy"):
        Privatizer(other, noise_std=1.0, dim=10).load_state_dict(state)
    with pytest.raises(ValueError, match="strategy"):
        Privatizer(STRATEGIES["general"](), noise_std=1.0, dim=10).load_state_dict(state)
    with pytest.raises(ValueError, match="same scale"):
        Privatizer(BLT, noise_std=1.0, dim=10).next_noise(noise_std=2.0)


def test_bandmf_state_without_a_version_still_loads():
    """Checkpoints written before the state carried a version hold the same unit-scale ring."""
    strategy = STRATEGIES["general"]()
    original = Privatizer(strategy, noise_std=1.0, dim=50, seed=3)
    for _ in range(4):
        original.next_noise()
    state = original.state_dict()
    del state["version"]
    restored = Privatizer(strategy, noise_std=1.0, dim=50, seed=0)
    restored.load_state_dict(state)
    assert torch.equal(restored.next_noise(), original.next_noise())
    state["version"] = 99
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict(state)


def test_make_privatizer_builds_the_configs_blt_and_refuses_another(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = PrivacyConfig(num_users=1000, expected_cohort=10, rounds=20, noise_multiplier=1.0, delta=1e-5,
                           sampler="min-sep", noise="blt", buffers=2)
    privatizer = make_privatizer(config, dim=8, seed=0)
    assert isinstance(privatizer.strategy, BLTStrategy) and privatizer.strategy.buffers == 2
    assert privatizer.strategy.rounds == 20 and privatizer.buffer.shape == (2, 8)
    assert [p.name for p in tmp_path.iterdir()] == ["blt-v2-T20-k2-m20-prefix-sum.json"]  # m = 100 ≥ T: capped
    assert make_privatizer(config, dim=8, seed=0, strategy=privatizer.strategy).strategy == privatizer.strategy
    with pytest.raises(ValueError, match="not the config's optimized BLT"):
        make_privatizer(config, dim=8, strategy=BLTStrategy((0.3,), (0.5,), 20))
