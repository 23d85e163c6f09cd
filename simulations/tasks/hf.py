"""The seeds' fine-tuning settings as built-in tasks, on Hugging Face models (``pip install -e ".[hf]"``).

| name | seed | model (default architecture) | trained | data |
|---|---|---|---|---|
| ``hf-snli`` | 001 | BERT sequence classifier (``bert-base``) | the last Transformer block, the pooler, the classifier | SNLI jsonl files |
| ``hf-qnli`` | 004 | the same | the same | GLUE QNLI tsv files |
| ``hf-e2e`` | 003 App. | GPT-2 with LoRA (``gpt2-medium``, r = 4 on ``c_attn``, Yu et al. 2022) | the LoRA matrices | E2E NLG csv files |
| ``hf-ptb`` | 003 App. | GPT-2 (``gpt2``) | everything | Penn Treebank txt files |
| ``hf-tinybert`` | 000 | TinyBERT-size BERT (4 layers, 312 wide) as a causal token predictor | everything | Penn Treebank txt files |
| ``hf-markov`` | — | a small GPT-2 (2 layers, 64 wide), LoRA or full | LoRA (``lora-r`` > 0) or everything | a synthetic Markov language (no files) |

Pretrained weights: ``task.pretrained = PATH``, a local folder written by ``save_pretrained`` (its tokenizer too, when
it has one), or a hub name on a machine with the network. Without it (nothing can be downloaded here) the model is
built from the architecture with fresh weights, initialized from ``task.init-seed`` so that every process builds
the same frozen part, and a warning says so; the text is then tokenized with a word vocabulary of the training split
(``fed_dp.simulations.tasks.text``), and the model's vocabulary is sized to it. ``task.layers``, ``task.hidden`` and
``task.heads`` override the architecture's depth and width (tests and CPU runs use small ones). Every factory logs
and describes its trainable count: the dimension d of the update, the clip and the noise.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fed_dp.clients import hf
from fed_dp.clients.task import Task, Users
from fed_dp.simulations.tasks import datasets, synthetic, text
from fed_dp.simulations.tasks.partitioning import partition
from fed_dp.validation import check_int

log = logging.getLogger("fed_dp.simulations")

__all__ = ["ARCHITECTURES", "Tokens", "e2e_task", "markov_task", "ptb_task", "qnli_task", "snli_task",
           "tinybert_task"]

#: Architecture name → (``transformers`` model type, its config's sizes).
ARCHITECTURES: dict[str, tuple[str, dict[str, int]]] = {
    "bert-base": ("bert", {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                           "intermediate_size": 3072}),
    "tinybert": ("bert", {"num_hidden_layers": 4, "hidden_size": 312, "num_attention_heads": 12,
                          "intermediate_size": 1200}),
    "gpt2": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}),
    "gpt2-medium": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}),
    "gpt2-tiny": ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2}),
}


@dataclass(frozen=True)
class Tokens:
    """A tokenizer as the tasks use it: ``encode(text) -> ids`` and the ids of padding and the special tokens."""

    encode: Callable[[str], list[int]]
    size: int
    pad: int
    bos: int
    sep: int
    eos: int
    source: str


def _words(texts: Sequence[str], size: int | None) -> Tokens:
    vocabulary = text.Vocabulary.build((text.words(t) for t in texts), size)
    ids = {token: vocabulary.id(token) for token in (text.PAD, text.BOS, text.SEP, text.EOS)}
    return Tokens(lambda s: vocabulary.encode(text.words(s)), len(vocabulary), ids[text.PAD], ids[text.BOS],
                  ids[text.SEP], ids[text.EOS], f"a word vocabulary of {len(vocabulary)} from the training split")


def _pretrained_tokens(pretrained: str) -> Tokens | None:
    """The tokenizer saved with a pretrained model (None when the folder has none)."""
    transformers = hf.require()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    except (OSError, ValueError, TypeError):
        return None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else eos
    bos = next((i for i in (tokenizer.cls_token_id, tokenizer.bos_token_id, eos) if i is not None), 0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return Tokens(lambda s: tokenizer(s, add_special_tokens=False)["input_ids"], len(tokenizer), pad, bos, sep,
                  eos if eos is not None else 0, f"the tokenizer of {pretrained}")


def _tokens(pretrained: str | None, texts: Sequence[str], vocab_size: int | None) -> Tokens:
    found = _pretrained_tokens(pretrained) if pretrained else None
    return found if found is not None else _words(texts, vocab_size)


def _source(task: str, pretrained: str | None, architecture: str, tokens: Tokens, *, length: int,
            layers: int | None, hidden: int | None, heads: int | None, num_labels: int | None = None,
            decoder: bool = False) -> Any:
    """``pretrained``, or the architecture's config (sizes overridden, vocabulary sized to ``tokens``), with the
    warning that it has fresh weights."""
    if pretrained:
        return pretrained
    if architecture not in ARCHITECTURES:
        raise ValueError(f"task.architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}")
    warnings.warn(f"{task}: task.pretrained is not set, so the model is built from the {architecture} architecture "
                  "with fresh weights (no pretrained weights can be downloaded here); set task.pretrained = PATH to "
                  "a local save_pretrained folder to fine-tune a pretrained model", stacklevel=3)
    transformers = hf.require()
    family, sizes = ARCHITECTURES[architecture]
    sizes = dict(sizes)
    names = {"bert": ("num_hidden_layers", "hidden_size", "num_attention_heads"),
             "gpt2": ("n_layer", "n_embd", "n_head")}[family]
    for key, value in zip(names, (layers, hidden, heads)):
        if value is not None:
            sizes[key] = check_int(f"task.{key}", value, minimum=1)
    if family == "bert":
        if hidden is not None:
            sizes["intermediate_size"] = 4 * sizes["hidden_size"]
        return transformers.BertConfig(vocab_size=tokens.size, max_position_embeddings=max(512, length),
                                       pad_token_id=tokens.pad, num_labels=num_labels or 2, is_decoder=decoder,
                                       **sizes)
    return transformers.GPT2Config(vocab_size=tokens.size, n_positions=max(1024, length), bos_token_id=tokens.bos,
                                   eos_token_id=tokens.eos, num_labels=num_labels or 2, **sizes)


def _announce(name: str, factory: Callable[[], nn.Module], tokens: Tokens) -> str:
    """Build the model once: its trainable count, logged and returned for the task's description (a bad
    ``task.pretrained``, or one whose vocabulary is smaller than the tokenizer's, fails here, before any round)."""
    model = factory()
    vocabulary = model.model.get_input_embeddings().num_embeddings
    if tokens.size > vocabulary:
        raise ValueError(f"{name}: the model has a vocabulary of {vocabulary} tokens but the text is tokenized with "
                         f"{tokens.source} ({tokens.size} ids): save the model's tokenizer with it in the "
                         "task.pretrained folder (tokenizer.save_pretrained)")
    trained, total = hf.trainable_count(model)
    line = f"{trained:,} of {total:,} parameters trainable"
    log.info("%s: %s", name, line)
    return line


def _users(count: int, users: int, scheme: str, seed: int, exponent: float | None) -> list[torch.Tensor]:
    kwargs = {} if exponent is None else {"exponent": exponent}
    parts = partition(np.zeros(count, dtype=np.int64), users, scheme, seed=seed, **kwargs)
    return [torch.from_numpy(p.astype(np.int64)) for p in parts]


# --- sentence-pair classification: seeds 001 (SNLI) and 004 (QNLI) -------------------------------------------

def _pairs(tokens: Tokens, first: list[str], second: list[str], length: int) -> torch.Tensor:
    """(n, 2, length): ``bos a sep b sep`` ids (each sentence cut to fit) and token types (0 up to the first sep)."""
    half = max(1, (length - 3) // 2)
    ids, types = [], []
    for a, b in zip(first, second):
        left = [tokens.bos, *tokens.encode(a)[:half], tokens.sep]
        right = [*tokens.encode(b)[: length - len(left) - 1], tokens.sep]
        ids.append(left + right)
        types.append([0] * len(left) + [1] * len(right))
    out = torch.stack([text.pad(ids, length), text.pad(types, length)], dim=1)
    if tokens.pad != 0:
        out[:, 0][text.pad([[1] * len(i) for i in ids], length) == 0] = tokens.pad
    return out


def _classifier_task(name: str, data: dict[str, datasets.SentencePairs], held_out: str, classes: int, *,
                     pretrained: str | None, architecture: str, train_last: int, users: int, partition_scheme: str,
                     exponent: float | None, vocab_size: int | None, length: int, seed: int, init_seed: int,
                     layers: int | None, hidden: int | None, heads: int | None) -> Task:
    train_first, train_second, labels = data["train"]
    tokens = _tokens(pretrained, train_first + train_second, vocab_size)
    source = _source(name, pretrained, architecture, tokens, length=length, layers=layers, hidden=hidden,
                     heads=heads, num_labels=classes)
    depth = (hf.pretrained_config(source) if isinstance(source, str) else source).num_hidden_layers
    train_last = check_int("task.train-last", train_last, minimum=0)
    blocks = [rf"encoder\.layer\.{i}\." for i in range(max(0, depth - train_last), depth)]

    def model() -> nn.Module:
        return hf.transformer(source, "sequence-classification", trainable=[*blocks, r"pooler\.", r"classifier\."],
                              pad_token_id=tokens.pad, init_seed=init_seed,
                              **({"num_labels": classes} if isinstance(source, str) else {}))

    x, y = _pairs(tokens, train_first, train_second, length), torch.tensor(labels, dtype=torch.int64)
    first, second, held_labels = data[held_out]
    parts = _users(len(y), users, partition_scheme, seed, exponent)
    counted = _announce(name, model, tokens)
    return hf.hf_task(model=model, head="sequence-classification", name=name,
                      users=Users.in_memory([(x[p], y[p]) for p in parts]),
                      held_out=(_pairs(tokens, first, second, length), torch.tensor(held_labels, dtype=torch.int64)),
                      description=f"{name}: {pretrained or architecture + ' architecture, fresh weights'}, the last "
                                  f"{train_last} block(s), the pooler and the classifier trained ({counted}); "
                                  f"{len(y)} pairs, {tokens.source}, length {length}, N={users} users",
                      info={"trainable": counted})


def snli_task(*, root: str, pretrained: str | None = None, architecture: str = "bert-base", train_last: int = 1,
              users: int = 1000, partition: str = "iid", exponent: float | None = None, vocab_size: int | None = 10000,
              length: int = 64, seed: int = 0, init_seed: int = 0, layers: int | None = None,
              hidden: int | None = None, heads: int | None = None) -> Task:
    """Seed 001: SNLI (``datasets.load_snli``) with a BERT sequence classifier of which only the last
    ``train_last`` Transformer block(s), the pooler and the classifier train (bert-base with BERT's vocabulary:
    7,680,771 of 109,484,547); evaluated on the test split."""
    return _classifier_task("hf-snli", datasets.load_snli(root), "test", len(datasets.SNLI_LABELS),
                            pretrained=pretrained, architecture=architecture, train_last=train_last, users=users,
                            partition_scheme=partition, exponent=exponent, vocab_size=vocab_size, length=length,
                            seed=seed, init_seed=init_seed, layers=layers, hidden=hidden, heads=heads)


def qnli_task(*, root: str, pretrained: str | None = None, architecture: str = "bert-base", train_last: int = 1,
              users: int = 1000, partition: str = "iid", exponent: float | None = None, vocab_size: int | None = 10000,
              length: int = 96, seed: int = 0, init_seed: int = 0, layers: int | None = None,
              hidden: int | None = None, heads: int | None = None) -> Task:
    """Seed 004: GLUE QNLI (``datasets.load_qnli``), the classifier of :func:`snli_task` with two labels
    (bert-base: 7,680,002 of 109,483,778 trainable); evaluated on the dev split."""
    return _classifier_task("hf-qnli", datasets.load_qnli(root), "dev", len(datasets.QNLI_LABELS),
                            pretrained=pretrained, architecture=architecture, train_last=train_last, users=users,
                            partition_scheme=partition, exponent=exponent, vocab_size=vocab_size, length=length,
                            seed=seed, init_seed=init_seed, layers=layers, hidden=hidden, heads=heads)


# --- causal language models: seed 003's appendix (E2E with LoRA, PTB), seed 000 (TinyBERT), the stand-in ----------

def _lora(r: int, alpha: float | None, targets: Sequence[str], fan_in_fan_out: bool) -> Any:
    """peft's LoraConfig (r, α = 2r unless given, no dropout) or None for r = 0."""
    r = check_int("task.lora-r", r, minimum=0)
    if r == 0:
        return None
    try:
        import peft
    except ImportError as error:
        raise ValueError("task.lora-r > 0 needs peft: pip install -e \".[hf]\"") from error
    return peft.LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, lora_dropout=0.0,
                           target_modules=list(targets), fan_in_fan_out=fan_in_fan_out)


def _lm_task(name: str, source: Any, tokens: Tokens, rows: list[tuple[torch.Tensor, torch.Tensor]],
             held_out: tuple[torch.Tensor, torch.Tensor], *, lora: Any, init_seed: int, what: str) -> Task:
    def model() -> nn.Module:
        return hf.transformer(source, "causal-lm", peft_config=lora, init_seed=init_seed)

    counted = _announce(name, model, tokens)
    return hf.hf_task(model=model, head="causal-lm", users=Users.in_memory(rows), held_out=held_out, name=name,
                      description=f"{name}: {source if isinstance(source, str) else 'fresh weights'}, "
                                  f"{'LoRA r=' + str(lora.r) if lora is not None else 'every parameter'} trained "
                                  f"({counted}); {what}, {tokens.source}",
                      info={"trainable": counted})


def _e2e_rows(tokens: Tokens, mrs: list[str], refs: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``bos mr sep ref eos`` rows and their masks: only the reference and ``eos`` are scored."""
    rows, starts = [], []
    for mr, ref in zip(mrs, refs):
        prompt = [tokens.bos, *tokens.encode(mr), tokens.sep]
        rows.append(prompt + tokens.encode(ref) + [tokens.eos])
        starts.append(len(prompt))
    ids = text.pad(rows, length)
    mask = text.target_mask(ids, torch.tensor(starts))
    if tokens.pad != 0:
        ids[text.pad([[1] * len(r) for r in rows], length) == 0] = tokens.pad
    return ids, mask


def e2e_task(*, root: str, pretrained: str | None = None, architecture: str = "gpt2-medium", lora_r: int = 4,
             lora_alpha: float | None = None, users: int = 1000, partition: str = "iid", exponent: float | None = None,
             vocab_size: int | None = 5000, length: int = 80, seed: int = 0, init_seed: int = 0,
             layers: int | None = None, hidden: int | None = None, heads: int | None = None) -> Task:
    """Seed 003's appendix after Yu et al. 2022: E2E NLG (``datasets.load_e2e``) as conditional generation with
    GPT-2 and LoRA of rank ``lora_r`` on the attention's ``c_attn`` (0: every parameter trained; gpt2-medium with r = 4:
    393,216 of 355,216,384 trainable); each row is
    ``bos`` meaning representation ``sep`` reference ``eos``, the reference and ``eos`` scored; dev split
    evaluated."""
    data = datasets.load_e2e(root)
    mrs, refs = data["train"]
    tokens = _tokens(pretrained, mrs + refs, vocab_size)
    source = _source("hf-e2e", pretrained, architecture, tokens, length=length, layers=layers, hidden=hidden,
                     heads=heads)
    ids, mask = _e2e_rows(tokens, mrs, refs, length)
    parts = _users(len(mrs), users, partition, seed, exponent)
    return _lm_task("hf-e2e", source, tokens, [(ids[p], mask[p]) for p in parts], _e2e_rows(tokens, *data["dev"], length),
                    lora=_lora(lora_r, lora_alpha, ["c_attn"], True), init_seed=init_seed,
                    what=f"{len(mrs)} rows, length {length}, N={users} users")


def _ptb_rows(root: str, pretrained: str | None, vocab_size: int | None, length: int, users: int,
              partition_scheme: str, exponent: float | None, seed: int) -> tuple[Tokens, list, tuple, str]:
    length = check_int("task.length", length, minimum=2)
    data = datasets.load_ptb(root)
    sentences = [" ".join(s) for s in data["train"]]
    tokens = _tokens(pretrained, sentences, vocab_size)
    encoded = [tokens.encode(s) + [tokens.eos] for s in sentences]
    parts = _users(len(encoded), users, partition_scheme, seed, exponent)
    rows = []
    for part in parts:
        ids = text.windows([t for i in part.tolist() for t in encoded[i]], length)
        rows.append((ids, text.target_mask(ids)))
    test = text.windows([t for s in data["test"] for t in tokens.encode(" ".join(s)) + [tokens.eos]], length)
    return tokens, rows, (test, text.target_mask(test)), f"{sum(map(len, encoded))} train tokens, N={users} users"


def ptb_task(*, root: str, pretrained: str | None = None, architecture: str = "gpt2", users: int = 1000,
             partition: str = "iid", exponent: float | None = None, vocab_size: int | None = None, length: int = 33,
             seed: int = 0, init_seed: int = 0, layers: int | None = None, hidden: int | None = None,
             heads: int | None = None) -> Task:
    """Seed 003's appendix: Penn Treebank (``datasets.load_ptb``) next-token prediction, GPT-2 fully fine-tuned;
    each user's sentences form one stream cut into rows of ``length`` (``text.windows``); test stream evaluated."""
    tokens, rows, test, what = _ptb_rows(root, pretrained, vocab_size, length, users, partition, exponent,
                                         seed)
    source = _source("hf-ptb", pretrained, architecture, tokens, length=length, layers=layers, hidden=hidden,
                     heads=heads)
    return _lm_task("hf-ptb", source, tokens, rows, test, lora=None, init_seed=init_seed, what=what)


def tinybert_task(*, root: str, pretrained: str | None = None, architecture: str = "tinybert", users: int = 1000,
                  partition: str = "iid", exponent: float | None = None, vocab_size: int | None = 10000,
                  length: int = 33, seed: int = 0, init_seed: int = 0, layers: int | None = None,
                  hidden: int | None = None, heads: int | None = None) -> Task:
    """Seed 000's token prediction with a TinyBERT-size model (4 layers, 312 wide, 12 heads): a BERT decoder with a
    language-model head (``BertLMHeadModel``, causal attention) predicting each next token of Penn Treebank
    streams, every parameter trained (14,381,394 with BERT's 30,522-token vocabulary, 7,959,573 with a word
    vocabulary of 10,005)."""
    tokens, rows, test, what = _ptb_rows(root, pretrained, vocab_size, length, users, partition,
                                         exponent, seed)
    source = _source("hf-tinybert", pretrained, architecture, tokens, length=length, layers=layers, hidden=hidden,
                     heads=heads, decoder=True)
    return _lm_task("hf-tinybert", source, tokens, rows, test, lora=None, init_seed=init_seed, what=what)


def markov_task(*, pretrained: str | None = None, architecture: str = "gpt2-tiny", lora_r: int = 8,
                lora_targets: str = "c_attn", users: int = 200, sequences: int = 8, length: int = 24, vocab: int = 64, shift: float = 0.25,
                eval_sequences: int = 256, seed: int = 0, init_seed: int = 0, layers: int | None = None,
                hidden: int | None = None, heads: int | None = None) -> Task:
    """Users' text in a synthetic Markov language (``synthetic.markov_chain`` with ``shift``: the users' language
    differs from the public one of the pre-training stand-in in a ``shift`` fraction of its rows), ``sequences``
    sequences of ``length`` tokens per user, no files; a small GPT-2 with LoRA of rank ``lora_r`` on the layers named
    in ``lora_targets`` (comma-separated: ``c_attn``, the attention; ``c_fc``, the MLP's first layer; 0: every
    parameter), from ``pretrained`` or fresh weights. Held-out: ``eval_sequences`` more of the users'
    language. Built for tests, benchmarks and docs/tutorials/fine-tune.md's pre-training stand-in."""
    users, sequences = check_int("task.users", users, minimum=1), check_int("task.sequences", sequences, minimum=1)
    chain = synthetic.markov_chain(vocab, seed=seed, shift=shift)
    all_tokens = synthetic.markov_sequences(chain, users * sequences + eval_sequences, length, seed=seed + 1)
    tokens = Tokens(lambda s: [int(t) for t in s.split()], vocab, 0, 0, 0, 0, f"{vocab} Markov tokens")
    source = pretrained or _markov_config(architecture, vocab, length, layers, hidden, heads)
    mask = torch.ones_like(all_tokens, dtype=torch.float32)
    rows = [(all_tokens[i * sequences:(i + 1) * sequences], mask[i * sequences:(i + 1) * sequences])
            for i in range(users)]
    held = (all_tokens[users * sequences:], mask[users * sequences:])
    targets = [t.strip() for t in str(lora_targets).split(",") if t.strip()]
    return _lm_task("hf-markov", source, tokens, rows, held, lora=_lora(lora_r, None, targets, True),
                    init_seed=init_seed, what=f"N={users} users of {sequences} sequences of {length} tokens")


def _markov_config(architecture: str, vocab: int, length: int, layers: int | None, hidden: int | None,
                   heads: int | None) -> Any:
    """The config of the Markov task's model (fresh weights: no warning, it is a synthetic task)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _source("hf-markov", None, architecture, Tokens(str.split, vocab, 0, 0, 0, 0, ""), length=length,
                       layers=layers, hidden=hidden, heads=heads)


def save_pretrained(model: nn.Module, folder: str | Path) -> Path:
    """Write a :func:`fed_dp.clients.hf.transformer` model (or a bare ``transformers`` model) with
    ``save_pretrained`` to ``folder``, for ``task.pretrained``."""
    inner = model.model if isinstance(model, hf.Logits) else model
    inner.save_pretrained(str(folder))
    return Path(folder)
