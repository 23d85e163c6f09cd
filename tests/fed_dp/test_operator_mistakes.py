"""An operator's bad day (issue 40, item 13): damaged files of a checkpoint folder, a full disk, and values that
cannot work — each a clear error naming the file or the value and what to do (a ValueError before round 1 for
configuration), or a run that works; none returns as if done having released nothing. Runs of the round loop on a
tiny state with a trivial exchange (what it exchanges does not matter here)."""

from __future__ import annotations

import errno
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from fed_dp import atomic
from fed_dp.accounting import LONG_ROUNDS, accounting_note, epsilon_schedule
from fed_dp.checkpoint import COMMIT_NAME, DIAGNOSTICS_NAME, PUBLISHED_NAME, SECRET_FOLDER, load_checkpoint, read_diagnostics
from fed_dp.config import PrivacyConfig
from fed_dp.contribution import Contribution
from fed_dp.optimizers import make_optimizer
from fed_dp.round import init_server
from fed_dp.round_loop import CheckpointWriteError, RoundReplies, run_rounds

CONFIG = PrivacyConfig(num_users=20, expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-4, accountant="rdp")
DIM = 4


def _exchange(plan):
    return RoundReplies([Contribution(torch.ones(DIM) * 0.1, plan.cohort.numel())])


def _run(folder: Path | None, rounds: int | None = None, config: PrivacyConfig = CONFIG, handed: list | None = None,
         on_phase=None):
    """The loop on ``folder``; every record handed out is appended to ``handed``."""
    state = init_server(config, make_optimizer("dp-sgd"), torch.zeros(DIM), seed=1)
    on_round = handed.append if handed is not None else None
    return run_rounds(state, _exchange, rounds=rounds, checkpoint_dir=folder, on_round=on_round, on_phase=on_phase)


def _diagnostics(folder: Path) -> Path:
    return folder / SECRET_FOLDER / DIAGNOSTICS_NAME


# --- damaged files of the folder -----------------------------------------------------------------------------


def test_a_truncated_published_json_blocks_the_resume_naming_the_file_and_what_to_do(tmp_path):
    """On main: a bare JSONDecodeError naming no file."""
    _run(tmp_path, rounds=2)
    published = tmp_path / PUBLISHED_NAME
    published.write_text(published.read_text()[:20])
    with pytest.raises(ValueError, match=f"{published} is damaged .*delete it to resume: the last committed round is "
                                         "then evaluated and handed out again"):
        _run(tmp_path)
    published.unlink()  # what the message says to do
    handed: list = []
    done = _run(tmp_path, handed=handed)
    assert [r["round"] for r in handed] == [2, 3] and [r["round"] for r in done.records] == [1, 2, 3]


def test_a_damaged_checkpoint_record_says_restore_it_never_start_afresh(tmp_path):
    _run(tmp_path, rounds=1)
    (tmp_path / COMMIT_NAME).write_text('{"format": "fed-dp/ser')
    with pytest.raises(ValueError, match="checkpoint.json is damaged .*Restore it from a backup of the folder; do not "
                                         "start afresh"):
        _run(tmp_path)


def test_a_torn_last_line_of_the_diagnostics_is_cut_off_and_the_run_resumes(tmp_path, caplog):
    """A process killed while appending leaves a line without its end (on main: a bare JSONDecodeError at the
    resume). It is cut off, with a warning naming the file, and the rounds go on."""
    _run(tmp_path, rounds=2)
    diagnostics = _diagnostics(tmp_path)
    with open(diagnostics, "a") as handle:
        handle.write('{"round": 3, "cohort_si')
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        _run(tmp_path)
    assert f"{diagnostics} ended with a torn line" in caplog.text
    assert diagnostics.read_text().endswith("\n")
    assert [record["round"] for record in read_diagnostics(tmp_path)] == [1, 2, 3]


def test_a_damaged_line_inside_the_diagnostics_is_an_error_naming_the_file_and_line(tmp_path):
    _run(tmp_path, rounds=2)
    diagnostics = _diagnostics(tmp_path)
    lines = diagnostics.read_text().splitlines()
    diagnostics.write_text("\n".join([lines[0], "#garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=f"{diagnostics}, line 2, is not a JSON record of a round.*move it aside"):
        _run(tmp_path)


# --- a full disk -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_after_a_commit_stops_the_run_saying_so_and_the_round_is_handed_out_on_resume(tmp_path):
    """The diagnostics file moves to a full device once round 2 is under way (after the resume has read it): the
    kernel's own ENOSPC on the real append (on main: a traceback)."""
    _run(tmp_path, rounds=1)
    diagnostics = _diagnostics(tmp_path)
    kept = diagnostics.read_text()

    def disk_fills(phase, round_number):
        if (phase, round_number) == ("sampled", 2):
            diagnostics.unlink()
            diagnostics.symlink_to("/dev/full")

    handed: list = []
    with pytest.raises(CheckpointWriteError) as stopped:
        _run(tmp_path, handed=handed, on_phase=disk_fills)
    assert stopped.value.errno == errno.ENOSPC and isinstance(stopped.value, OSError)
    assert f"could not write {tmp_path}" in str(stopped.value) and "No space left on device" in str(stopped.value)
    assert "round 2 is committed, but its diagnostics were not written; it is handed out when the run resumes" \
        in str(stopped.value) and "start the run again with the same checkpoint folder" in str(stopped.value)
    assert handed == [] and load_checkpoint(tmp_path)["state"]["round"] == 2
    diagnostics.unlink()
    diagnostics.write_text(kept)  # space freed
    done = _run(tmp_path, handed=handed)
    assert [r["round"] for r in handed] == [2, 3] and [r["round"] for r in done.records] == [1, 2, 3]
    assert [record["round"] for record in read_diagnostics(tmp_path)] == [1, 2, 3]


def test_a_full_disk_while_saving_a_round_releases_nothing_of_it_and_the_run_resumes(tmp_path, monkeypatch):
    """The disk fills while round 2's checkpoint is written (the ENOSPC that fsync reports on a full disk,
    injected): the run stops with CheckpointWriteError, round 2 is neither committed nor handed out."""
    _run(tmp_path, rounds=1)
    real_fsync = atomic.os.fsync

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    handed: list = []
    with pytest.raises(CheckpointWriteError, match="round 2 could not be saved, so nothing of it was released"):
        _run(tmp_path, handed=handed)
    monkeypatch.setattr(atomic.os, "fsync", real_fsync)
    assert handed == [] and load_checkpoint(tmp_path)["state"]["round"] == 1
    assert not list(tmp_path.glob("*.tmp")) and not list((tmp_path / SECRET_FOLDER).glob("*.tmp"))
    done = _run(tmp_path, handed=handed)
    assert [r["round"] for r in handed] == [2, 3] and json.loads((tmp_path / "results.json").read_text())[-1]["round"] == 3
    assert done.state.ledger.rounds == 3


# --- values that cannot work: ValueError before round 1, naming the key and what to do ------------------------


@pytest.mark.parametrize("clip_norm, dtype", [(1e300, torch.float32), (1e20, torch.float32), (1e300, torch.float64)])
def test_a_clip_norm_that_overflows_the_model_is_refused_before_round_1(clip_norm, dtype):
    """On main ζ = 1e300 failed in round 1 on "noise std must be a number in (2^-900, 2^900)", and ζ = 1e20 (float32)
    with an adaptive optimizer on "release.noise_variance must be finite", naming neither the clip norm nor a fix."""
    with pytest.raises(ValueError, match=rf"clip_norm ζ = {re.escape(f'{clip_norm:g}')} \(privacy.clip-norm\) is too large for this "
                                         rf"run's {dtype} model.*near the norms of users' updates"):
        init_server(CONFIG.replace(clip_norm=clip_norm), make_optimizer("dp-adam"), torch.zeros(DIM, dtype=dtype))


def test_large_but_representable_clip_norms_and_tiny_noise_still_run():
    init_server(CONFIG.replace(clip_norm=1e20), make_optimizer("dp-adam"), torch.zeros(DIM, dtype=torch.float64))
    init_server(CONFIG.replace(clip_norm=1e6, noise_multiplier=1e-18), make_optimizer("dp-adam"), torch.zeros(DIM))
    with pytest.raises(ValueError, match=r"noise std σζ = 1e-300 × 1e-10 .* outside the range the noise can be drawn"):
        init_server(CONFIG.replace(clip_norm=1e-10, noise_multiplier=1e-300), make_optimizer("dp-sgd"), torch.zeros(DIM))


def test_an_epsilon_budget_below_the_first_round_is_a_value_error_before_round_1(tmp_path):
    """On main the run released nothing, returned normally with ``stopped`` set, and fed-dp simulate exited 0."""
    first = epsilon_schedule(CONFIG).at(1)
    with pytest.raises(ValueError, match=r"epsilon_budget \(privacy.epsilon-budget\) = 0.01 is below epsilon after "
                                         rf"round 1 \({first:.4g} at delta"):
        _run(tmp_path, config=CONFIG.replace(epsilon_budget=0.01))
    assert not (tmp_path / COMMIT_NAME).exists()
    assert _run(None, config=CONFIG.replace(epsilon_budget=first * 1.01)).stopped is not None  # one round, then stop


def test_a_plan_whose_schedule_cannot_fit_in_memory_is_refused_at_once_and_a_long_one_is_announced():
    """rounds = 10⁹: on main nothing was printed for minutes while one ε per round was computed (37 GB, hours)."""
    with pytest.raises(ValueError, match=r"rounds \(privacy.rounds\) = 1,000,000,000: .* 37 GB for this plan"):
        epsilon_schedule(CONFIG.replace(rounds=10**9))
    assert accounting_note(LONG_ROUNDS, "rdp") == (
        f"accounting {LONG_ROUNDS:,} rounds with rdp can take minutes")
    assert accounting_note(CONFIG.rounds, CONFIG.accountant) is None
    with pytest.warns(DeprecationWarning, match="accounting_note"):  # the config it took before, still accepted
        assert accounting_note(CONFIG.replace(rounds=LONG_ROUNDS)) == (
            f"accounting {LONG_ROUNDS:,} rounds with rdp can take minutes")
    with pytest.warns(DeprecationWarning, match="accounting_note"):
        assert accounting_note(CONFIG) is None


def test_a_noise_multiplier_that_protects_nobody_is_warned_about_naming_it(caplog):
    """σ = 1e-30 is a valid σ (tests use tiny ones for near-noiseless runs), but on main it ran without a word at
    ε = 1e60."""
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        _run(None, rounds=1, config=CONFIG.replace(noise_multiplier=1e-30))
    assert "noise_multiplier σ = 1e-30 (privacy.noise-multiplier) gives a user-level epsilon of" in caplog.text
    assert "protects nobody" in caplog.text and "set σ = 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fed_dp.server"):
        _run(None, rounds=1)
    assert "protects nobody" not in caplog.text


def test_a_seed_beyond_64_bits_is_a_value_error_naming_it_wherever_it_is_given(monkeypatch):
    """On main run.seed = 10²⁰ failed in torch with "Overflow when unpacking long long"."""
    from fed_dp.run_config import RunConfig
    from fed_dp.server.app import SERVER_SEED_VARIABLE, server_seed
    from fed_dp.server.flower_strategy import UserLevelDP
    from fed_dp.simulations.engine.inprocess import train
    from fed_dp.simulations.tasks.builtin import heavy_tail_task

    big = 10**20
    with pytest.raises(ValueError, match=f"run.seed must be an integer >= 0 and <= 2\\^63 − 1 = {2**63 - 1}.*{big}"):
        RunConfig.from_flat({"run.seed": big})
    with pytest.raises(ValueError, match="training_seed must be an integer >= 0 and <= 2\\^63"):
        train(heavy_tail_task(), CONFIG, training_seed=big)
    with pytest.raises(ValueError, match="seed must be an integer >= 0 and <= 2\\^63"):
        UserLevelDP(CONFIG, seed=big)
    with pytest.raises(ValueError, match=f"{SERVER_SEED_VARIABLE} must be an integer >= 0 and <= 2\\^63"):
        server_seed({SERVER_SEED_VARIABLE: str(big)})
    assert RunConfig.from_flat({"run.seed": 2**63 - 1}).run.seed == 2**63 - 1
