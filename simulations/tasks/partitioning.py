"""Split a dataset among users with flwr-datasets partitioners.

:func:`partition` turns a label vector into one array of example indices per user. It
builds a Hugging Face ``datasets.Dataset`` with the columns ``label`` (the labels),
``index`` (the position of every example in the caller's dataset) and, for the
``natural-id`` scheme, ``user`` (the natural ids); hands it to a flwr-datasets
partitioner; and reads the ``index`` column of ``load_partition(i)`` for every user
``i`` (the contiguous schemes excepted: see the end of this docstring). Only the indices
come back, so the caller keeps its tensors where they are.

Schemes (every one assigns every example to exactly one user, and every user gets at
least ``min_size`` examples or a ``ValueError`` is raised):

``iid``
    Rows are put in a uniformly random order (``torch.randperm`` with ``seed``) and
    cut into ``num_users`` contiguous shards, as ``IidPartitioner`` cuts them: sizes differ
    by at most one, contents are a uniformly random split.
``dirichlet``
    ``DirichletPartitioner`` on ``label`` (Hsu et al. 2019 / Yurochkin et al. 2019):
    for every class the class's examples are divided among users in proportions
    ``p ~ Dirichlet(alpha · 1_N)``. Small ``alpha`` gives users few classes each, large
    ``alpha`` approaches an IID split. ``self_balancing=True``: a user already holding
    more than ``n / N`` examples receives nothing from later classes. That keeps user
    sizes near ``n / N``, so this scheme isolates label skew from quantity skew (the
    ``power-law`` scheme models the latter), and it makes the minimum-size constraint
    easier to meet. Draws whose smallest user has fewer than ``min_size`` examples are
    redrawn by the partitioner, at most 10 times; if every draw fails a ``ValueError``
    explains what to change. ``N · min_size > n`` is rejected up front.
``natural-id``
    ``NaturalIdPartitioner`` on the given natural ids: one user per distinct id, user
    ``i`` holds the examples of the ``i``-th id in sorted order (deterministic).
    ``num_users`` must equal the number of distinct ids.
``power-law``
    Heavy-tailed user sizes with user 0 the largest. With ``N`` users, ``n`` examples,
    ``m = min_size`` and ``a = exponent``, user ``i`` (``i = 0, …, N−1``) gets

        ``s_i = m + r_i``, where ``r_i`` is ``R · (i+1)^(−a) / Σ_j (j+1)^(−a)`` with
        ``R = n − N·m``, rounded by the largest-remainder method,

    so ``Σ s_i = n`` exactly, ``|r_i − R (i+1)^(−a) / Σ_j (j+1)^(−a)| < 1``, and
    ``s_0 ≥ s_1 ≥ … ≥ s_{N−1} ≥ m`` (ties in the remainders go to the lower user id).
    Rows are put in a uniformly random order (``torch.randperm`` with ``seed``) and
    cut into consecutive blocks of these sizes, as ``SizePartitioner`` cuts them, so the
    examples of every user are a uniformly random subset. ``a = 0`` gives equal sizes.

The two contiguous schemes (``iid``, ``power-law``) are cut with numpy, not read back through
the partitioner one user at a time, which took 1 ms a user (:func:`_blocks`); the tests check
that the blocks are flwr-datasets' own.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fed_dp.validation import check_int, check_nonnegative, check_positive

__all__ = ["SCHEMES", "partition", "partition_sizes", "power_law_sizes"]

#: The partitioning schemes accepted by :func:`partition`.
SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "natural-id", "power-law")

# DirichletPartitioner redraws up to this many extra times before giving up (flwr-datasets
# 0.6: the first draw plus 10 retries). Only used to word the error message.
_DIRICHLET_RETRIES = 10


def _as_1d_array(name: str, values: Any) -> np.ndarray:
    """Convert a tensor / array / sequence to a 1-D numpy array (copy-free where possible)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as err:  # ragged input, …
        raise ValueError(f"{name} must be a one-dimensional array, got {type(values)!r}") from err
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _random_order(n: int, seed: int) -> np.ndarray:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randperm(n, generator=gen).numpy()


def power_law_sizes(n: int, num_users: int, *, exponent: float = 1.5, min_size: int = 1) -> np.ndarray:
    """User sizes of the ``power-law`` scheme (int64, shape ``(num_users,)``, sum ``n``).

    ``s_i = min_size + r_i`` with ``r_i`` the largest-remainder rounding of
    ``(n − num_users·min_size) · (i+1)^(−exponent) / Σ_j (j+1)^(−exponent)``;
    non-increasing in ``i``.
    """
    n = check_int("n", n, minimum=1)
    num_users = check_int("num_users", num_users, minimum=1)
    exponent = check_nonnegative("exponent", exponent)
    min_size = check_int("min_size", min_size, minimum=1)
    if num_users * min_size > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_users} users need at least "
            f"{num_users * min_size} examples but there are only n={n}"
        )
    remaining = n - num_users * min_size
    weights = np.arange(1, num_users + 1, dtype=np.float64) ** (-exponent)
    quotas = remaining * (weights / weights.sum())
    shares = np.floor(quotas).astype(np.int64)
    leftover = remaining - int(shares.sum())
    fractions = quotas - shares
    # Largest remainders first; a stable sort gives ties to the lower user id, which
    # keeps the sizes non-increasing.
    order = np.argsort(-fractions, kind="stable")
    if leftover > 0:
        shares[order[:leftover]] += 1
    elif leftover < 0:  # only possible through floating-point error in the quotas
        for i in order[::-1]:
            if leftover == 0:
                break
            if shares[i] > 0:
                shares[i] -= 1
                leftover += 1
    return min_size + shares


def partition_sizes(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Number of examples held by every user (int64, shape ``(len(parts),)``)."""
    return np.array([len(p) for p in parts], dtype=np.int64)


def partition(
    labels: Any,
    num_users: int,
    scheme: str,
    *,
    seed: int = 0,
    alpha: float = 0.5,
    exponent: float = 1.5,
    natural_ids: Any = None,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Assign every example to one user; return the example indices of users ``0..N−1``.

    Args:
        labels: 1-D integer labels of the ``n`` examples (tensor, array or sequence).
            Only ``dirichlet`` looks at their values; the other schemes use ``n``.
        num_users: number of users ``N``, ``1 <= N <= n``.
        scheme: one of :data:`SCHEMES` (see the module docstring for each law).
        seed: seed (``>= 0``) of the row shuffle (``iid``, ``power-law``) or of the
            partitioner's Dirichlet draws (``dirichlet``); ``natural-id`` is
            deterministic.
        alpha: Dirichlet concentration (``> 0``), ``dirichlet`` only.
        exponent: power-law exponent ``a >= 0``, ``power-law`` only: size ∝ (i+1)^(−a).
        natural_ids: 1-D natural user ids of the ``n`` examples (ints or strings),
            required by ``natural-id`` and rejected by the other schemes.
        min_size: every user must hold at least this many examples (``>= 1``).

    Returns:
        ``parts`` with ``len(parts) == N``; ``parts[i]`` is an int64 array of the
        indices (into ``labels``) of user ``i``'s examples. The arrays are disjoint and
        their union is ``0..n−1``.

    Raises:
        ValueError: on an unknown scheme, a malformed argument, ``N > n``, a
        ``min_size`` that cannot be met, or a ``num_users`` that does not match the
        natural ids.

    Three steps: the arguments are checked (:func:`_checked_request`), the scheme's
    flwr-datasets partitioner is built over the ``label``/``index`` columns
    (:data:`_PARTITIONERS`) and every user's indices are read back and checked
    (:func:`_checked_parts`).
    """
    request = _checked_request(labels, num_users, scheme, seed=seed, alpha=alpha, exponent=exponent,
                               natural_ids=natural_ids, min_size=min_size)
    parts = _PARTITIONERS[scheme](request)
    return _checked_parts(parts, request)


@dataclass(frozen=True)
class _Request:
    """A checked call of :func:`partition`: the labels as int64, ``n``, and the scheme's parameters."""

    labels: np.ndarray
    num_users: int
    scheme: str
    seed: int
    alpha: float
    exponent: float
    natural_ids: np.ndarray | None
    min_size: int

    @property
    def n(self) -> int:
        return int(self.labels.shape[0])


def _checked_request(labels: Any, num_users: int, scheme: str, *, seed: int, alpha: float, exponent: float,
                     natural_ids: Any, min_size: int) -> _Request:
    """Every argument of :func:`partition` checked, with a ``ValueError`` that says what to change."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(map(repr, SCHEMES))}; got {scheme!r}")
    label_array = _as_1d_array("labels", labels)
    n = label_array.shape[0]
    if n == 0:
        raise ValueError("labels must contain at least one example")
    if not (np.issubdtype(label_array.dtype, np.integer) or label_array.dtype == np.bool_):
        raise ValueError(f"labels must be integers, got dtype {label_array.dtype}")
    num_users = check_int("num_users", num_users, minimum=1)
    if num_users > n:
        raise ValueError(f"num_users={num_users} exceeds the number of examples n={n}")
    seed = check_int("seed", seed, minimum=0)
    min_size = check_int("min_size", min_size, minimum=1)
    alpha = check_positive("alpha", alpha)
    exponent = check_nonnegative("exponent", exponent)
    if scheme != "natural-id" and natural_ids is not None:
        raise ValueError(f"natural_ids is only used by scheme 'natural-id', not {scheme!r}")
    if scheme != "natural-id" and num_users * min_size > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_users} users need at least "
            f"{num_users * min_size} examples but there are only n={n}"
        )
    ids = _checked_natural_ids(natural_ids, n, num_users) if scheme == "natural-id" else None
    return _Request(label_array.astype(np.int64), num_users, scheme, seed, alpha, exponent, ids, min_size)


def _checked_natural_ids(natural_ids: Any, n: int, num_users: int) -> np.ndarray:
    """One natural id per example (ints or strings), with exactly ``num_users`` distinct ids."""
    if natural_ids is None:
        raise ValueError("scheme 'natural-id' needs natural_ids (one id per example)")
    id_array = _as_1d_array("natural_ids", natural_ids)
    if id_array.shape[0] != n:
        raise ValueError(
            f"natural_ids has {id_array.shape[0]} entries but labels has {n}; "
            f"give one natural id per example"
        )
    if id_array.dtype.kind not in "biuU":
        raise ValueError(f"natural_ids must be integers or strings, got dtype {id_array.dtype}")
    distinct = len(np.unique(id_array))
    if distinct != num_users:
        raise ValueError(
            f"num_users={num_users} must equal the number of distinct natural ids, "
            f"which is {distinct}"
        )
    return id_array.astype(np.int64) if id_array.dtype.kind in "biu" else id_array


def _columns(request: _Request, order: np.ndarray | None = None, **more: np.ndarray) -> Any:
    """The ``label`` and ``index`` columns (rows in ``order`` if given, plus ``more``) as a Hugging Face
    ``datasets.Dataset``, the form flwr-datasets partitioners read. Imported here so that importing this module
    stays cheap."""
    import datasets

    index = np.arange(request.n, dtype=np.int64)
    rows = slice(None) if order is None else order
    return datasets.Dataset.from_dict({"label": request.labels[rows], "index": index[rows], **more})


def _blocks(order: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """``order`` cut into consecutive blocks of ``sizes``: what flwr-datasets' contiguous partitioners
    (``IidPartitioner``, ``SizePartitioner``) return for a dataset in that order, computed at once. Reading the
    blocks back through the partitioner costs about 1 ms per user (a Hugging Face dataset and its fingerprint per
    partition): 14 s of the main job's start-up for its 14,336 users. The tests check that the blocks are the
    partitioner's."""
    return [block.astype(np.int64, copy=False) for block in np.split(order, np.cumsum(sizes)[:-1])]


def iid_sizes(n: int, num_users: int) -> np.ndarray:
    """The sizes of ``IidPartitioner``'s contiguous shards of ``n`` rows: ``n // N``, the first ``n mod N`` one more."""
    return n // num_users + (np.arange(num_users) < n % num_users)


def _iid(request: _Request) -> list[np.ndarray]:
    """Shuffled rows cut into ``N`` shards of sizes that differ by at most one (``IidPartitioner``'s shards)."""
    return _blocks(_random_order(request.n, request.seed), iid_sizes(request.n, request.num_users))


def _power_law(request: _Request) -> list[np.ndarray]:
    """Shuffled rows cut into blocks of :func:`power_law_sizes` (``SizePartitioner``'s blocks)."""
    sizes = power_law_sizes(request.n, request.num_users, exponent=request.exponent, min_size=request.min_size)
    return _blocks(_random_order(request.n, request.seed), sizes)


def _dirichlet(request: _Request) -> list[np.ndarray]:
    """Every class divided among users in ``Dirichlet(alpha · 1_N)`` proportions, self-balancing, redrawn by the
    partitioner until every user holds ``min_size`` examples (``DirichletPartitioner``)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions=request.num_users,
        partition_by="label",
        alpha=request.alpha,
        min_partition_size=request.min_size,
        self_balancing=True,
        shuffle=True,
        seed=request.seed,
    )
    partitioner.dataset = _columns(request)
    with warnings.catch_warnings():
        # The partitioner warns on every redraw; the outcome is reported below.
        warnings.filterwarnings("ignore", message=re.escape("The specified min_partition_size"))
        try:
            return _load_all(partitioner, request.num_users)
        except ValueError as err:
            raise ValueError(
                f"dirichlet: no draw out of {_DIRICHLET_RETRIES + 1} gave every one of "
                f"the {request.num_users} users at least min_size={request.min_size} examples "
                f"(n={request.n}, {len(np.unique(request.labels))} classes, alpha={request.alpha}); "
                f"increase alpha, or decrease num_users or min_size"
            ) from err


def _natural_id(request: _Request) -> list[np.ndarray]:
    """One user per distinct natural id, in sorted id order (``NaturalIdPartitioner``)."""
    from flwr_datasets.partitioner import NaturalIdPartitioner

    partitioner = NaturalIdPartitioner(partition_by="user")
    partitioner.dataset = _columns(request, user=request.natural_ids)
    return _load_all(partitioner, request.num_users)


#: Scheme → the step that builds its partitioner and reads every user's indices.
_PARTITIONERS: dict[str, Callable[[_Request], list[np.ndarray]]] = {
    "iid": _iid, "power-law": _power_law, "dirichlet": _dirichlet, "natural-id": _natural_id,
}


def _checked_parts(parts: list[np.ndarray], request: _Request) -> list[np.ndarray]:
    """``parts`` if they assign every example exactly once and every user holds ``min_size`` examples."""
    sizes_found = partition_sizes(parts)
    if int(sizes_found.sum()) != request.n or len(np.unique(np.concatenate(parts))) != request.n:
        raise RuntimeError(f"{request.scheme}: the partitioner did not assign every example exactly once")
    too_small = np.flatnonzero(sizes_found < request.min_size)
    if too_small.size:
        first = int(too_small[0])
        raise ValueError(
            f"{request.scheme}: {too_small.size} users hold fewer than min_size={request.min_size} examples "
            f"(e.g. user {first} holds {int(sizes_found[first])})"
        )
    return parts


def _load_all(partitioner: Any, num_users: int) -> list[np.ndarray]:
    """Read the ``index`` column of every partition as an int64 array."""
    parts = []
    for user in range(num_users):
        rows = partitioner.load_partition(user)
        if len(rows) == 0:
            parts.append(np.empty(0, dtype=np.int64))
            continue
        table = rows.with_format("arrow", columns=["index"])[:]
        parts.append(table["index"].to_numpy().astype(np.int64, copy=False))
    return parts
