"""Issue 38 item 2: the seeds' fine-tuning settings as built-in tasks (fed_dp.simulations.tasks.hf), run through
`fed-dp simulate` on tiny files in the datasets' real formats, with tiny architectures (task.layers/hidden/heads),
offline. Trainable counts are checked against the architecture's own formula, never against the code's output."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import data_fixtures  # noqa: E402

from fed_dp.clients.task import frozen_parameters, trainable_parameters  # noqa: E402
from fed_dp.simulations.cli import main  # noqa: E402
from fed_dp.simulations.experiments.runner import read_results  # noqa: E402
from fed_dp.simulations.tasks import hf as hf_tasks  # noqa: E402

TINY = ["task.layers=2", "task.hidden=16", "task.heads=2"]


def _bert_block(h: int, i: int) -> int:
    """One BERT layer: Q, K, V, attention output (h×h + h each), intermediate (h×i + i), output (i×h + h), 2
    LayerNorms (2h each)."""
    return 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h


@pytest.mark.parametrize("config, data, trainable", [
    ("hf-snli", "snli", _bert_block(16, 64) + (16 * 16 + 16) + (16 * 3 + 3)),  # last block, pooler, 3-way classifier
    ("hf-qnli", "qnli", _bert_block(16, 64) + (16 * 16 + 16) + (16 * 2 + 2)),
    ("hf-e2e", "e2e", 2 * (4 * 16 + 4 * 48)),  # LoRA r=4 on c_attn (16 → 48) of each of the 2 layers
    ("hf-ptb", "ptb", None),  # every parameter
    ("hf-tinybert", "ptb", None),
])
def test_fed_dp_simulate_runs_each_fine_tuning_config_with_its_trainable_count(config, data, trainable, tmp_path):
    root = data_fixtures.write(data, tmp_path / "data")
    sets = [f"task.root={root}", *TINY, "task.users=3", "privacy.rounds=2", "privacy.expected-cohort=2",
            "run.eval-every=2", 'run.optimizers=["dp-adam"]']
    with pytest.warns(UserWarning, match="task.pretrained is not set, so the model is built from the .* architecture "
                      "with fresh weights"):
        code = main(["simulate", "--config", config, *[a for s in sets for a in ("--set", s)],
                     "--out", str(tmp_path / "out"), "--quiet", "--no-plot"])
    assert code == 0
    records = read_results(tmp_path / "out")["dp-adam"]
    assert [r["round"] for r in records] == [0, 1, 2] and "eval_loss" in records[-1]
    task_line = json.loads((tmp_path / "out" / "config.json").read_text())["resolved"]["task"]
    counted = int(task_line.split(" of ")[0].split("(")[-1].replace(",", ""))
    if trainable is not None:
        assert counted == trainable, task_line
    else:
        assert f"({counted:,} of {counted:,} parameters trainable)" in task_line


def test_a_pretrained_folder_is_loaded_and_its_frozen_weights_are_kept(tmp_path):
    """task.pretrained = a save_pretrained folder: the classifier's frozen weights are the saved ones, bit for bit;
    no warning. A folder that holds no model is a clear error."""
    root = data_fixtures.write("snli", tmp_path / "data")
    config = transformers.BertConfig(vocab_size=200, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, pad_token_id=0)
    torch.manual_seed(0)
    saved = transformers.BertModel(config)
    saved.save_pretrained(tmp_path / "bert")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fresh weights" warning
        task = hf_tasks.snli_task(root=str(root), pretrained=str(tmp_path / "bert"), users=3)
    model = task.build_model()
    frozen = frozen_parameters(model)
    assert torch.equal(frozen["model.bert.embeddings.word_embeddings.weight"], saved.embeddings.word_embeddings.weight)
    assert torch.equal(frozen["model.bert.encoder.layer.0.attention.self.query.weight"],
                       saved.encoder.layer[0].attention.self.query.weight)
    assert sum(p.numel() for p in trainable_parameters(model).values()) == \
        _bert_block(16, 64) + (16 * 16 + 16) + (16 * 3 + 3)
    with pytest.raises(ValueError, match="task.pretrained = .*no model could be loaded from it"):
        hf_tasks.snli_task(root=str(root), pretrained=str(tmp_path / "nothing-here"), users=3)


def test_bert_base_with_the_seeds_freezing_trains_the_last_block_pooler_and_classifier_at_full_size():
    """The seeds' count at bert-base's real size (built on the meta device: shapes only, no memory): the last of 12
    blocks, the pooler and a 3-way classifier, 7,680,771 of 109,484,547 with BERT's 30,522-token vocabulary."""
    from fed_dp.clients import hf

    family, sizes = hf_tasks.ARCHITECTURES["bert-base"]
    config = transformers.BertConfig(vocab_size=30522, num_labels=3, **sizes)
    with torch.device("meta"):
        model = hf.transformer(config, "sequence-classification",
                               trainable=[r"encoder\.layer\.11\.", r"pooler\.", r"classifier\."])
    trained, total = hf.trainable_count(model)
    assert family == "bert" and trained == _bert_block(768, 3072) + (768 * 768 + 768) + (768 * 3 + 3) == 7_680_771
    embeddings = 30522 * 768 + 512 * 768 + 2 * 768 + 2 * 768  # words, positions, token types, LayerNorm
    assert total == embeddings + 12 * _bert_block(768, 3072) + (768 * 768 + 768) + (768 * 3 + 3) == 109_484_547
