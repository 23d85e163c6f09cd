"""The explicit non-private baseline, noise_multiplier = 0: allowed in every engine, ε infinite, every output
labelled non-private, no noise drawn (the update is the plain clipped mean), a budget refused."""

import json
import logging
import math

import pytest
import torch

from fed_dp.accounting import PrivacyLedger, epsilon, epsilon_schedule
from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import NOT_PRIVATE
from fed_dp.contribution import Contribution
from fed_dp.noise import NoNoise, make_privatizer
from fed_dp.optimizers import make_optimizer
from fed_dp.records import documented
from fed_dp.round import begin_round, finish_round, init_server
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.experiments.plots import plot_metrics
from fed_dp.simulations.experiments.runner import _summary_row, format_table
from fed_dp.simulations.tasks.builtin import heavy_tail_task

BASELINE = PrivacyConfig(num_users=40, expected_cohort=10, rounds=3, noise_multiplier=0.0, delta=1e-5)


def test_zero_noise_is_accepted_and_its_epsilon_is_infinite():
    assert BASELINE.non_private and not BASELINE.replace(noise_multiplier=1.0).non_private
    assert epsilon(BASELINE) == math.inf
    assert epsilon_schedule(BASELINE).epsilons == (math.inf,) * 3
    ledger = PrivacyLedger(BASELINE)
    ledger.record_round()
    assert ledger.epsilon == math.inf
    assert PrivacyLedger.from_dict(ledger.to_dict()).epsilon == math.inf  # a checkpoint of it resumes


def test_a_budget_or_adaptive_clipping_with_zero_noise_is_refused():
    with pytest.raises(ValueError, match="epsilon_budget = 5.0 with noise_multiplier = 0.*no privacy"):
        BASELINE.replace(epsilon_budget=5.0)
    with pytest.raises(ValueError, match="adaptive clipping needs noise_multiplier > 0"):
        init_server(BASELINE, make_optimizer("dp-fedavg"), torch.zeros(5),
                    adaptive_clipping=AdaptiveClipConfig(bit_noise_std=1.0, initial_clip_norm=1.0))
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        BASELINE.replace(noise_multiplier=-1.0)


@pytest.mark.parametrize("noise", ["independent", "bandmf"])
def test_no_noise_is_drawn_and_the_update_is_the_plain_clipped_mean(noise):
    config = BASELINE.replace(noise=noise, **({"bands": 2, "sampler": "cyclic-poisson"} if noise == "bandmf" else {}))
    assert isinstance(make_privatizer(config, 4), NoNoise)
    state = init_server(config, make_optimizer("dp-fedavg"), torch.zeros(4, dtype=torch.float64), seed=0)
    plan = begin_round(state)
    users = plan.cohort.numel()
    g = torch.Generator().manual_seed(0)
    updates = [u / max(1.0, float(u.norm())) for u in torch.randn(users, 4, generator=g, dtype=torch.float64)]
    after, record = finish_round(state, plan, [Contribution(u, 1) for u in updates])
    expected = sum(updates, torch.zeros(4, dtype=torch.float64)) / config.expected_cohort  # dp-fedavg: lr 1
    # equal up to the float64 rounding of the summation order (noise of σ = 1 would move it by about ζ/B = 0.1)
    torch.testing.assert_close(after.params, expected, rtol=1e-12, atol=1e-15)
    assert record["epsilon"] == NOT_PRIVATE and record["non_private"] is True


def test_every_output_of_a_run_is_labelled_non_private(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        result = train(heavy_tail_task(), BASELINE.replace(num_users=None), "dp-adam", LocalTraining(batch_size=2),
                       seed=0, checkpoint_dir=str(tmp_path), device="cpu")
    assert any("NO noise" in r.getMessage() and "NO privacy" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert result.epsilon == NOT_PRIVATE
    assert all(r["non_private"] is True and r["epsilon"] == NOT_PRIVATE for r in result.records)
    text = (tmp_path / "results.json").read_text()
    assert "Infinity" not in text and all(r["non_private"] for r in json.loads(text))
    assert documented("non_private").part == "public"
    row = _summary_row("dp-adam", result.records, 1.0)
    assert row["non_private"] is True and NOT_PRIVATE in format_table([row])


def test_the_plot_labels_a_non_private_run(tmp_path, monkeypatch):
    records = [{"round": 0, "epsilon": NOT_PRIVATE, "non_private": True, "eval_accuracy": 0.1, "eval_loss": 2.0},
               {"round": 1, "epsilon": NOT_PRIVATE, "non_private": True, "eval_accuracy": 0.5, "eval_loss": 1.0}]
    labels = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.legend
    monkeypatch.setattr(matplotlib.axes.Axes, "legend",
                        lambda self, *a, **k: labels.extend(self.get_legend_handles_labels()[1]) or original(self, *a, **k))
    plot_metrics({"dp-adam": records}, tmp_path / "metrics.png")
    assert "dp-adam (NON-PRIVATE)" in labels
