"""The built-in tasks: the seed papers' datasets partitioned by user, with the model each paper used.

Each is an ordinary :class:`fed_dp.Task` (model factory, users, loss, evaluation), built by a factory that a run
config names by its short name (``task.ref = "heavy-tail"``) or by reference
(``fed_dp.simulations.tasks.builtin:heavy_tail_task``); every other ``[task]`` key is a keyword argument.

| name | data | model | evaluated on |
|---|---|---|---|
| ``heavy-tail`` | seed 003 §3 synthetic heavy-tail classes (built in) | linear softmax | the training examples, per frequency group (a memorization task: inputs are independent of labels) |
| ``heavy-tail-mixture`` | seed 003 §3 class sizes, Gaussian classes around prototypes (built in) | linear softmax + bias | held-out draws of every class, per frequency group |
| ``sparse-logreg-1d`` | seed 000 §5.1-style 1-D sparse logistic regression (built in) | 1-D logistic | a held-out draw |
| ``cifar10`` | ``cifar-10-batches-py`` from a local folder (seeds 001, 004) | 5-layer DP CNN | the test batch |
| ``barcode-mnist`` | MNIST idx files from a local folder, seed 003 App. B | 2-conv CNN | a held-out split, per group |
| ``w1`` | W1 (docs/explanation/benchmarks.md): CIFAR-shaped noise, labels independent of inputs, seeded by user id (built in) | W1 CNN | nothing (a throughput workload) |
| ``stackoverflow_like_task`` (by reference) | 342,477 lazily generated users of 1–64 Zipf-distributed token sequences, seeded by user id (built in) | bigram LM (Embedding, LayerNorm, Linear) | nothing (a throughput workload) |

Users: ``users`` = N; ``partition`` = ``iid`` | ``dirichlet`` (``alpha``) | ``power-law`` (``exponent``) |
``natural-id`` (where the data has ids). Every example belongs to exactly one user. All use the
classification loss (``fed_dp.losses.classification``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Task, Users
from fed_dp.simulations.tasks import datasets, federated_datasets, models, synthetic, text
from fed_dp.simulations.tasks.partitioning import partition
from fed_dp.validation import check_int


def _split_users(x: torch.Tensor, y: torch.Tensor, users: int, scheme: str, seed: int, **kw: Any) -> Users:
    parts = [torch.from_numpy(idx.astype("int64", copy=True)) for idx in partition(y.numpy(), users, scheme, seed=seed, **kw)]
    return Users.in_memory([(x[idx], y[idx]) for idx in parts])


def _partition_kwargs(partition_name: str, alpha: float | None, exponent: float | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if alpha is not None:
        kwargs["alpha"] = alpha
    if exponent is not None:
        kwargs["exponent"] = exponent
    return kwargs


def heavy_tail_task(
    *, groups: int = 3, largest: int = 16, dim: int | None = None, users: int | None = 40,
    partition: str = "iid", alpha: float | None = None, exponent: float | None = None, seed: int = 0,
) -> Task:
    """Seed 003 §3: G frequency groups, group k has 2^k classes of L/2^k examples; linear softmax model.

    The defaults are a small instance (48 examples, 7 classes, 40 users) that trains in seconds; the paper's
    size is G = 8, L = 1024 (``simulations/configs/seed003-heavy-tail.toml``). ``users=None``: N = n/2. The
    paper measures how fast each frequency group's training examples are fit, so evaluation is on the
    training examples, per group.
    """
    x, y, class_groups = synthetic.heavy_tail_data(groups=groups, largest=largest, dim=dim, seed=seed)
    n, d = x.shape
    num_classes = int(class_groups.numel())
    users = n // 2 if users is None else users
    return Task(
        name="heavy-tail",
        users=_split_users(x, y, users, partition, seed, **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.linear_softmax(d, num_classes),
        loss=losses.classification,
        evaluate=evaluation.classification((x, y), class_groups=class_groups),
        class_groups=class_groups,
        description=f"heavy-tail (seed 003 §3): G={groups}, L={largest}, n={n}, c={num_classes}, d={d}, "
                    f"N={users} users ({partition})",
    )


def heavy_tail_mixture_task(
    *, groups: int = 5, largest: int = 4096, dim: int = 32, spread: float = 1.0, held_out: int = 64,
    users: int | None = None, partition: str = "iid", alpha: float | None = None, exponent: float | None = None,
    seed: int = 0,
) -> Task:
    """Seed 003's heavy-tailed class frequencies with learnable Gaussian classes
    (``synthetic.heavy_tail_mixture``), a linear softmax model with bias, evaluated on held-out draws per
    frequency group. ``users=None``: N = n/2 (two examples per user)."""
    x, y, x_test, y_test, class_groups = synthetic.heavy_tail_mixture(
        groups=groups, largest=largest, dim=dim, spread=spread, held_out=held_out, seed=seed)
    n, num_classes = len(y), int(class_groups.numel())
    users = n // 2 if users is None else users
    return Task(
        name="heavy-tail-mixture",
        users=_split_users(x, y, users, partition, seed, **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.linear_softmax(dim, num_classes, bias=True),
        loss=losses.classification,
        evaluate=evaluation.classification((x_test, y_test), class_groups=class_groups),
        class_groups=class_groups,
        description=f"heavy-tail mixture (seed 003 §3 class sizes, Gaussian classes): G={groups}, L={largest}, "
                    f"n={n}, c={num_classes}, d={dim}, spread={spread}, N={users} users ({partition})",
    )


def sparse_logreg_task(
    *, num_examples: int = 1000, nonzero_fraction: float = 0.05, users: int | None = None,
    partition: str = "iid", seed: int = 0,
) -> Task:
    """Seed 000 §5.1-style 1-D sparse logistic regression (for the AdaGrad variants); one example per user."""
    x, y = synthetic.sparse_logistic_1d(num_examples=num_examples, nonzero_fraction=nonzero_fraction, seed=seed)
    x_eval, y_eval = synthetic.sparse_logistic_1d(num_examples=num_examples, nonzero_fraction=nonzero_fraction,
                                                  seed=seed + 1)
    users = num_examples if users is None else users
    return Task(
        name="sparse-logreg-1d",
        users=_split_users(x, y, users, partition, seed),
        model=models.logistic_1d,
        loss=losses.classification,
        evaluate=evaluation.classification((x_eval, y_eval)),
        description=f"sparse 1-D logistic regression: n={num_examples}, nonzero fraction {nonzero_fraction}, "
                    f"N={users} users ({partition})",
    )


def cifar10_task(
    *, root: str, users: int = 500, partition: str = "dirichlet", alpha: float | None = 0.5,
    exponent: float | None = None, seed: int = 0,
) -> Task:
    """CIFAR-10 from a local ``cifar-10-batches-py`` folder (seeds 001, 004) with the 5-layer DP CNN."""
    train_x, train_y, test_x, test_y = datasets.load_cifar10(root)
    return Task(
        name="cifar10",
        users=_split_users(train_x, train_y, users, partition, seed,
                           **_partition_kwargs(partition, alpha if partition == "dirichlet" else None, exponent)),
        model=models.cifar_cnn,
        loss=losses.classification,
        evaluate=evaluation.classification((test_x, test_y)),
        description=f"CIFAR-10 ({root}): {len(train_y)} train / {len(test_y)} test, N={users} users ({partition})",
    )


def barcode_mnist_task(
    *, root: str, users: int = 500, partition: str = "iid", alpha: float | None = None,
    exponent: float | None = None, eval_fraction: float = 0.1, seed: int = 0,
    groups: list[list[int]] | None = None,
) -> Task:
    """Barcode-MNIST (seed 003 App. B) built from local MNIST idx files, with the 2-conv CNN.

    ``groups``: [[barcodes, examples per class], ...] from most to least frequent (default:
    ``datasets.BARCODE_MNIST_GROUPS``); smaller groups give a smaller task.
    """
    train_x, train_y, _, _ = datasets.load_mnist(root)
    group_spec = datasets.BARCODE_MNIST_GROUPS if groups is None else tuple(tuple(g) for g in groups)
    x, y, class_groups = datasets.make_barcode_mnist(train_x, train_y, groups=group_spec, seed=seed)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held = int(len(y) * eval_fraction)
    eval_idx, train_idx = order[:held], order[held:]
    num_classes = int(class_groups.numel())
    return Task(
        name="barcode-mnist",
        users=_split_users(x[train_idx], y[train_idx], users, partition, seed,
                           **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.barcode_cnn(num_classes),
        loss=losses.classification,
        evaluate=evaluation.classification((x[eval_idx], y[eval_idx]), class_groups=class_groups),
        class_groups=class_groups,
        description=f"Barcode-MNIST ({root}): {len(train_idx)} train / {held} eval, c={num_classes}, "
                    f"N={users} users ({partition})",
    )


def w1_task(*, users: int = 500, examples: int = 32) -> Task:
    """W1 (docs/explanation/benchmarks.md): ``users`` users of ``examples`` CIFAR-shaped examples each, user i's data from
    ``synthetic.w1_user_data(i)``; the 25,578-parameter W1 CNN. No held-out data: labels are independent
    of the inputs, so accuracy means nothing; the workload measures throughput."""
    users = check_int("w1: users", users, minimum=1)
    return Task(
        name="w1",
        users=Users.in_memory([synthetic.w1_user_data(u, examples) for u in range(users)]),
        model=models.w1_cnn,
        loss=losses.classification,
        description=f"W1 throughput workload: N={users} users x {examples} synthetic CIFAR-shaped examples",
    )


#: StackOverflow's federated training population (TensorFlow Federated's split): the size of
#: :func:`stackoverflow_like_task`'s population.
STACKOVERFLOW_USERS = 342_477


def stackoverflow_like_task(
    *, users: int = STACKOVERFLOW_USERS, vocabulary: int = 10_000, length: int = 20, max_sequences: int = 64,
    sequences_exponent: float = 1.0, embedding: int = 6, seed: int = 0,
) -> Task:
    """A StackOverflow-shaped population for throughput measurements: ``users`` users (default 342,477, as
    StackOverflow's training split), each generated when it is sampled, never before
    (:func:`synthetic.stackoverflow_like_user`: 1..``max_sequences`` sequences of ``length`` tokens, a
    Zipf-distributed count per user and Zipf-distributed tokens, from a generator seeded by the user id and
    ``seed``); next-token prediction (``losses.next_token``) with ``models.bigram_lm`` (V·e + 2e + e·V + V
    weights: 130,012 at the defaults). No held-out data: tokens are independent, so there is nothing to learn."""
    users = check_int("users", users, minimum=1)
    options = {"vocabulary": check_int("vocabulary", vocabulary, minimum=2), "length": length,
               "max_sequences": check_int("max_sequences", max_sequences, minimum=1), "seed": seed,
               "sequences_exponent": sequences_exponent}

    def load(user_id: int) -> tuple[torch.Tensor]:
        return synthetic.stackoverflow_like_user(user_id, **options)

    return Task(
        name="stackoverflow-like",
        users=Users(users, load),
        model=lambda: models.bigram_lm(vocabulary, embedding),
        loss=losses.next_token,
        description=f"StackOverflow-shaped synthetic population: N={users} lazily generated users of "
                    f"1..{max_sequences} sequences of {length} tokens (Zipf, s={sequences_exponent}), V={vocabulary}",
    )


def label_counts(task: Task, num_classes: int) -> np.ndarray:
    """Examples per class over all users (for reports and tests)."""
    labels = torch.cat([task.users[i].fields[1] for i in range(task.num_users)])
    return np.bincount(labels.numpy(), minlength=num_classes)


# ------------------------------------------------------------------------------------------------------------
# Text tasks of the seeds: SNLI, QNLI (sentence pairs), Penn Treebank, E2E (next-token prediction)
# ------------------------------------------------------------------------------------------------------------


def _pair_tensor(vocabulary: text.Vocabulary, first: list[str], second: list[str], length: int) -> torch.Tensor:
    """(n, 2, length) token ids of sentence pairs (each sentence cut at ``length`` words, padded with 0)."""
    return torch.stack([text.pad([vocabulary.encode(text.words(s)) for s in first], length),
                        text.pad([vocabulary.encode(text.words(s)) for s in second], length)], dim=1)


def _sentence_pair_task(
    name: str, train: datasets.SentencePairs, held_out: datasets.SentencePairs, classes: int, *, root: str,
    users: int, partition: str, alpha: float | None, exponent: float | None, vocab_size: int | None, length: int,
    seed: int, held_out_name: str,
) -> Task:
    length = check_int("length", length, minimum=1)
    vocabulary = text.Vocabulary.build((text.words(s) for s in train[0] + train[1]), vocab_size)
    x, y = _pair_tensor(vocabulary, train[0], train[1], length), torch.tensor(train[2], dtype=torch.int64)
    x_eval, y_eval = _pair_tensor(vocabulary, held_out[0], held_out[1], length), torch.tensor(held_out[2])
    return Task(
        name=name,
        users=_split_users(x, y, users, partition, seed, **_partition_kwargs(partition, alpha, exponent)),
        model=lambda: models.pair_classifier(len(vocabulary), classes),
        loss=losses.classification,
        evaluate=evaluation.classification((x_eval, y_eval)),
        description=f"{name} ({root}): {len(y)} train / {len(y_eval)} {held_out_name} pairs, vocabulary "
                    f"{len(vocabulary)}, length {length}, N={users} users ({partition})",
        info={"vocabulary": vocabulary},
    )


def snli_task(
    *, root: str, users: int = 1000, partition: str = "iid", alpha: float | None = None,
    exponent: float | None = None, vocab_size: int | None = 10000, length: int = 32, seed: int = 0,
) -> Task:
    """SNLI (seed 001) from its local jsonl files (``datasets.load_snli``): premise/hypothesis pairs with the
    three gold labels dealt to ``users`` users by a flwr-datasets partitioner, the pair classifier of
    ``models.pair_classifier`` on a word vocabulary of the ``vocab_size`` most frequent training words,
    evaluated on the test split."""
    data = datasets.load_snli(root)
    return _sentence_pair_task("snli", data["train"], data["test"], len(datasets.SNLI_LABELS), root=root, users=users,
                               partition=partition, alpha=alpha, exponent=exponent, vocab_size=vocab_size,
                               length=length, seed=seed, held_out_name="test")


def qnli_task(
    *, root: str, users: int = 1000, partition: str = "iid", alpha: float | None = None,
    exponent: float | None = None, vocab_size: int | None = 10000, length: int = 48, seed: int = 0,
) -> Task:
    """QNLI (seed 004) from GLUE's tsv files (``datasets.load_qnli``): question/sentence pairs dealt to
    ``users`` users, the pair classifier, evaluated on GLUE's dev split (its test labels are not public)."""
    data = datasets.load_qnli(root)
    return _sentence_pair_task("qnli", data["train"], data["dev"], len(datasets.QNLI_LABELS), root=root, users=users,
                               partition=partition, alpha=alpha, exponent=exponent, vocab_size=vocab_size,
                               length=length, seed=seed, held_out_name="dev")


def _masked(tokens: torch.Tensor, first_target: torch.Tensor | int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens, text.target_mask(tokens, first_target)


def _token_lm_task(name: str, vocabulary: text.Vocabulary, per_user: list[Any], ids: list[Any], held_out: Any,
                   description: str) -> Task:
    return Task(name=name, users=Users.in_memory(per_user, ids), model=lambda: models.token_lm(len(vocabulary)),
                loss=losses.next_token, evaluate=evaluation.next_token(held_out), description=description,
                info={"vocabulary": vocabulary})


def _example_users(count: int, users: int, scheme: str, seed: int, alpha: float | None,
                   exponent: float | None) -> list[np.ndarray]:
    """Example indices of each user for data without labels (text): a flwr-datasets partition of 0..count−1."""
    return partition(np.zeros(count, dtype=np.int64), users, scheme, seed=seed,
                     **_partition_kwargs(scheme, alpha, exponent))


def ptb_task(
    *, root: str, users: int = 1000, partition: str = "iid", exponent: float | None = None,
    vocab_size: int | None = None, length: int = 33, seed: int = 0,
) -> Task:
    """Penn Treebank language modelling (seed 003 uses PTB) from the ``ptb.*.txt`` files
    (``datasets.load_ptb``): the training sentences are dealt to ``users`` users (``iid`` or ``power-law``);
    each user's sentences, in order, form one token stream cut into rows of ``length`` tokens that share one
    token (``text.windows``: every token after the first is predicted once). The vocabulary is the training
    words (PTB's 10,000, with ``<unk>`` and ``<eos>``; ``vocab_size`` keeps the most frequent). Model
    ``models.token_lm``; evaluated on the test stream (loss, perplexity, next-token accuracy)."""
    length = check_int("length", length, minimum=2)
    data = datasets.load_ptb(root)
    vocabulary = text.Vocabulary.build(data["train"], vocab_size)
    sentences = [vocabulary.encode(s) for s in data["train"]]
    parts = _example_users(len(sentences), users, partition, seed, None, exponent)
    per_user = [_masked(text.windows([t for i in part for t in sentences[i]], length)) for part in parts]
    test = _masked(text.windows([t for s in data["test"] for t in vocabulary.encode(s)], length))
    return _token_lm_task("ptb", vocabulary, per_user, list(range(users)), test,
                          f"Penn Treebank ({root}): {sum(len(s) for s in sentences)} train tokens, vocabulary "
                          f"{len(vocabulary)}, rows of {length}, N={users} users ({partition})")


def _e2e_rows(vocabulary: text.Vocabulary, mrs: list[str], refs: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``<bos> mr <sep> ref <eos>`` rows and their masks: only the reference and ``<eos>`` are targets (the
    model is conditioned on the meaning representation, not asked to predict it)."""
    rows, starts = [], []
    for mr, ref in zip(mrs, refs):
        prompt = [vocabulary.id(text.BOS)] + vocabulary.encode(text.words(mr)) + [vocabulary.id(text.SEP)]
        rows.append(prompt + vocabulary.encode(text.words(ref)) + [vocabulary.id(text.EOS)])
        starts.append(len(prompt))
    return _masked(text.pad(rows, length), torch.tensor(starts))


def e2e_task(
    *, root: str, users: int = 1000, partition: str = "iid", exponent: float | None = None,
    vocab_size: int | None = 5000, length: int = 80, seed: int = 0,
) -> Task:
    """E2E NLG (seed 003) as conditional next-token generation, from the release's csv files
    (``datasets.load_e2e``): each row is ``<bos>`` meaning representation ``<sep>`` reference ``<eos>``, the
    loss scores only the reference and ``<eos>`` (``losses.next_token`` with a mask), rows longer than
    ``length`` tokens are cut. Rows are dealt to ``users`` users; model ``models.token_lm``; evaluated on the
    dev split."""
    length = check_int("length", length, minimum=2)
    data = datasets.load_e2e(root)
    mrs, refs = data["train"]
    vocabulary = text.Vocabulary.build((text.words(s) for s in mrs + refs), vocab_size)
    tokens, mask = _e2e_rows(vocabulary, mrs, refs, length)
    parts = _example_users(len(mrs), users, partition, seed, None, exponent)
    per_user = [(tokens[torch.from_numpy(p.astype(np.int64))], mask[torch.from_numpy(p.astype(np.int64))]) for p in parts]
    return _token_lm_task("e2e", vocabulary, per_user, list(range(users)), _e2e_rows(vocabulary, *data["dev"], length),
                          f"E2E NLG ({root}): {len(mrs)} train / {len(data['dev'][0])} dev rows, vocabulary "
                          f"{len(vocabulary)}, length {length}, N={users} users ({partition})")


# ------------------------------------------------------------------------------------------------------------
# Federated datasets with natural users: LEAF FEMNIST and Shakespeare, StackOverflow, FLAIR
# ------------------------------------------------------------------------------------------------------------


def _first(ids: list[Any], max_users: int | None) -> list[Any]:
    return ids if max_users is None else ids[: check_int("max-users", max_users, minimum=1)]


def _femnist_tensors(x: list[Any], y: list[Any], where: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.tensor(x, dtype=torch.float32)
    labels = torch.tensor(y, dtype=torch.int64)
    if images.ndim != 2 or images.shape[1] != 784 or labels.ndim != 1:
        raise ValueError(f"LEAF FEMNIST {where}: x must be lists of 784 pixel values and y integer labels, got "
                         f"x of shape {tuple(images.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) > 61):
        raise ValueError(f"LEAF FEMNIST {where}: labels must lie in 0..61, got {int(labels.min())}..{int(labels.max())}")
    return images.reshape(-1, 1, 28, 28), labels


def femnist_task(*, root: str, max_users: int | None = None, eval_examples: int | None = 10000) -> Task:
    """LEAF FEMNIST (Caldas et al. 2018): one user per writer, from LEAF's json files
    (``federated_datasets.load_leaf``), never re-partitioned; ``max_users`` keeps the first writers (file
    order) for a smaller run. 28×28 grey images (x: 784 values in [0, 1]), 62 classes (digits, upper- and
    lower-case letters); model ``models.small_cnn(62)``; evaluated on the first ``eval_examples`` examples of
    LEAF's test files."""
    train, test = federated_datasets.load_leaf(root, "femnist")
    ids = _first(list(train), max_users)
    per_user = [_femnist_tensors(*train[u], f"user {u!r}") for u in ids]
    x_test, y_test = _femnist_tensors([v for u in test for v in test[u][0]], [v for u in test for v in test[u][1]],
                                      "test")
    held = slice(None) if eval_examples is None else slice(0, check_int("eval-examples", eval_examples, minimum=1))
    return Task(name="femnist", users=Users.in_memory(per_user, ids), model=lambda: models.small_cnn(62),
                loss=losses.classification, evaluate=evaluation.classification((x_test[held], y_test[held])),
                description=f"LEAF FEMNIST ({root}): N={len(ids)} writers of {len(train)}, "
                            f"{sum(len(p[1]) for p in per_user)} train images, {len(y_test[held])} test images")


def shakespeare_task(*, root: str, max_users: int | None = None, eval_examples: int | None = 10000) -> Task:
    """LEAF Shakespeare: one user per speaking role, from LEAF's json files; an example is 80 characters (x)
    and the next one (y). The example x + y is one 81-character row for ``losses.next_token`` (every
    character is predicted from those before it; the last prediction is LEAF's target y). Characters are the
    training files' own (``text.Vocabulary`` of characters). Model ``models.token_lm``; evaluated on the first
    ``eval_examples`` test examples."""
    train, test = federated_datasets.load_leaf(root, "shakespeare")
    ids = _first(list(train), max_users)

    def rows(x: list[str], y: list[str], where: str) -> torch.Tensor:
        if any(not isinstance(a, str) or not isinstance(b, str) or len(b) != 1 for a, b in zip(x, y)):
            raise ValueError(f"LEAF Shakespeare {where}: x must be strings and y single characters")
        return text.pad([vocabulary.encode(a + b) for a, b in zip(x, y)], max((len(a) + 1 for a in x), default=2))

    vocabulary = text.Vocabulary.build(a + b for u in train for a, b in zip(*train[u]))
    per_user = [(rows(*train[u], f"user {u!r}"),) for u in ids]
    test_x = [a for u in test for a in test[u][0]][:eval_examples]
    test_y = [b for u in test for b in test[u][1]][:eval_examples]
    test_rows = rows(test_x, test_y, "test")
    return _token_lm_task("shakespeare", vocabulary, per_user, ids, _masked(test_rows),
                          f"LEAF Shakespeare ({root}): N={len(ids)} roles of {len(train)}, "
                          f"{sum(len(p[0]) for p in per_user)} train examples, {len(test_rows)} test examples, "
                          f"{len(vocabulary)} characters")


def _stackoverflow_rows(vocabulary: text.Vocabulary, sentences: list[list[str]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    bos, eos = vocabulary.id(text.BOS), vocabulary.id(text.EOS)
    return _masked(text.pad([[bos] + vocabulary.encode(s)[: length - 2] + [eos] for s in sentences], length))


def stackoverflow_task(
    *, root: str, max_users: int | None = None, vocab_size: int = 10000, length: int = 22,
    eval_examples: int = 10000,
) -> Task:
    """StackOverflow next-word prediction (Reddi et al. 2021's benchmark) from TFF's h5 files: one user per
    poster (``/examples/<client id>``), loaded only when sampled. Each sentence (``tokens``) is
    ``<bos>`` + its first ``length`` − 2 words + ``<eos>``, padded; the vocabulary is the ``vocab_size`` most
    frequent words of ``stackoverflow.word_count`` (TFF's counts over the training set; the benchmark uses
    10,000), others are ``<unk>``. Model ``models.token_lm``; evaluated on the first ``eval_examples``
    sentences of the test file's clients (sorted ids)."""
    length = check_int("length", length, minimum=3)
    folder = Path(root)
    path, ids = federated_datasets.stackoverflow_users(folder, "train")
    counts = federated_datasets.read_word_counts(folder / "stackoverflow.word_count")
    vocabulary = text.Vocabulary.from_counts(counts, check_int("vocab-size", vocab_size, minimum=1))
    ids = _first(ids, max_users)
    test_path, test_ids = federated_datasets.stackoverflow_users(folder, "test")
    held: list[list[str]] = []
    for client in test_ids:
        held += federated_datasets.stackoverflow_sentences(test_path, client)
        if len(held) >= eval_examples:
            break
    users = Users(ids, lambda client: _stackoverflow_rows(
        vocabulary, federated_datasets.stackoverflow_sentences(path, client), length))
    return Task(name="stackoverflow", users=users, model=lambda: models.token_lm(len(vocabulary)),
                loss=losses.next_token,
                evaluate=evaluation.next_token(_stackoverflow_rows(vocabulary, held[:eval_examples], length)),
                description=f"StackOverflow ({root}): N={len(ids)} posters, vocabulary {len(vocabulary)}, length "
                            f"{length}, {min(len(held), eval_examples)} test sentences",
                info={"vocabulary": vocabulary})


def flair_task(
    *, root: str, file: str = federated_datasets.FLAIR_FILE, max_users: int | None = None, size: int = 32,
    eval_users: int = 200,
) -> Task:
    """FLAIR (Song et al. 2022) multi-label classification of the 17 coarse labels, from the hdf5 file of
    ml-flair's ``prepare_dataset.py``: one user per Flickr photographer of ``/train`` (loaded when
    sampled), images reduced from 256×256 to ``size``×``size`` by block means, multi-hot labels;
    ``models.small_cnn(17, 3, size)``, ``losses.multi_label``; evaluated (loss, micro precision/recall/F1)
    on the first ``eval_users`` users of ``/test``."""
    size = check_int("size", size, minimum=1)
    labels = federated_datasets.flair_labels(root, file)
    path, ids = federated_datasets.flair_users(root, "train", file)
    _, test_ids = federated_datasets.flair_users(root, "test", file)
    held = [federated_datasets.flair_user(path, "test", u, labels, size)
            for u in test_ids[: check_int("eval-users", eval_users, minimum=1)]]
    ids = _first(ids, max_users)
    return Task(name="flair", users=Users(ids, lambda user: federated_datasets.flair_user(path, "train", user, labels, size)),
                model=lambda: models.small_cnn(len(labels), 3, size), loss=losses.multi_label,
                evaluate=evaluation.multi_label((torch.cat([h[0] for h in held]), torch.cat([h[1] for h in held]))),
                description=f"FLAIR ({path}): N={len(ids)} photographers, {len(labels)} labels, images {size}x{size}, "
                            f"{sum(len(h[1]) for h in held)} test images")
