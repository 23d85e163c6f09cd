"""The tokenizer built from training text and the tensors text models train on."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fed_dp.simulations.tasks.text import SPECIALS, Vocabulary, pad, target_mask, windows, words


def test_words_lower_cases_and_splits_punctuation():
    assert words("Two dogs, running.") == ["two", "dogs", ",", "running", "."]
    assert words("name[The Vaults], £30") == ["name", "[", "the", "vaults", "]", ",", "£", "30"]
    assert words("snake_case it's") == ["snake", "_", "case", "it", "'", "s"]


def test_vocabulary_keeps_the_most_frequent_tokens_after_the_specials_with_ties_by_token():
    vocabulary = Vocabulary.build([["b", "a", "c", "a"], ["c", "d", "a"]], size=3)
    assert vocabulary.tokens == SPECIALS + ("a", "c", "b")  # a: 3, then b, c, d: c has 2, b and d 1 (b < d)
    assert vocabulary.encode(["a", "d", "zzz"]) == [5, 1, 1]  # unknown tokens are <unk> = 1
    assert vocabulary.decode([5, 6]) == ["a", "c"] and vocabulary.id("<pad>") == 0
    assert Vocabulary.from_counts(Counter({"x": 2, "<unk>": 9})).tokens == SPECIALS + ("x",)
    assert len(Vocabulary.build([["a"]])) == len(SPECIALS) + 1
    with pytest.raises(ValueError, match="vocabulary size"):
        Vocabulary.build([["a"]], size=0)


def test_pad_cuts_and_pads_with_zero():
    assert pad([[3, 4, 5], [6], []], 2).tolist() == [[3, 4], [6, 0], [0, 0]]
    with pytest.raises(ValueError, match="length"):
        pad([[1]], 0)


def test_windows_predict_every_token_after_the_first_exactly_once():
    stream = list(range(5, 15))  # 10 tokens
    rows = windows(stream, 4)
    assert rows.tolist() == [[5, 6, 7, 8], [8, 9, 10, 11], [11, 12, 13, 14]]
    targets = rows[:, 1:][target_mask(rows)[:, 1:] > 0]
    assert targets.tolist() == stream[1:]
    short = windows(stream[:6], 4)  # the tail is padded, and the padding is masked out
    assert short.tolist() == [[5, 6, 7, 8], [8, 9, 10, 0]]
    assert short[:, 1:][target_mask(short)[:, 1:] > 0].tolist() == stream[1:6]
    assert windows([7], 4).shape == (0, 4)


def test_target_mask_per_row_start_and_padding():
    tokens = torch.tensor([[2, 9, 4, 7, 3], [2, 8, 4, 3, 0]])
    mask = target_mask(tokens, torch.tensor([3, 2]))
    assert mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 0]]
    assert mask.dtype == torch.float32
