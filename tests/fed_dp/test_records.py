"""The record keys a run writes are the documented ones (fed_dp.records), rounds are numbered 0 (the initial
model's evaluation), 1 … T, and results.json holds only the public keys."""

import json
from pathlib import Path

import pytest

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.records import PUBLIC, RECORD_KEYS, SECRET_PREFIX, RecordKey, documented, markdown_table
from fed_dp.simulations.engine.inprocess import train
from fed_dp.simulations.tasks.builtin import heavy_tail_task


PRIVACY = PrivacyConfig(expected_cohort=10, rounds=3, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
LOCAL = LocalTraining(batch_size=2, lr=0.5)


@pytest.mark.parametrize("optimizer, adaptive", [("dp-adambc", None), ("dp-adam-ime", None),
                                                 ("dp-fedavg", AdaptiveClipConfig(bit_noise_std=1.0, initial_clip_norm=1.0))])
def test_every_key_a_run_writes_is_documented_and_the_always_present_ones_are_there(optimizer, adaptive, tmp_path):
    result = train(heavy_tail_task(), PRIVACY, optimizer, LOCAL, adaptive_clipping=adaptive, seed=0, eval_every=2, device="cpu",
                   checkpoint_dir=str(tmp_path))
    assert [r["round"] for r in result.records] == [0, 1, 2, 3]  # 0: the initial model, then the releases 1 … T
    assert result.records[0]["epsilon"] == 0.0 and "eval_accuracy" in result.records[0]
    assert ["eval_accuracy" in r for r in result.records] == [True, False, True, True]  # 0, t % 2 == 0, the last
    assert any(key.startswith("group") for key in result.records[0])  # per frequency group: documented as group*
    undocumented = {key for record in result.records for key in record if documented(key) is None}
    assert not undocumented
    for record in result.records:
        for entry in RECORD_KEYS:
            if entry.when == "always" or (entry.when == "every released round" and record["round"] > 0):
                assert entry.record_name in record, (entry.name, record["round"])
    if adaptive is not None:
        assert all("next_clip_norm" in r for r in result.records[1:])
    published = json.loads((tmp_path / "results.json").read_text())
    assert [r["round"] for r in published] == [0, 1, 2, 3]
    assert all(documented(key).part == PUBLIC for record in published for key in record)
    diagnostics = [json.loads(line) for line in (tmp_path / "secret" / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["round"] for d in diagnostics] == [1, 2, 3]
    assert all(documented(SECRET_PREFIX + key) is not None for d in diagnostics for key in d if key != "round")


def test_the_table_lists_every_key_once_with_its_part():
    table = markdown_table().splitlines()
    assert len(table) == 2 + len(RECORD_KEYS)
    assert all(line.replace("\\|", "").count("|") == 5 for line in table)  # four cells: |S_t| is escaped
    assert len({entry.name for entry in RECORD_KEYS}) == len(RECORD_KEYS)
    assert "| `train_loss` (`nonprivate_train_loss` in a simulation) |" in markdown_table()


def test_a_key_part_other_than_public_or_secret_is_refused():
    with pytest.raises(ValueError, match="part must be 'public' or 'secret'"):
        RecordKey("x", "y", "hidden")


def test_the_docs_page_shows_the_generated_table():
    """docs/reference/records.md holds markdown_table() verbatim: the table of keys is never written by hand."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "records.md").read_text()
    assert markdown_table() in page
