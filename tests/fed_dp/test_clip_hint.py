"""The clip-norm hint: read from released (noised) averages only, fires once when they are far under ζ and the noise
drowns them; quiet when clipped updates cancel in the sum but still rise above the noise (the main job)."""

import logging
import math

import pytest
import torch

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.clip_hint import MIN_ROUNDS, RATIO, WINDOW, ClipHint, average_norm_bound, mean_square_bound
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.records import PUBLIC, documented
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.tasks.builtin import heavy_tail_mixture_task


@pytest.mark.parametrize("true_norm", [0.0, 0.05, 0.5])
def test_the_bound_covers_the_average_norm_and_approaches_it(true_norm):
    dim, std, rounds = 500, 0.02, 400
    g = torch.Generator().manual_seed(int(true_norm * 100))
    mu = torch.full((dim,), true_norm / math.sqrt(dim), dtype=torch.float64)
    squared = [float((mu + std * torch.randn(dim, generator=g, dtype=torch.float64)).square().sum())
               for _ in range(rounds)]
    bound = average_norm_bound(squared, dim, std)
    assert true_norm <= bound <= true_norm + 0.05
    assert mean_square_bound(squared, dim, std) == pytest.approx(bound**2)


DIM, STD = 2000, 0.01  # the noise on the average: norm sqrt(d)·φ = 0.45, mean square dφ² = 0.2


def _norm_of(signal: float) -> float:
    """The expected noised norm of an average of norm ``signal``."""
    return math.sqrt(signal**2 + DIM * STD**2)


def _observe(hint: ClipHint, signals: list[float], first_round: int = 1) -> list[str | None]:
    return [hint.observe(_norm_of(signal), t) for t, signal in enumerate(signals, start=first_round)]


def test_the_hint_fires_once_after_the_minimum_rounds_when_the_average_is_small_and_drowned():
    fired = _observe(ClipHint(DIM, STD, clip_norm=1.0), [0.01] * (3 * MIN_ROUNDS))
    assert fired[:MIN_ROUNDS - 1] == [None] * (MIN_ROUNDS - 1)
    messages = [m for m in fired if m is not None]
    assert len(messages) == 1 and "the noise drowns the released updates" in messages[0]
    assert f"under {RATIO:g} x the clip norm 1" in messages[0] and "adaptive.enabled = true" in messages[0]
    assert all(m is None for m in _observe(ClipHint(DIM, STD, clip_norm=1.0), [0.9] * (3 * MIN_ROUNDS)))


def test_an_average_far_under_the_clip_but_above_the_noise_gets_no_hint():
    """Issue 40 item 6: the main job's situation. Every update is clipped and they cancel in the sum, so the average
    is far under ζ (0.2 < ζ/4), but its power is 0.2 of the noise's each round: the updates are not drowned, and a
    smaller ζ would change nothing. The earlier rule (the bound under ζ/4 alone) warned here."""
    hint = ClipHint(DIM, STD, clip_norm=1.0)
    assert all(m is None for m in _observe(hint, [0.2] * (3 * MIN_ROUNDS)))
    assert average_norm_bound(hint.squared_norms, DIM, STD) < RATIO  # the earlier rule's condition held


def test_the_first_rounds_decide_whether_the_noise_drowns_the_updates():
    """A converging run: strong updates in the first rounds, then nothing but noise. Averaged over every round the
    bound falls under ζ/4, but the first WINDOW rounds showed updates above the noise: no hint. A run resumed after
    those rounds has none to read: no hint either."""
    hint = ClipHint(DIM, STD, clip_norm=1.0)
    assert all(m is None for m in _observe(hint, [0.2] * WINDOW + [0.0] * 200))
    assert average_norm_bound(hint.squared_norms, DIM, STD) < RATIO
    assert all(m is None for m in _observe(ClipHint(DIM, STD, clip_norm=1.0), [0.0] * 50, first_round=WINDOW + 1))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one round"):
        average_norm_bound([], 3, 0.1)
    with pytest.raises(ValueError, match="noise_std must be a finite number > 0"):
        average_norm_bound([1.0], 3, 0.0)


def _hints(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "adaptive clipping" in r.getMessage()]


#: The main job's task, scaled down (31 classes in d = 64, 2 examples per user, one local step at lr 0.5): every
#: user's update is clipped at ζ = 1 and the updates of users of different classes cancel in the sum.
PRIVACY = PrivacyConfig(expected_cohort=128, rounds=WINDOW, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)


@pytest.fixture(scope="module")
def main_job_task():
    """The main job's task scaled down: 31 classes in d = 32 (1,023 parameters), 1,280 users of 2 examples, one local
    step at lr 0.5 (the main job: 127 classes in d = 64, 14,336 users)."""
    return heavy_tail_mixture_task(groups=5, largest=512, dim=32, spread=2.0, held_out=4, users=1280)


def test_the_main_jobs_situation_gets_no_hint_and_a_clip_far_above_the_updates_gets_one(caplog, main_job_task):
    """Issue 40 item 6: the main job printed this warning for four of its five optimizers. On its task scaled down,
    most users' updates are clipped (the records' non-private fraction) and the average is far under ζ, but above
    the noise: no warning. With ζ = 1000, far above the users' update norms, the noise drowns them: one warning."""
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        clipped = train(main_job_task, PRIVACY, "dp-fedavg", LOCAL, seed=0, eval_every=0, device="cpu")
    assert min(r["nonprivate_fraction_clipped"] for r in clipped.records) > 0.8
    released = [r["noised_average_norm"] ** 2 for r in clipped.records]
    assert average_norm_bound(released, 32 * 31 + 31, 1.0 / 128) < RATIO  # the earlier rule fired here
    assert not _hints(caplog)
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        train(main_job_task, PRIVACY.replace(clip_norm=1000.0), "dp-fedavg", LOCAL, seed=0, eval_every=0, device="cpu")
    assert len(_hints(caplog)) == 1


def test_a_run_with_a_clip_far_above_the_updates_gets_the_hint_once_and_adaptive_clipping_none(caplog,
                                                                                               main_job_task):
    """The hint reads only noised_average_norm, a public key of the record (a release, no privacy cost)."""
    assert documented("noised_average_norm").part == PUBLIC
    privacy = PRIVACY.replace(rounds=3 * MIN_ROUNDS, clip_norm=1000.0)
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        result = train(main_job_task, privacy, "dp-fedavg", LOCAL, seed=0, eval_every=0, device="cpu")
    assert len(_hints(caplog)) == 1
    assert all("noised_average_norm" in r for r in result.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        result = train(main_job_task, privacy, "dp-fedavg", LOCAL, seed=0, eval_every=0, device="cpu",
                       adaptive_clipping=AdaptiveClipConfig(bit_noise_std=100.0, initial_clip_norm=1000.0))
    assert not _hints(caplog) and not any("noised_average_norm" in r for r in result.records)
