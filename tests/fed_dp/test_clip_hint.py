"""The clip-norm hint: read from released (noised) averages only, fires once when they are far under ζ."""

import logging
import math

import pytest
import torch

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.clip_hint import MIN_ROUNDS, RATIO, ClipHint, average_norm_bound
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.records import PUBLIC, documented
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.tasks.builtin import heavy_tail_task


@pytest.mark.parametrize("true_norm", [0.0, 0.05, 0.5])
def test_the_bound_covers_the_average_norm_and_approaches_it(true_norm):
    dim, std, rounds = 500, 0.02, 400
    g = torch.Generator().manual_seed(int(true_norm * 100))
    mu = torch.full((dim,), true_norm / math.sqrt(dim), dtype=torch.float64)
    squared = [float((mu + std * torch.randn(dim, generator=g, dtype=torch.float64)).square().sum())
               for _ in range(rounds)]
    bound = average_norm_bound(squared, dim, std)
    assert true_norm <= bound <= true_norm + 0.05


def test_the_hint_fires_once_after_the_minimum_rounds_and_only_when_small():
    dim, std = 100, 0.01
    quiet, small = ClipHint(dim, std, clip_norm=1.0), ClipHint(dim, std, clip_norm=1.0)
    norm_of = lambda signal: math.sqrt(signal**2 + dim * std**2)  # noqa: E731  (the expected noised norm)
    fired = [small.observe(norm_of(0.01)) for _ in range(3 * MIN_ROUNDS)]
    assert fired[:MIN_ROUNDS - 1] == [None] * (MIN_ROUNDS - 1)
    messages = [m for m in fired if m is not None]
    assert len(messages) == 1 and "adaptive clipping" in messages[0] and f"under {RATIO:g} x the clip norm 1" in messages[0]
    assert all(quiet.observe(norm_of(0.9)) is None for _ in range(3 * MIN_ROUNDS))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one round"):
        average_norm_bound([], 3, 0.1)
    with pytest.raises(ValueError, match="noise_std must be a finite number > 0"):
        average_norm_bound([1.0], 3, 0.0)


def _hints(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "adaptive clipping" in r.getMessage()]


def test_a_run_with_a_clip_far_above_the_updates_gets_the_hint_once_and_adaptive_clipping_none(caplog):
    """The hint reads only noised_average_norm, a public key of the record (a release, no privacy cost)."""
    assert documented("noised_average_norm").part == PUBLIC
    privacy = PrivacyConfig(expected_cohort=30, rounds=3 * MIN_ROUNDS, noise_multiplier=1.0, delta=1e-5,
                            clip_norm=1000.0, accountant="rdp")
    local = LocalTraining(batch_size=2, lr=0.05)
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        result = train(heavy_tail_task(), privacy, "dp-fedavg", local, seed=0, eval_every=0, device="cpu")
    assert len(_hints(caplog)) == 1
    assert all("noised_average_norm" in r for r in result.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        result = train(heavy_tail_task(), privacy, "dp-fedavg", local, seed=0, eval_every=0, device="cpu",
                       adaptive_clipping=AdaptiveClipConfig(bit_noise_std=10.0, initial_clip_norm=1000.0))
    assert not _hints(caplog) and not any("noised_average_norm" in r for r in result.records)
