"""Issue 38 item 2: Hugging Face models and peft adapters as a task's model (fed_dp.clients.hf), offline, from tiny
configs. Oracles: transformers' own losses (the model's ``.loss`` for given labels), peft's own choice of trainable
parameters, and the saved folder's weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from fed_dp.clients import hf, losses  # noqa: E402
from fed_dp.clients.task import Users, frozen_parameters, initial_model, trainable_parameters  # noqa: E402
from fed_dp.config import LocalTraining, PrivacyConfig  # noqa: E402
from fed_dp.simulations.engine.inprocess import train  # noqa: E402

GPT2 = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                               eos_token_id=0)
BERT = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=16, num_labels=3, pad_token_id=0)


def _lora() -> object:
    return peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)


def test_causal_lm_loss_is_transformers_own_and_lora_trains_only_the_adapter():
    model = hf.transformer(GPT2, "causal-lm", peft_config=_lora(), init_seed=0)
    lora = [n for n, p in model.named_parameters() if "lora_" in n]
    assert list(trainable_parameters(model)) == lora and len(lora) == 4  # A and B of 2 layers
    tokens = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
        got = losses.next_token(model, (tokens, torch.ones(3, 10)))
    torch.testing.assert_close(got, expected)


def test_sequence_classification_loss_padding_and_trainable_patterns():
    model = hf.transformer(BERT, "sequence-classification", trainable=[r"encoder\.layer\.1\.", r"pooler", r"classifier"],
                           pad_token_id=0, init_seed=0).eval()
    names = list(trainable_parameters(model))
    assert names and all(n.startswith(("model.bert.encoder.layer.1.", "model.bert.pooler", "model.classifier"))
                         for n in names)
    assert "model.bert.embeddings.word_embeddings.weight" in frozen_parameters(model)
    ids = torch.tensor([[2, 5, 7, 4, 9, 4, 0, 0], [2, 6, 4, 8, 8, 4, 0, 0]])
    pairs = torch.stack([ids, (torch.arange(8) >= 4).long().expand(2, 8)], 1)
    labels = torch.tensor([1, 2])
    with torch.no_grad():
        expected = model.model(input_ids=ids, token_type_ids=pairs[:, 1], attention_mask=(ids != 0).long(),
                               labels=labels).loss
        torch.testing.assert_close(losses.classification(model, (pairs, labels)), expected)
        # the attention mask: more padding changes nothing
        longer = torch.cat([pairs, torch.zeros(2, 2, 4, dtype=torch.long)], 2)
        torch.testing.assert_close(model(longer), model(pairs), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"trainable patterns \['nothing'\] match no parameter"):
        hf.transformer(BERT, "sequence-classification", trainable=["nothing"])
    with pytest.raises(ValueError, match="head must be one of causal-lm, sequence-classification"):
        hf.transformer(BERT, "masked-lm")


def _lm_task():
    g = torch.Generator().manual_seed(1)
    users = Users.in_memory([(torch.randint(0, 40, (4, 12), generator=g), torch.ones(4, 12)) for _ in range(10)])
    held = (torch.randint(0, 40, (8, 12), generator=g), torch.ones(8, 12))
    return hf.hf_task(model=lambda: hf.transformer(GPT2, "causal-lm", peft_config=_lora(), init_seed=0),
                      head="causal-lm", users=users, held_out=held)


@pytest.mark.parametrize("training, local", [
    ("auto", LocalTraining(epochs=1, batch_size=4, lr=0.5)),          # one full-batch step: the one-step path
    ("sequential", LocalTraining(epochs=1, batch_size=4, lr=0.5)),
    ("vectorized", LocalTraining(epochs=1, batch_size=4, lr=0.5)),
], ids=["one-step", "sequential", "vectorized"])
def test_lora_gpt2_trains_its_adapter_on_every_path_and_the_base_comes_back_bit_identical(training, local):
    task = _lm_task()
    privacy = PrivacyConfig(expected_cohort=4, rounds=2, noise_multiplier=0.5, delta=1e-5, accountant="rdp")
    result = train(task, privacy, "dp-adam", local, seed=2, training=training, device="cpu")
    initial = initial_model(task, 2)[0]
    assert result.params.numel() == sum(p.numel() for p in trainable_parameters(initial).values()) == 2 * 2 * (16 + 48)
    assert all(torch.equal(p, q) for p, q in zip(frozen_parameters(result.model).values(),
                                                   frozen_parameters(initial).values()))
    assert "eval_perplexity" in result.records[-1]
    path = {"auto": "one_step", "vectorized": "vectorized"}.get(training)
    if path:
        assert all(r[f"nonprivate_{path}"] == 1.0 for r in result.records if r["round"] > 0)
    reference = train(task, privacy, "dp-adam", local, seed=2, training="sequential", device="cpu")
    torch.testing.assert_close(result.params, reference.params, rtol=1e-4, atol=1e-5)
