"""Checkpoints: atomic, exact resume (same final model, continued ledger, no reused noise), refusals."""

from __future__ import annotations

import pytest
import torch

from fed_dp.checkpoint import CHECKPOINT_NAME, load_checkpoint, resume, save_checkpoint
from fed_dp.config import PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.round import Contribution, begin_round, finish_round, init_server

DIM = 30
CONFIG = PrivacyConfig(num_users=100, expected_cohort=10, rounds=6, noise_multiplier=1.0, delta=1e-5, accountant="rdp")


def _round(state):
    plan = begin_round(state)
    g = torch.Generator().manual_seed(1000 + plan.round)
    updates = torch.randn(plan.cohort.numel(), DIM, generator=g)
    state, metrics = finish_round(state, plan, [Contribution(u / max(1.0, float(u.norm())), 1) for u in updates])
    return state, metrics


def test_kill_and_resume_reaches_the_same_model_and_continues_the_ledger(tmp_path):
    straight = init_server(CONFIG, make_optimizer("dp-adam", lr=0.1), torch.zeros(DIM), seed=5)
    for _ in range(6):
        straight, _ = _round(straight)

    first = init_server(CONFIG, make_optimizer("dp-adam", lr=0.1), torch.zeros(DIM), seed=5)
    for _ in range(4):
        first, _ = _round(first)
        save_checkpoint(first, tmp_path, extra={"rounds_done": first.round})
    noises_before = first.privatizer.state_dict()["index"]
    del first  # the "killed" server

    resumed = init_server(CONFIG, make_optimizer("dp-adam", lr=0.1), torch.zeros(DIM))  # fresh entropy seeds
    assert resume(resumed, tmp_path) == {"rounds_done": 4}
    assert resumed.round == 4 and resumed.ledger.rounds == 4 and resumed.privatizer.index == noises_before
    for _ in range(2):
        resumed, metrics = _round(resumed)
    assert torch.equal(resumed.params, straight.params)
    assert resumed.ledger.records == straight.ledger.records
    assert metrics["epsilon"] == straight.ledger.epsilon


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    assert resume(state, tmp_path) is None and state.round == 0


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path):
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    save_checkpoint(state, tmp_path)
    save_checkpoint(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


def test_foreign_or_mismatched_checkpoints_are_refused(tmp_path):
    torch.save({"something": "else"}, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(ValueError, match="not a fed-dp server checkpoint"):
        load_checkpoint(tmp_path)
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    save_checkpoint(state, tmp_path)
    other = init_server(CONFIG.replace(noise_multiplier=2.0), make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    with pytest.raises(ValueError, match="configuration"):
        resume(other, tmp_path)
