"""A simple tokenizer built from a task's training files, and the tensors text models train on.

Nothing is downloaded: a :class:`Vocabulary` is the ``size`` most frequent tokens of the *training* split
(ties broken alphabetically, so it is deterministic), after the special tokens; everything else maps to
``<unk>``. Tokens are words (:func:`words`: lower-cased runs of letters/digits, and single punctuation
marks) or characters (LEAF Shakespeare), or already tokenized text split on spaces (Penn Treebank,
StackOverflow's ``tokens`` field).

Tensors:

* :func:`pad` -- variable-length id lists as one (n, length) int64 tensor, right-padded with ``<pad>`` = 0
  (longer lists are cut at ``length``);
* :func:`windows` -- a token stream cut into (n, length) rows that overlap by one token, so that the
  next-token loss predicts every token of the stream after the first exactly once;
* :func:`target_mask` -- which tokens of padded rows are next-token *targets* (a float (n, length) mask
  for ``fed_dp.losses.next_token``'s ``(tokens, mask)`` batches).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PAD", "SPECIALS", "UNK", "Vocabulary", "pad", "target_mask", "windows", "words"]

PAD, UNK, BOS, EOS, SEP = "<pad>", "<unk>", "<bos>", "<eos>", "<sep>"
#: Special tokens, with ids 0..4 in every vocabulary (``<pad>`` is 0).
SPECIALS: tuple[str, ...] = (PAD, UNK, BOS, EOS, SEP)

_WORD = re.compile(r"[^\W_]+|[^\w\s]|_", re.UNICODE)


def words(text: str) -> list[str]:
    """``text`` lower-cased and split into words (runs of letters and digits) and single punctuation marks:
    ``"Two dogs, running."`` → ``["two", "dogs", ",", "running", "."]``."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Vocabulary:
    """Token ↔ id: the special tokens first (``<pad>`` = 0, ``<unk>`` = 1, ``<bos>``, ``<eos>``, ``<sep>``),
    then the kept tokens, most frequent first."""

    tokens: tuple[str, ...]
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens[: len(SPECIALS)] != SPECIALS:
            raise ValueError(f"a vocabulary starts with the special tokens {SPECIALS}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("vocabulary tokens must be distinct")
        object.__setattr__(self, "_ids", {token: i for i, token in enumerate(self.tokens)})

    @classmethod
    def from_counts(cls, counts: Counter | Iterable[tuple[str, int]], size: int | None = None) -> "Vocabulary":
        """The ``size`` most frequent tokens of ``counts`` (all when None) after the specials; ties by token."""
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"vocabulary size must be an integer >= 1 (or None: every token), got {size!r}")
        items = counts.items() if isinstance(counts, Counter) else counts
        ranked = sorted(((t, int(c)) for t, c in items if t not in SPECIALS), key=lambda tc: (-tc[1], tc[0]))
        return cls(SPECIALS + tuple(t for t, _ in ranked[:size]))

    @classmethod
    def build(cls, texts: Iterable[Sequence[str]], size: int | None = None) -> "Vocabulary":
        """The vocabulary of tokenized training texts (each a sequence of tokens)."""
        counts: Counter = Counter()
        for tokens in texts:
            counts.update(tokens)
        return cls.from_counts(counts, size)

    def __len__(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self._ids.get(token, 1)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens``; unknown tokens are ``<unk>`` (1)."""
        ids = self._ids
        return [ids.get(t, 1) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.tokens[int(i)] for i in ids]


def pad(sequences: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    """(n, length) int64: each id list left-aligned, cut at ``length``, padded with 0 (``<pad>``)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"sequence length must be an integer >= 1, got {length!r}")
    out = torch.zeros((len(sequences), length), dtype=torch.int64)
    for row, ids in enumerate(sequences):
        ids = list(ids)[:length]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def windows(stream: Sequence[int] | torch.Tensor, length: int) -> torch.Tensor:
    """A token stream as (n, length) rows starting every ``length − 1`` tokens, so consecutive rows share one
    token and every token after the first is a next-token target exactly once. A tail shorter than
    ``length`` is padded with 0 (``<pad>``); mask it out with :func:`target_mask`. Empty stream: (0, length)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"window length must be an integer >= 2, got {length!r}")
    ids = torch.as_tensor(stream, dtype=torch.int64)
    if ids.numel() < 2:
        return torch.zeros((0, length), dtype=torch.int64)
    rows = -(-(ids.numel() - 1) // (length - 1))
    padded = torch.zeros(rows * (length - 1) + 1, dtype=torch.int64)
    padded[: ids.numel()] = ids
    return padded.unfold(0, length, length - 1)


def target_mask(tokens: torch.Tensor, first_target: torch.Tensor | int = 1) -> torch.Tensor:
    """Float (n, length): 1 where position j ≥ ``first_target`` (per row, or one int) holds a real token
    (not ``<pad>``), i.e. where the next-token loss should score the prediction of that token."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    start = torch.as_tensor(first_target).reshape(-1, 1) if isinstance(first_target, torch.Tensor) else first_target
    return ((positions >= start) & (tokens != 0)).to(torch.float32)
