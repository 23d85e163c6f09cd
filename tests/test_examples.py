"""The examples run, at tiny sizes, exactly as a user runs them: in-process with fed_dp.train, through the
`fed-dp simulate --task` command, and as a Flower app of the user's own under `flwr run`."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from fed_dp.accounting import epsilon
from fed_dp.simulations.cli import main as cli_main
from fed_dp.simulations.launch import local_simulation

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FLOWER_APP = EXAMPLES / "flower_app"


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("digits", "language_model", "fine_tune"):
        sys.modules.pop(name, None)


def test_digits_mlp_with_dp_adambc_is_calibrated_to_epsilon_3(examples_path, capsys):
    digits = importlib.import_module("digits")
    result = digits.main(users=20, rounds=3)
    assert result.privacy.num_users == 20 and result.privacy.expected_cohort == 10
    assert result.epsilon == epsilon(result.privacy, 3) and 2.99 < result.epsilon <= 3.0  # calibrated, one step
    assert result.privacy.delta == 1e-5 and type(result.state.optimizer).__name__ == "Adam"
    assert result.state.optimizer.bias_correction and result.state.optimizer.bc_floor is None  # γ = Φ̂_t
    printed = capsys.readouterr().out
    assert f"user-level epsilon {result.epsilon:.3f} at delta 1e-05" in printed
    assert 0.0 <= result.records[-1]["eval_accuracy"] <= 1.0
    assert len(Path(digits.__file__).read_text().splitlines()) <= 40  # the script a user copies


def test_language_model_on_the_repo_text_trains_next_token_prediction(examples_path):
    lm = importlib.import_module("language_model")
    task = lm.make_task()
    assert task.num_users == 100  # one user per line of the corpus, 20 lines held out
    result = lm.main(rounds=3)
    record = result.records[-1]
    assert result.epsilon <= 8.0 and result.epsilon == pytest.approx(epsilon(result.privacy, 3))
    vocabulary = len(task.build_model().out.bias)
    assert 1.0 < record["eval_perplexity"] < vocabulary * 1.5  # a real next-token loss, near uniform after 3 rounds
    assert record["eval_perplexity"] == pytest.approx(torch.tensor(record["eval_loss"]).exp().item(), rel=1e-6)


def test_the_pretraining_stand_in_compares_three_arms_at_the_same_epsilon(examples_path, capsys):
    """examples/fine_tune.py at a tiny size (docs/tutorials/fine-tune.md measured it at full size): LoRA on the
    pretrained model, the pretrained model in full and the model from scratch, each at the same ε, with the trainable
    counts of the architecture (LoRA r = 8 on c_attn 64 → 192 and c_fc 64 → 256 in 2 layers; the full GPT-2 2×64
    with a 64-token vocabulary and 1,024 positions)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    fine_tune = importlib.import_module("fine_tune")
    results = fine_tune.main(users=20, rounds=2, pretrain_steps=3, public_sequences=128)
    full = 64 * 64 + 1024 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert [r["trainable"] for r in results.values()] == [2 * 8 * ((64 + 192) + (64 + 256)), full, full]
    epsilons = {r["epsilon"] for r in results.values()}
    assert len(epsilons) == 1 and 0 < epsilons.pop() <= 3.0
    assert "pre-trained without privacy" in capsys.readouterr().out


def test_the_flower_apps_task_trains_in_process_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(FLOWER_APP)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the current folder on sys.path
    out = tmp_path / "run"
    status = cli_main(["simulate", "--task", "task:make_task", "--set", "privacy.expected-cohort=8", "--set",
                       "privacy.rounds=3", "--set", 'privacy.accountant="rdp"', "--out", str(out), "--quiet", "--no-plot"])
    assert status == 0
    sys.modules.pop("task", None)
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("dp-adam")][0]
    assert float(row[3]) > 0  # held-out MSE of the regression
    assert (out / "rounds-dp-adam.jsonl").exists()


def test_your_own_server_and_client_apps_run_with_flwr_run(tmp_path):
    log = local_simulation.run(tmp_path / "home", {"rounds": 3, "checkpoint-dir": str(tmp_path / "ckpt")},
                               supernodes=2, app=FLOWER_APP)
    match = re.search(r"user-level epsilon ([0-9.]+) at delta 0\.0001; held-out MSE ([0-9.]+)", log)
    assert match, log[-3000:]
    assert 3.99 < float(match.group(1)) <= 4.0  # calibrated to the app's target-epsilon = 4 over its 3 rounds
    assert re.search(r"round 3/3: epsilon 4\.0000, delta 0\.0001", log)
    assert (tmp_path / "ckpt" / "checkpoint.json").exists()
