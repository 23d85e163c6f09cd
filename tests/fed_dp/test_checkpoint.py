"""Checkpoints: atomic, exact resume (same final model, continued ledger, no reused noise), refusals, and the
split into a publishable part and a secret part (noise, sampler) written with owner-only permissions."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from fed_dp.checkpoint import COMMIT_NAME, load_checkpoint, load_secret, resume, save_checkpoint
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


def test_write_is_atomic_and_leaves_only_the_committed_round(tmp_path):
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    save_checkpoint(state, tmp_path)
    state, _ = _round(state)
    save_checkpoint(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([COMMIT_NAME, "checkpoint-000001.pt", "secret"])
    assert sorted(p.name for p in (tmp_path / "secret").iterdir()) == ["noise-000001.pt"]
    assert json.loads((tmp_path / COMMIT_NAME).read_text())["round"] == 1


def test_the_secret_part_is_owner_only_and_holds_everything_that_reproduces_noise_or_cohorts(tmp_path):
    state = init_server(CONFIG, make_optimizer("dp-adam", lr=0.1), torch.zeros(DIM), seed=5)
    state, _ = _round(state)
    save_checkpoint(state, tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "secret" / "noise-000001.pt").st_mode) == 0o600
    public = load_checkpoint(tmp_path)["state"]
    assert set(public) == {"round", "params", "opt_state", "ledger", "clip_norm"}
    assert all(set(r) == {"round", "epsilon"} for r in public["ledger"]["records"])  # no cohort sizes
    secret = load_secret(tmp_path)
    assert {"privatizer", "sampler"} <= set(secret)
    # whoever holds the secret part draws the very noise the server draws next (what the README warns about)
    holder = init_server(CONFIG, make_optimizer("dp-adam", lr=0.1), torch.zeros(DIM))
    holder.privatizer.load_state_dict(secret["privatizer"])
    assert torch.equal(holder.privatizer.next_noise(), state.privatizer.next_noise())


def test_foreign_or_mismatched_checkpoints_are_refused(tmp_path):
    (tmp_path / COMMIT_NAME).write_text(json.dumps({"something": "else"}))
    with pytest.raises(ValueError, match="not a fed-dp checkpoint record"):
        load_checkpoint(tmp_path)
    (tmp_path / COMMIT_NAME).unlink()
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    save_checkpoint(state, tmp_path)
    other = init_server(CONFIG.replace(noise_multiplier=2.0), make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    with pytest.raises(ValueError, match="configuration"):
        resume(other, tmp_path)


def test_public_and_secret_parts_of_different_rounds_are_refused(tmp_path):
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    state, _ = _round(state)
    with pytest.raises(ValueError, match="not written together"):
        state.load_state_dict(state.state_dict(), {**state.secret_state_dict(), "round": 0})


def _two_rounds_saved(folder):
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    for _ in range(2):
        state, _ = _round(state)
        save_checkpoint(state, folder)
    return init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)


@pytest.mark.parametrize("part", ["checkpoint-000002.pt", "secret/noise-000002.pt"])
@pytest.mark.parametrize("damage", ["flip one bit", "truncate"])
def test_a_damaged_or_truncated_part_is_refused_naming_the_file(tmp_path, part, damage):
    """Issue 25 item 8: on main a part with one flipped bit loaded (torch does not check the zip's CRC) and a
    truncated one failed with an OSError or EOFError naming no file. checkpoint.json now records each part's
    SHA-256, checked on load."""
    fresh = _two_rounds_saved(tmp_path)
    data = bytearray((tmp_path / part).read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    (tmp_path / part).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{tmp_path / part} is damaged or truncated: .*Restore it from a backup"):
        resume(fresh, tmp_path)
    (tmp_path / part).unlink()
    with pytest.raises(ValueError, match=rf"{tmp_path / part} is missing"):
        resume(fresh, tmp_path)


def test_checkpoint_files_without_their_record_refuse_to_start(tmp_path):
    """Issue 25 item 8: on main a folder whose checkpoint.json was lost started again from round 0, spending the
    budget again. Files of a committed round without the record now refuse to start, naming them; only the
    parts of round 1 alone (a crash before the first commit: nothing released) start afresh."""
    fresh = _two_rounds_saved(tmp_path)
    (tmp_path / COMMIT_NAME).unlink()
    with pytest.raises(ValueError, match=r"checkpoint-000002.pt, noise-000002.pt\) but no checkpoint.json"):
        resume(fresh, tmp_path)
    first = tmp_path / "first"
    state, _ = _round(init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1))
    save_checkpoint(state, first)
    (first / COMMIT_NAME).unlink()
    assert resume(fresh, first) is None and fresh.round == 0


def test_stale_temporary_files_are_removed_when_a_run_starts(tmp_path):
    """Issue 25 item 8: an interrupted atomic write leaves <name>.<random>.tmp (a whole model, a noise state);
    on main nothing removed them. A resume removes those of the checkpoint's files, and no other file."""
    fresh = _two_rounds_saved(tmp_path)
    stale = [tmp_path / "checkpoint-000003.pt.k2j3.tmp", tmp_path / "checkpoint.json.a1b2.tmp",
             tmp_path / "results.json.zz.tmp", tmp_path / "secret" / "noise-000003.pt.x9y8.tmp"]
    kept = tmp_path / "notes.tmp"
    for path in [*stale, kept]:
        path.write_bytes(b"partial")
    assert resume(fresh, tmp_path) == {} and fresh.round == 2
    assert not any(path.exists() for path in stale) and kept.exists()


def test_a_checkpoint_of_the_version_that_numbered_rounds_from_0_is_refused_saying_why(tmp_path):
    """Version 3 numbered the records and the ledger from 0; resuming it would mix the two numberings, so it is
    refused with the reason and what to do, never read as a foreign file or started afresh."""
    state = init_server(CONFIG, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    state, _ = _round(state)
    save_checkpoint(state, tmp_path)
    commit = json.loads((tmp_path / COMMIT_NAME).read_text())
    (tmp_path / COMMIT_NAME).write_text(json.dumps({**commit, "version": 3}))
    with pytest.raises(ValueError, match=r"older fed-dp \(checkpoint version 3\).*number rounds from 0.*1 … T.*"
                                         r"Finish that run with the fed-dp version that started it"):
        load_checkpoint(tmp_path)
