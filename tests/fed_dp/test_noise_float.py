"""The noise in floating point: no output that names the neighbour (docs/explanation/floating-point.md, "Noise").

A Gaussian sample in float32 scaled by s leaves gaps: fl32(z·s) is not every float32 value, so an output in a gap
is impossible when the other users' sum under the noise is 0 and possible when it is ζ (Mironov 2012; Jin et al.
2022). fed-dp forms every release as Λ·(round(S/Λ) + k) with k = round(noise/Λ) an integer drawn independently of
the sum S. These tests check that structure on every noise path (independent, BandMF, BLT; torch and secure
sources; adaptive clipping's clip-bit count), with the integers recomputed here in exact rational arithmetic, and
run the gap detector of the float32 arithmetic of before against the same neighbours: it fires there (a check that
the detector has power), and the grid leaves it nothing.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from fed_dp.adaptive_clipping import AdaptiveClipConfig, AdaptiveClipper
from fed_dp.blt import BLTStrategy
from fed_dp.factorization import toeplitz_strategy
from fed_dp.noise import Privatizer
from fed_dp.randomness import RADIUS_MAX, GRID_BITS, TorchNormal, grid_step

#: σζ with a float32 significand far from a power of two (1.13 = 1.13·2⁰): the float32 products z·s skip about
#: 1 − 1/1.13 of the float32 values, so the old arithmetic's gaps are wide here.
STD = 1.13
CLIP = 1.0
MECHANISMS = {
    "independent": lambda: None,
    "bandmf": lambda: toeplitz_strategy([1.0, 0.5, 0.375, 0.3125], rounds=6),
    "blt": lambda: BLTStrategy((0.25, 0.2, 0.1), (0.95, 0.6, 0.3), 6),
}


def _twins(mechanism: str, source: str, dim: int, dtype: torch.dtype = torch.float64,
           device: str = "cpu") -> tuple[Privatizer, Privatizer]:
    """Two privatizers whose noise streams are the same draws (the secure one's key copied into the second)."""
    strategy = MECHANISMS[mechanism]()
    if source == "torch":
        return tuple(Privatizer(strategy, noise_std=STD, dim=dim, seed=7, dtype=dtype, device=device) for _ in range(2))
    a = Privatizer(strategy, noise_std=STD, dim=dim, source="secure", dtype=dtype, device=device)
    b = Privatizer(strategy, noise_std=STD, dim=dim, source="secure", dtype=dtype, device=device)
    b.load_state_dict(a.state_dict())
    return a, b


def _exact_grid_points(values: torch.Tensor, step: float) -> list[int]:
    """round(v/Λ) of each value in exact rational arithmetic (ties to even, as IEEE rounding)."""
    return [round(Fraction(float(v)) / Fraction(step)) for v in values.double()]


def _neighbours(dim: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 sum of clipped updates S and S + u, u of norm ζ: all in one coordinate in even rounds (the worst
    case for one coordinate), spread over every coordinate in odd rounds."""
    g = torch.Generator().manual_seed(100 + t)
    total = torch.randn(dim, generator=g) * 0.3
    if t % 2 == 0:
        user = torch.zeros(dim)
        user[t] = CLIP
    else:
        user = torch.randn(dim, generator=g)
        user = user * (CLIP / (1 + 1e-6) / float(user.double().norm()))
    return total, total + user


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", ["torch", "secure"])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_neighbouring_releases_differ_only_by_their_own_grid_points(mechanism, source, device):
    """For the same draws, the releases under S and S′ are Λ·(round(S/Λ) + k) and Λ·(round(S′/Λ) + k) with the same
    integer k in every coordinate and round (BandMF's and BLT's later steps included), so the noise never depends on
    the sum; in float32 the release is the float64 grid value rounded once (compared where the float32 privatizer's
    stream is the same: every round of independent noise, the first of the correlated ones, whose buffers are then
    held in float32)."""
    dim = 4_000
    step = grid_step(STD)
    a, b = _twins(mechanism, source, dim, device=device)
    a32, b32 = _twins(mechanism, "torch", dim, torch.float32, device) if source == "torch" else (None, None)
    sample = torch.cat([torch.arange(8), torch.randperm(dim, generator=torch.Generator().manual_seed(1))[:200]])
    for t in range(6):
        total, neighbour = _neighbours(dim, t)
        out, out_neighbour = a.privatize(total).cpu(), b.privatize(neighbour).cpu()
        k = out / step - torch.round(total.double() / step)
        assert torch.equal(k, torch.round(k)) and torch.equal(k, out_neighbour / step - torch.round(neighbour.double() / step))
        exact = [round(Fraction(float(o)) / Fraction(step)) - s
                 for o, s in zip(out[sample], _exact_grid_points(total[sample], step))]
        exact_neighbour = [round(Fraction(float(o)) / Fraction(step)) - s
                           for o, s in zip(out_neighbour[sample], _exact_grid_points(neighbour[sample], step))]
        assert exact == exact_neighbour == [int(v) for v in k[sample]]
        if a32 is not None and (mechanism == "independent" or t == 0):
            assert torch.equal(a32.privatize(total).cpu(), out.float())
            assert torch.equal(b32.privatize(neighbour).cpu(), out_neighbour.float())


def _old_release(total: torch.Tensor, z: torch.Tensor, std: float) -> torch.Tensor:
    """The arithmetic of before: fl32(fl32(z·fl32(σζ)) + S) with z a float32 draw."""
    return z.float() * torch.tensor(std, dtype=torch.float32) + total.float()


def _impossible_without_the_sum(out: torch.Tensor, std: float) -> torch.Tensor:
    """The gap detector of the old arithmetic, for a coordinate whose sum is 0 under one neighbour: True where no
    float32 z has fl32(z·fl32(σζ)) = out (candidates: the float32 nearest out/s and 3 neighbours on each side, which
    covers every z whose product can round to out)."""
    s = torch.tensor(std, dtype=torch.float32)
    centre = (out.double() / s.double()).float()
    possible = torch.zeros_like(out, dtype=torch.bool)
    for shift in range(-3, 4):
        z = centre
        for _ in range(abs(shift)):
            z = torch.nextafter(z, torch.full_like(z, math.copysign(math.inf, shift)))
        possible |= (z * s) == out
    return ~possible


@pytest.mark.parametrize("source", ["torch", "secure"])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_no_output_is_possible_under_one_neighbour_and_impossible_under_the_other(mechanism, source):
    """One coordinate's sum is ζ under one neighbour and 0 under the other (the issue's worst case), 200,000 times
    (the first step of each mechanism: its noise is z/c₀ with nothing correlated yet, where the old arithmetic had
    24% of gap outputs under BandMF). The old arithmetic's outputs under ζ fall in the gaps of the zero sum's in more
    than 5% of the coordinates (the detector works). Each grid output under ζ needs, under the zero sum, the noise
    integer K − round(0/Λ) = K, within the sampler's range |k| ≤ s·r_max/Λ (every integer there is reachable: the
    53-bit angle alone moves a value by 2π·r·2⁻⁵³ ≪ Λ/s = 2⁻³⁶), and symmetrically."""
    dim = 200_000
    step = grid_step(STD)
    a, _ = _twins(mechanism, source, dim)
    with_clip = torch.full((dim,), CLIP)
    out = a.privatize(with_clip)
    reach = math.floor(math.sqrt(a.noise_variance(0)) * RADIUS_MAX / step) + 1  # std of the first step: σζ·‖row 0 of C⁻¹‖
    old = _old_release(with_clip, TorchNormal(3).normal(dim, torch.float32), STD)
    assert float(_impossible_without_the_sum(old, STD).double().mean()) > 0.05
    needed_without = torch.round(out / step)  # the noise integer the zero sum would need
    needed_with = torch.round(out / step) - round(CLIP / step)
    assert torch.equal(needed_without * step, out)  # on the grid
    assert float(needed_without.abs().max()) <= reach and float(needed_with.abs().max()) <= reach
    zero = Privatizer(MECHANISMS[mechanism](), noise_std=STD, dim=dim, seed=11, dtype=torch.float64).privatize(torch.zeros(dim))
    assert float((torch.round(zero / step) - round(CLIP / step)).abs().max()) <= reach


def test_the_grid_is_a_fixed_fraction_of_the_noise_std_and_a_power_of_two():
    for std in (1e-6, 0.37, 1.0, 1.13, 2.0, 3e4):
        step = grid_step(std)
        assert math.frexp(step)[0] == 0.5 and std * 2.0**-(GRID_BITS + 1) < step <= std * 2.0**-GRID_BITS
    with pytest.raises(ValueError, match="noise std"):
        grid_step(0.0)


def _read_back(centered: float, count: int, candidates: list[int], is_noise) -> list[int]:
    """The counts c among ``candidates`` for which centered − (c − count/2) is a value the noise can take."""
    return [c for c in candidates if is_noise(centered - (c - count / 2))]


def test_the_clip_bit_count_cannot_be_read_back():
    """B = 1,000 users, σ_b = B/20 = 50 (the documented default), 2,000 rounds with the count 600 of 1,000 replies.
    With the arithmetic of before (a float32 draw times σ_b added in float64), the true count is the only one of
    599, 600, 601 whose difference to the release is σ_b times a float32: read back in more than 90% of rounds. With
    the grid, the release is the centered sum plus a multiple of Λ_b in the sampler's range, and so is it for every
    neighbouring count: none is ever singled out."""
    expected_cohort, std, count, bits = 1_000, 50.0, 1_000, 600
    clipper = AdaptiveClipper(AdaptiveClipConfig(bit_noise_std=std, initial_clip_norm=1.0), expected_cohort, seed=5)
    step = grid_step(std)
    reach = math.floor(std * RADIUS_MAX / step) + 1
    old_source = TorchNormal(6)

    def old_noise(value: float) -> bool:
        z = value / std
        return abs(z - float(torch.tensor(z, dtype=torch.float32))) <= 1e-12 * max(abs(z), 1e-30)

    def grid_noise(value: float) -> bool:
        k = Fraction(value) / Fraction(step)
        return k.denominator == 1 and abs(k) <= reach

    singled_out_old = singled_out_new = 0
    candidates = [bits - 1, bits, bits + 1]
    for _ in range(2_000):
        old = (bits - count / 2) + std * float(old_source.normal(1, torch.float32)[0])
        singled_out_old += _read_back(old, count, candidates, old_noise) == [bits]
        new = clipper.noisy_centered_sum(bits, count)
        assert _read_back(new, count, candidates, grid_noise) == candidates
        singled_out_new += _read_back(new, count, candidates, grid_noise) == [bits]
    assert singled_out_old > 1_800 and singled_out_new == 0
