"""Synthetic tasks from the seed papers, generated with explicit ``torch.Generator``s.

Two generators:

* :func:`heavy_tail_data` -- the heavy-tail class-imbalance task of seed 003 §3 (after
  Kunstner et al. 2024): a linear softmax model on inputs drawn independently of the
  labels, with class frequencies spread over ``groups`` orders of magnitude.
* :func:`sparse_logistic_1d` -- the one-dimensional sparse logistic regression of
  seed 000 §5.1, used to compare AdaGrad variants (docs/explanation/server-optimizers.md): most samples
  have ``x = 0`` and therefore a gradient that is exactly zero.
* :func:`heavy_tail_mixture` -- the same class frequencies with inputs that depend on the label
  (a Gaussian around a prototype per class), so a model can generalize and is evaluated on held-out
  draws per frequency group: the main job of ``fed-dp simulate``.
* :func:`w1_user_data` -- one user of the W1 (docs/explanation/benchmarks.md) throughput workload:
  CIFAR-shaped inputs and labels drawn from a generator seeded with the user id.
* :func:`stackoverflow_like_user` -- one user of a StackOverflow-shaped population (a heavy-tailed
  number of token sequences), drawn from a generator seeded with the user id, so that a population
  of 342,477 users can be loaded lazily (``tasks.builtin.stackoverflow_like_task``).

Neither function touches the global RNG: every draw goes through a private
``torch.Generator`` seeded with ``seed``, so a call is reproducible and independent of
everything else running in the process.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from fed_dp.randomness import derive_seed
from fed_dp.validation import check_int

__all__ = [
    "SPARSE_LOGISTIC_TRUE_WEIGHT",
    "heavy_tail_class_sizes",
    "heavy_tail_data",
    "heavy_tail_mixture",
    "markov_chain",
    "markov_sequences",
    "sparse_logistic_1d",
    "stackoverflow_like_user",
    "truncated_zipf",
    "w1_user_data",
]

#: Ground-truth weight ``w*`` of :func:`sparse_logistic_1d`: ``P(y = 1 | x) = sigmoid(w* x)``.
SPARSE_LOGISTIC_TRUE_WEIGHT: float = 1.0


def _generator(seed: object) -> torch.Generator:
    seed = check_int("seed", seed, minimum=0)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def heavy_tail_class_sizes(*, groups: int = 8, largest: int = 1024) -> torch.Tensor:
    """Number of examples of every class of :func:`heavy_tail_data` (int64, shape (2^G − 1,)).

    Class ``j`` belongs to group ``k = floor(log2(j + 1))`` and has ``largest / 2^k``
    examples; classes are ordered from most to least frequent.
    """
    groups = check_int("groups", groups, minimum=1)
    largest = check_int("largest", largest, minimum=1)
    if largest % (2 ** (groups - 1)) != 0:
        raise ValueError(
            f"largest must be divisible by 2^(groups - 1) = {2 ** (groups - 1)} so that "
            f"every class of the last group has an integer size, got largest={largest} "
            f"with groups={groups}"
        )
    class_groups = _class_groups(groups)
    return torch.div(largest, 2**class_groups, rounding_mode="floor").to(torch.int64)


def _class_groups(groups: int) -> torch.Tensor:
    counts = 2 ** torch.arange(groups, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(groups, dtype=torch.int64), counts)


def heavy_tail_data(
    *,
    groups: int = 8,
    largest: int = 1024,
    dim: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heavy-tail class-imbalanced classification data (seed 003 §3; Kunstner et al. 2024).

    Construction, with ``G = groups`` and ``L = largest``:

    * Classes come in ``G`` frequency groups. Group ``k`` (``k = 0, …, G−1``) holds
      ``2^k`` classes of ``L / 2^k`` examples each, so every group holds ``L``
      examples, there are ``n = G·L`` examples and ``c = 2^G − 1`` classes, and the
      frequency of a class is inversely proportional to the number of classes that
      are as frequent as it (approximately Zipf, ``π_j ∝ 1/j``). Class ``j`` is in
      group ``floor(log2(j + 1))``: class 0 is the most frequent, the last ``2^(G−1)``
      classes the rarest. ``L`` must be divisible by ``2^(G−1)``.
    * Inputs are i.i.d. ``Uniform[0, 1]^d`` with ``d = L + n`` by default. The seed
      writes ``d = 2^m + n`` where ``2^m`` is the largest class size; its reported
      instance ``n = 8192, d = 9216, c = 255`` is exactly this function's default
      ``G = 8, L = 1024`` (smallest class: 8 examples, above the seed's minimum class
      size of 5; the "8 classes with 128 samples" and "128 classes with 8 samples"
      groups of its Fig. 2 are groups 3 and 7). Since ``d > n`` the inputs are linearly
      independent almost surely, so a linear softmax model can fit any labelling and
      the task measures how fast an optimizer learns each class.
    * Labels are independent of the inputs: the multiset of labels is fixed by the class
      sizes above and its order is a uniformly random permutation drawn independently
      of ``x``. Knowing ``x_i`` tells nothing about ``y_i`` beyond the class frequencies.

    Args:
        groups: number of frequency groups ``G >= 1``.
        largest: size ``L`` of the most frequent class (of each group); divisible by
            ``2^(G−1)``.
        dim: input dimension ``d >= 1``; ``None`` means ``L + n``.
        seed: seed of the private ``torch.Generator`` (``>= 0``).

    Returns:
        ``(x, y, class_groups)``: ``x`` float32 of shape ``(n, d)`` with entries in
        ``[0, 1)``; ``y`` int64 of shape ``(n,)`` with values in ``0..c−1``;
        ``class_groups`` int64 of shape ``(c,)``, the group of every class.

    Note: the default instance is 8192 × 9216 float32 (about 300 MB).
    """
    sizes = heavy_tail_class_sizes(groups=groups, largest=largest)
    n = int(groups) * int(largest)
    if dim is None:
        dim = int(largest) + n
    else:
        dim = check_int("dim", dim, minimum=1)
    gen = _generator(seed)

    class_groups = _class_groups(int(groups))
    num_classes = class_groups.numel()
    sorted_labels = torch.repeat_interleave(torch.arange(num_classes, dtype=torch.int64), sizes)
    # Draw the inputs and the label order from the same generator, but never let one
    # depend on the other: the labels are a fixed multiset in a random order.
    x = torch.rand((n, dim), generator=gen, dtype=torch.float32)
    y = sorted_labels[torch.randperm(n, generator=gen)]
    return x, y, class_groups


def sparse_logistic_1d(
    *,
    num_examples: int = 1000,
    nonzero_fraction: float = 0.05,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-dimensional sparse logistic regression (seed 000 §5.1; docs/explanation/server-optimizers.md).

    Model: a single weight ``w``, per-example loss
    ``ℓ(w; x, y) = −y log σ(w x) − (1 − y) log(1 − σ(w x))`` with ``y ∈ {0, 1}``, whose
    gradient is ``∂ℓ/∂w = (σ(w x) − y)·x``. Data, drawn i.i.d. for every example:

    1. ``z ~ N(0, 1)`` and ``y ~ Bernoulli(σ(w* z))`` with ground truth
       ``w* = SPARSE_LOGISTIC_TRUE_WEIGHT = 1``;
    2. ``keep ~ Bernoulli(nonzero_fraction)`` and ``x = keep · z``.

    So a fraction ``1 − nonzero_fraction`` of the examples is sparsified to ``x = 0``:
    their loss is ``log 2`` at every ``w`` and their gradient is exactly ``0``, the
    setting in which AdaGrad (step size decaying with the number of *non-zero*
    gradients seen) beats SGD with a step size decaying in the number of steps. The
    labels of sparsified examples are those drawn from ``z`` before sparsifying, as in
    the seed ("for that fraction of the training data we set x = 0").

    Parameter choices (the seed's inline math was lost in extraction):

    * ``x ~ N(0, 1)`` and ``w* = 1``: the seed reports a ground-truth test loss of
      0.5976 on non-sparsified samples. The Bayes loss ``E[H(σ(w* z))]`` is 0.599 for
      ``z ~ N(0, 1), w* = 1`` (Monte Carlo, 4·10⁶ draws), against 0.664 / 0.527 for
      ``w* = 0.5 / 1.5`` and 0.654 for ``z ~ Uniform[−1, 1], w* = 1``; the standard-normal
      choice with unit weight is the one consistent with the reported figure.
    * ``num_examples = 1000``: as in the seed (one epoch at batch size 1).
    * ``nonzero_fraction = 0.05``: about 50 informative examples among 1000, i.e. a
      strongly sparse gradient stream, so that AdaGrad's effective step count (≈ 50)
      differs from the step count (1000) by more than an order of magnitude.
    * Draws are taken in a fixed order (``z``, then the label uniforms, then the mask
      uniforms), so with the same seed the non-sparsified values do not depend on
      ``nonzero_fraction``. For a test set of non-sparsified samples, call with
      ``nonzero_fraction=1.0`` and a *different* seed.

    Args:
        num_examples: number of examples ``n >= 1``.
        nonzero_fraction: probability that an example keeps its ``x ≠ 0``, in ``[0, 1]``.
        seed: seed of the private ``torch.Generator`` (``>= 0``).

    Returns:
        ``(x, y)``: ``x`` float32 of shape ``(n, 1)``; ``y`` int64 of shape ``(n,)`` in
        ``{0, 1}``.
    """
    n = check_int("num_examples", num_examples, minimum=1)
    if (
        isinstance(nonzero_fraction, bool)
        or not isinstance(nonzero_fraction, numbers.Real)
        or not math.isfinite(float(nonzero_fraction))
        or not 0.0 <= float(nonzero_fraction) <= 1.0
    ):
        raise ValueError(f"nonzero_fraction must be a number in [0, 1], got {nonzero_fraction!r}")
    fraction = float(nonzero_fraction)
    gen = _generator(seed)

    z = torch.randn((n, 1), generator=gen, dtype=torch.float32)
    p_one = torch.sigmoid(SPARSE_LOGISTIC_TRUE_WEIGHT * z.squeeze(1).double())
    y = (torch.rand(n, generator=gen, dtype=torch.float64) < p_one).to(torch.int64)
    keep = torch.rand((n, 1), generator=gen, dtype=torch.float64) < fraction
    x = torch.where(keep, z, torch.zeros((), dtype=torch.float32))
    return x, y


def heavy_tail_mixture(
    *,
    groups: int = 5,
    largest: int = 4096,
    dim: int = 32,
    spread: float = 1.0,
    held_out: int = 64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heavy-tail class imbalance with learnable inputs: seed 003 §3's class sizes, Gaussian classes.

    Class sizes and groups are those of :func:`heavy_tail_data` (group ``k`` has ``2^k`` classes of
    ``L / 2^k`` training examples). Every class ``c`` has a prototype ``μ_c ~ N(0, I_d)``; an example of
    class ``c`` is ``x = μ_c + spread · z`` with ``z ~ N(0, I_d)``. Unlike seed 003's memorization task,
    labels depend on inputs, so a model generalizes, and how well each frequency group is learnt is
    measured on ``held_out`` fresh draws of *every* class (the same number per class, so the rare groups
    are measured as precisely as the frequent ones). ``spread`` sets how much the classes overlap (the
    Bayes accuracy falls as it grows). Training labels are in a uniformly random order.

    Returns ``(x, y, x_test, y_test, class_groups)``: float32 ``(n, d)`` and int64 ``(n,)`` training data
    (n = G·L), float32 ``(c·held_out, d)`` and int64 held-out data, and the group of every class.
    """
    sizes = heavy_tail_class_sizes(groups=groups, largest=largest)
    dim = check_int("dim", dim, minimum=1)
    held_out = check_int("held_out", held_out, minimum=1)
    if isinstance(spread, bool) or not isinstance(spread, numbers.Real) or not math.isfinite(spread) or spread < 0:
        raise ValueError(f"spread must be a finite number >= 0, got {spread!r}")
    gen = _generator(seed)
    class_groups = _class_groups(int(groups))
    prototypes = torch.randn((class_groups.numel(), dim), generator=gen)
    labels = torch.repeat_interleave(torch.arange(class_groups.numel()), sizes)
    y = labels[torch.randperm(labels.numel(), generator=gen)]
    x = prototypes[y] + spread * torch.randn((y.numel(), dim), generator=gen)
    y_test = torch.arange(class_groups.numel()).repeat_interleave(held_out)
    x_test = prototypes[y_test] + spread * torch.randn((y_test.numel(), dim), generator=gen)
    return x, y, x_test, y_test, class_groups


def w1_user_data(user_id: int, examples: int = 32, *, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """User ``user_id``'s examples of W1 (docs/explanation/benchmarks.md): ``x`` ~ N(0, 1) of shape (n, 3, 32, 32) (float32)
    then ``y`` uniform on {0, .., classes − 1}, both from ``torch.Generator().manual_seed(user_id)``.

    Labels are independent of the inputs: W1 measures throughput, not accuracy. Deterministic in the
    user id alone, so every engine (and Flower's own DP simulation) sees the same users.
    """
    gen = _generator(user_id)
    examples = check_int("examples", examples, minimum=1)
    x = torch.randn(examples, 3, 32, 32, generator=gen)
    y = torch.randint(classes, (examples,), generator=gen)
    return x, y


@functools.lru_cache(maxsize=16)
def truncated_zipf(size: int, exponent: float) -> torch.Tensor:
    """The cumulative distribution of a Zipf law truncated to ``1..size``: P(k) = k^(−s) / Σ_{j ≤ size} j^(−s)
    (float64, shape (size,), last entry 1). Draw ``k = searchsorted(cdf, u) + 1`` with ``u ~ U[0, 1)``."""
    size = check_int("size", size, minimum=1)
    if isinstance(exponent, bool) or not isinstance(exponent, numbers.Real) or not math.isfinite(exponent) or exponent < 0:
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
    weights = torch.arange(1, size + 1, dtype=torch.float64).pow(-float(exponent))
    cdf = weights.cumsum(0) / weights.sum()
    cdf[-1] = 1.0
    return cdf


def stackoverflow_like_user(
    user_id: int,
    *,
    vocabulary: int = 10_000,
    length: int = 20,
    max_sequences: int = 64,
    sequences_exponent: float = 1.0,
    tokens_exponent: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor]:
    """User ``user_id`` of a StackOverflow-shaped population: ``(tokens,)``, int64 of shape (n, ``length``).

    Everything comes from one ``torch.Generator`` seeded with ``derive_seed(seed, "stackoverflow-like/<id>")``
    (deterministic in the user id and ``seed``, independent of every other user, so a population of any size
    loads lazily):

    * n, the user's number of sequences, follows a Zipf law truncated to 1..``max_sequences``:
      P(n = k) ∝ k^(−s) with s = ``sequences_exponent`` (s = 1, 64: P(1) = 21%, P(64) = 0.33%, mean 13.5
      sequences: most users hold little, a few hold much, as StackOverflow's posters);
    * every token is drawn from a Zipf law over the vocabulary, P(token v) ∝ (v + 1)^(−``tokens_exponent``)
      (word frequencies), independently of the others. Token ids are 0 .. ``vocabulary`` − 1.

    The data carry no structure to learn: the population measures the cost of private rounds.
    """
    user_id = check_int("user_id", user_id, minimum=0)
    length = check_int("length", length, minimum=2)
    gen = _generator(derive_seed(check_int("seed", seed, minimum=0), f"stackoverflow-like/{user_id}"))
    count_cdf = truncated_zipf(max_sequences, sequences_exponent)
    n = int(torch.searchsorted(count_cdf, torch.rand(1, generator=gen, dtype=torch.float64))) + 1
    token_cdf = truncated_zipf(vocabulary, tokens_exponent)
    tokens = torch.searchsorted(token_cdf, torch.rand(n, length, generator=gen, dtype=torch.float64))
    return (tokens.clamp_(max=vocabulary - 1),)


def markov_chain(vocab: int, *, successors: int = 4, seed: int = 0, shift: float = 0.0,
                 shift_seed: int = 1) -> torch.Tensor:
    """The (vocab, vocab) transition matrix of a sparse first-order Markov language: every token is followed by one
    of ``successors`` tokens drawn uniformly (seeded by ``seed``), with probabilities ∝ 1, 1/2, 1/3, … (a Zipf law
    over its successors). With ``shift`` > 0, a ``shift`` fraction of the rows (chosen and redrawn with
    ``shift_seed``) get other successors: a related language (a domain shift from the first), for the pre-training
    stand-in of docs/tutorials/fine-tune.md (public text from one language, users' text from the shifted one)."""
    vocab = check_int("vocab", vocab, minimum=2)
    successors = check_int("successors", successors, minimum=1)
    if not 0.0 <= shift <= 1.0:
        raise ValueError(f"shift must be in [0, 1], got {shift!r}")
    weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)

    def rows(generator: torch.Generator, count: int) -> torch.Tensor:
        out = torch.zeros(count, vocab, dtype=torch.float64)
        for row in out:
            row[torch.randperm(vocab, generator=generator)[:successors]] = weights
        return out / out.sum(1, keepdim=True)

    matrix = rows(_generator(seed), vocab)
    if shift > 0:
        generator = _generator(shift_seed)
        changed = torch.randperm(vocab, generator=generator)[: round(shift * vocab)]
        matrix[changed] = rows(generator, changed.numel())
    return matrix


def markov_sequences(matrix: torch.Tensor, count: int, length: int, *, seed: int) -> torch.Tensor:
    """(count, length) int64 token sequences of the Markov language ``matrix`` (:func:`markov_chain`): the first
    token uniform, each next one drawn from its row, seeded by ``seed``."""
    count, length = check_int("count", count, minimum=0), check_int("length", length, minimum=1)
    generator = _generator(seed)
    tokens = torch.empty(count, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, matrix.shape[0], (count,), generator=generator)
    for position in range(1, length):
        tokens[:, position] = torch.multinomial(matrix[tokens[:, position - 1]], 1, generator=generator).squeeze(1)
    return tokens
