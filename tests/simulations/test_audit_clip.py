"""`fed-dp audit` exercises the users' own clip (issue 37, item 4): its canaries are users trained and clipped by
the client code of the run (``LocalTrainer``: the one-step, vectorized or sequential path), each with an update of
at least K·ζ before its clip. A clip skipped for one user in every call of the node's training code (a test
double of that bug: the clip function the path calls, wrapped so that it returns one user's update unclipped) is
flagged on each path; the same audits without the bug are not.

Kept cheap for CI: the small heavy-tail task (40 users, d = 448 parameters: fewer than 2 × 300, which trained
canaries do not need), 300 canary candidates, B = 60, T = 3 rounds, σ = 1 (accounted ε = 5.05); under a second
of CPU each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fed_dp.clients import one_step, training, vectorized
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.audit import run_audit
from fed_dp.simulations.tasks.builtin import heavy_tail_task

TASK = heavy_tail_task()  # users of 1 or 2 examples; the first has 2
PRIVACY = PrivacyConfig(expected_cohort=60, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)  # one full-batch step: "auto" takes the one-step path
#: client.training → the path that trains the canaries
PATHS = {"auto": "one-step", "vectorized": "vectorized", "sequential": "sequential"}
LEAKS = "leaks more than accounted at confidence 98.75%"


def _audit(path: str, seed: int = 0):
    return run_audit(TASK, PRIVACY, make_optimizer("dp-fedavg"), LOCAL, canaries=300, seed=seed,
                     mechanism_only=True, training=path)


def _plant_skipped_clip(monkeypatch, path: str) -> list[float]:
    """Wrap the clip that ``path`` calls so that it releases one user's update unclipped per call (the first row of
    each vectorized chunk or one-step chunk; one user in four on the sequential path, which clips one user per
    call). Returns the list that collects the norms (over ζ = 1) of the updates released unclipped."""
    released: list[float] = []
    if path == "auto":  # one-step: the clip factor of the chunk's first user becomes 1
        clip_factors = one_step.clip_factors

        def skipping(norms, clip_norm, **options):
            factors = clip_factors(norms, clip_norm, **options).clone()
            factors[0] = 1.0
            released.append(float(norms[0]))
            return factors

        monkeypatch.setattr(one_step, "clip_factors", skipping)
    elif path == "vectorized":  # the chunk's first row leaves as it came
        clip_rows = vectorized.clip_rows

        def skipping(updates, clip_norm):
            clipped, norms = clip_rows(updates, clip_norm)
            clipped = clipped.clone()
            clipped[0] = updates[0]
            released.append(float(norms[0]))
            return clipped, norms

        monkeypatch.setattr(vectorized, "clip_rows", skipping)
    else:  # sequential: every fourth user's update leaves as it came
        clip_update = training.clip_update
        calls = []

        def skipping(update, clip_norm):
            result = clip_update(update, clip_norm)
            calls.append(1)
            if len(calls) % 4:
                return result
            released.append(result.norm)
            return replace(result, update=update.clone())

        monkeypatch.setattr(training, "clip_update", skipping)
    return released


@pytest.mark.parametrize("path", PATHS)
def test_a_skipped_clip_is_flagged_on_every_client_path(path, monkeypatch):
    """With the bug planted, canaries leave their client unclipped at K·ζ (K = 10·(B + 10σ) = 700 here): 3 times
    in the run on the one-step and vectorized paths (one per chunk, one chunk a round), 36 times on the sequential
    path. The server's re-clip of the node's sum to nζ leaves one such release among clipped users at least
    e = nK/(n − 1 + K) along its canary (simulations.audit.unclipped_score; e = 56 at the run's smallest node,
    n = 61), against a clip test critical value of 4.8 in noise of std σ = 1: the computed power against one
    such release is 1 in double precision, and the clip test flags every path (largest coefficients 69, 69 and 22,
    the last lower as 12 unclipped users a round share the node's re-clip; p = 0, 0 and 5e-99). The mean-based
    mechanism test also flags them here (p = 0.009, 0.009 and 1e-14), but it is not the detector this relies
    on. The path that ran is the one asked for."""
    released = _plant_skipped_clip(monkeypatch, path)
    result = _audit(path)
    assert result.canary_paths == (PATHS[path],) and result.canary_kind == "trained"
    assert len(released) >= 3 and min(released) > 0.999 * result.canary_norm  # it fired, on canaries far above ζ
    clip = result.clip_test
    assert clip["power_one_unclipped"] > 1 - 1e-9
    assert clip["verdict"] == LEAKS and clip["p_value"] < 1e-20 and clip["max_score"] > clip["threshold"]


def _honest(result) -> None:
    assert result.mechanism_test["verdict"] == result.clip_test["verdict"] == "consistent"
    for values in result.results.values():
        assert values["lower_bound_verdict"] in ("consistent", "inconclusive")
    assert result.mechanism_test["held_out_spread"] == pytest.approx(1.0, abs=0.3)


def test_the_honest_paths_release_the_same_canaries_and_are_not_flagged():
    """Without the bug the three paths release the same canaries (ζ·c_i each, up to float32 rounding): their
    scores agree to 1e-4 noise units, so the verdicts of an honest audit do not depend on the path. An honest
    audit gets any "leaks" verdict with probability at most 5% (Bonferroni over its four verdicts, each at
    1.25%; the tests' laws are exact, their rates checked by Monte Carlo in tests/fed_dp/test_audit_statistics.py);
    the seed is fixed, so the outcome is deterministic: mechanism test p = 0.297, clip test p = 0.648."""
    results = {path: _audit(path) for path in PATHS}
    for path, result in results.items():
        assert result.canary_paths == (PATHS[path],)
        _honest(result)
    scores = [result.scores["final-model"] for result in results.values()]
    spread = float(scores[0].std())
    for other in scores[1:]:
        assert torch.allclose(other, scores[0], rtol=0, atol=1e-4 * spread)


@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds_are_not_flagged(seed):
    """As above, on the one-step path (the paths agree): each seed is flagged with probability at most 5%, so
    the three seeds of these two tests all pass by chance with probability at least 0.95³ ≈ 86% (they are
    independent draws); fixed seeds: mechanism test p = 0.139 and 0.885, clip test p = 0.204 and 0.052."""
    _honest(_audit("auto", seed))
