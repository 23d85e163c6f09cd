"""Users whose update is one gradient step: the clipped sum of many users without a model per user.

When local training is a single full-batch SGD step (one epoch of one minibatch holding all of the user's m
examples, or ``steps = 1`` with such a batch; no weight decay), user u's update is

    Δ_u = −η · g_u,    g_u = ∇_θ L_u(θ),    L_u = Σ_{i∈u} a_i / max(Σ_{i∈u} b_i, 1)

where (a_i, b_i) are the loss's per-example numerator and denominator (``loss.per_example``; for a mean
cross-entropy a_i = ℓ_i, b_i = 1). That is DP-SGD written as federated learning: seed 003's one-example users
(per-example DP is user-level DP with one example per user) and many cross-device configurations. The node
must send Σ_u clip(Δ_u, ζ) (and Σ_u clip(Δ_u, ζ)² for independent moment estimation, or the clip of s ⊙ Δ_u for
scale-then-privatize), which needs each user's norm ‖Δ_u‖ but not Δ_u itself.

How (Goodfellow 2015, per-example gradient norms; Li et al. 2022, ghost clipping; Bu et al. 2023, book-keeping):
one forward pass of a whole chunk of users' examples and one backward pass from J = Σ_u L_u to every layer's
output give, for each layer, its inputs x and output gradients δ at every example and position. A layer's
gradient for user u is a function of the rows of u alone:

    Linear, Conv (as a Linear on unfolded patches)   G_u = Σ_{q∈u} δ_q x_qᵀ         (q: examples × positions)
    Embedding                                       G_u[v] = Σ_{q∈u, token_q = v} δ_q
    LayerNorm, GroupNorm                             G_u = Σ_{q∈u} δ_q ⊙ x̂_q  (weight),  Σ_{q∈u} δ_q  (bias)

and the squared norm of a Linear's G_u needs no G_u ("ghost norm"): ‖G_u‖² = Σ_{q,r∈u} (x_qᵀx_r)(δ_qᵀδ_r), which
is ‖x‖²‖δ‖² for one position. With w_u = min(1, ζ / (η‖g_u‖)) from ‖g_u‖² = Σ_layers ‖G_u‖², the node's clipped
sum of a Linear is −η Σ_q w_{u(q)} δ_q x_qᵀ: one matrix product of the re-weighted output gradients with the
stored inputs (book-keeping: no second backward pass). Where the Gram matrix over a user's positions would cost
more than the gradient itself (long sequences), or where the per-coordinate geometry of scale-then-privatize or
the squares of moment estimation need G_u, G_u is materialized for a chunk of users at a time.

The clip holds for what is released, as on the other paths (``fed_dp.clipping``; docs/explanation/floating-point.md,
"One step"): each user's norm N̄_u is an upper bound of ‖Δ_u‖ computed in float64 with a proved error term
(:class:`_SquaredNorms`: squares of float32 values are exact in float64, sums of n nonnegative terms err by γ_n
relative, Gram sums — where cancellation can occur — by γ·P_u² absolute with P_u = Σ_q ‖x_q‖‖δ_q‖ ≥ ‖G_u‖). The
node's sum, though, is a product over all users' rows, whose rounding grows with P_u, not with ‖G_u‖: where a user
has several rows it is formed in float64, and the factor comes from a bound of what the sum releases for that user
(:func:`_release_bounds`: N̄_u plus 2⁻²⁴·P_u, with room for the float32 roundings), through ``clip_factors``, rounded
towards 0 into float32. A user alone at a node is released within ζ in float64 whatever its rows; between users
the node's sum (float64, rounded once) adds the rounding of a sum.

Results equal the sequential path's (``clients.training.users_contribution``) up to float32 rounding (the tests
compare them per layer type). What this path cannot train is said once in the log and those users go the usual
way: layers with parameters other than Linear, Embedding, Conv1d/2d, LayerNorm and GroupNorm; parameters used
outside the forward of their module, shared between modules, or not float32; BatchNorm and active dropout;
in-place changes of a layer's input or output; a loss without ``per_example``. The first chunk a model trains
here is checked against autograd's own gradient of J (the sum over users), so a parameter used in a way the
hooks cannot see is found before any update is released.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clients.task import Examples, Loss
from fed_dp.clients.training import (LocalRound, UserExamples, check_finite_loss, examples_used, local_schedule,
                                     node_metrics)
from fed_dp.clipping import clip_factors, round_down_float32, row_norms
from fed_dp.config import LocalTraining
from fed_dp.contribution import Contribution
from fed_dp.flat import FLAT_DTYPE, ParamLayout

log = logging.getLogger("fed_dp.clients")

__all__ = ["DEFAULT_CHUNK_BYTES", "Unsupported", "one_step", "one_step_users", "unsupported_reason", "users_contribution"]

#: Memory a chunk of users may take for its stacked examples, layer activations and materialized gradients.
DEFAULT_CHUNK_BYTES = 512 * 2**20
#: Layers whose parameters this path trains (a module of another type with parameters of its own sends the
#: node's users the usual way).
SUPPORTED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.LayerNorm, nn.GroupNorm)


#: What ``training_paths.contribution``'s auto choice lets this path spend per user on norms beyond a per-user path's
#: own work (:meth:`_PerUser.extra_macs`): 2^20 multiply-adds. Measured on 2 CPU cores, one torch thread, against
#: the sequential path: closed-form norms (seed 003's one-example users, rank one) and small Gram matrices (the
#: main job's two-example users, Q = 2) make this path 10-30x faster; materializing G_u over hundreds of positions
#: made it 2x slower (a 10,000-word output layer, ~260 tokens a user: 15.6M extra per user) and 6x slower (the W1
#: CNN's convolutions, 32 images a user), so those users train with a model per user.
AUTO_MAX_EXTRA_MACS = 2**20


class Unsupported(Exception):
    """This model or loss cannot be trained on this path (the message says why)."""


# --- which users and which models ------------------------------------------------------------------------------

def one_step(training: LocalTraining, n: int) -> bool:
    """Whether a user with n examples trains one full-batch step: one minibatch of all m = min(n, cap) examples
    (the permutation of that minibatch does not change its gradient), and no weight decay (momentum does not act
    on a first step)."""
    m = examples_used(training, n)
    return m > 0 and not training.weight_decay and local_schedule(training, n) == [(0, 0, m)]


def one_step_users(users: Sequence[UserExamples], training: LocalTraining) -> tuple[list[UserExamples], list[UserExamples]]:
    """(users this path trains, the others): split by :func:`one_step` (decided once per number of examples)."""
    decided: dict[int, bool] = {}
    mine, others = [], []
    for user in users:
        n = len(user[1])
        fits = decided.get(n)
        if fits is None:
            fits = decided[n] = one_step(training, n)
        (mine if fits else others).append(user)
    return mine, others


def unsupported_reason(model: nn.Module, loss: Loss) -> str:
    """Why this path cannot train ``model`` with ``loss`` ("" when it can), from their structure alone."""
    if getattr(loss, "per_example", None) is None:
        return (f"the loss {getattr(loss, '__name__', type(loss).__name__)} has no per_example attribute (its "
                "per-example numerators and denominators; fed_dp.losses' losses have one)")
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"the model contains BatchNorm ({name}): its statistics mix the examples of different users"
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return f"the model has active dropout ({name}): its masks would differ from one-user-at-a-time training"
        own = [(pname, p) for pname, p in module.named_parameters(recurse=False) if p.requires_grad]  # frozen: no G_u
        if own and not isinstance(module, SUPPORTED):
            return f"layer {name or '<root>'} ({type(module).__name__}) has parameters and is not one of " \
                   f"{', '.join(t.__name__ for t in SUPPORTED)}"
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and (module.groups != 1 or module.padding_mode != "zeros"):
            return f"convolution {name} has groups={module.groups}, padding_mode={module.padding_mode!r}"
        for pname, p in own:
            if id(p) in owners:
                return f"parameter {name}.{pname} is shared with {owners[id(p)]}"
            owners[id(p)] = f"{name}.{pname}"
            if p.dtype != FLAT_DTYPE:
                return f"parameter {name}.{pname} has dtype {p.dtype} (this path trains in {FLAT_DTYPE})"
    return ""


@contextlib.contextmanager
def float32_matmul_exactly() -> Iterator[None]:
    """float32 matrix products in full float32 (``torch.set_float32_matmul_precision("highest")``) for the duration: the
    node's sums are bounded for IEEE float32 products, which TF32 on a GPU (10-bit significands) or bfloat16 passes
    on a CPU would not be. The caller's setting is restored."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# --- what the hooks record -------------------------------------------------------------------------------------

@dataclass
class _Call:
    """One call of a supported layer: its input, its output (whose gradient the backward pass gives) and the
    versions of both, to detect in-place changes after the call."""

    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor
    versions: tuple[int, int]
    grad: torch.Tensor | None = None


@dataclass
class _Recorder:
    calls: list[_Call] = field(default_factory=list)

    def hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        x = inputs[0]
        self.calls.append(_Call(module, x, output, (x._version, output._version)))


# --- per-user gradients of one parameter, in the form that makes them cheapest ----------------------------------

_U64 = 2.0**-53  # unit roundoff of float64


@dataclass(frozen=True)
class _SquaredNorms:
    """Computed ‖s ⊙ G_u‖² of the users of a chunk (``value``, float64) with an error bound: the exact value is at
    most ``value + error``. ``terms``: the most float64 operations any one result went through (for γ)."""

    value: torch.Tensor
    error: torch.Tensor

    def __add__(self, other: "_SquaredNorms") -> "_SquaredNorms":
        return _SquaredNorms(self.value + other.value, self.error + other.error)


def _gamma(operations: int) -> float:
    """γ_h = h·u/(1 − h·u): the relative error bound of h float64 operations on the way to a result (Higham 2002,
    §3.1, for sums in any order and products)."""
    h = operations * _U64
    return h / (1 - h)


#: Users whose float32 products one matrix product sums before the block is added in float64 (a sum over users).
SUM_BLOCK = 1024
#: The smallest normal float32 number: below it, a product's rounding is absolute (2⁻¹⁵⁰), not relative.
_FLOAT32_TINY = 2.0**-126


def _blockwise(users: int, part: Callable[[slice], torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    """Σ over blocks of :data:`SUM_BLOCK` users of ``part(users)`` (a flat float32 or float64 vector of ``size``),
    added in float64."""
    total = torch.zeros(size, dtype=torch.float64, device=device)
    for start in range(0, users, SUM_BLOCK):
        total += part(slice(start, start + SUM_BLOCK)).reshape(-1)
    return total


def _exact_squares(t: torch.Tensor) -> torch.Tensor:
    """t² in float64: exact for float32 (and narrower) input, whose 24-bit significands square into 48 bits."""
    return t.double().square()


def _summed(squares: torch.Tensor, dim) -> _SquaredNorms:
    """Σ of nonnegative float64 terms along ``dim``, each term within γ_3 of exact: error ≤ γ_(n+3)·value."""
    value = squares.sum(dim)
    n = math.prod(squares.shape[d] for d in ((dim,) if isinstance(dim, int) else dim))
    return _SquaredNorms(value, value * _gamma(n + 3))


def _squared_bounds(norm_bounds: torch.Tensor, operations: int = 1) -> _SquaredNorms:
    """Squared norms from float64 upper bounds of the norms (``fed_dp.clipping.row_norms``, proved there), computed
    with ``operations`` float64 roundings (the products and the square)."""
    value = norm_bounds.square()
    return _SquaredNorms(value, value * _gamma(operations + 1))


class _PerUser:
    """The gradients G_u of one parameter for the C users of a chunk (row-major over the parameter's shape)."""

    def norm_sq(self, scale_sq: torch.Tensor | None) -> _SquaredNorms:  # ‖s ⊙ G_u‖², bounded
        raise NotImplementedError

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:  # Σ_u w_u G_u, flat, float64
        raise NotImplementedError

    def weighted_squares(self, w_sq: torch.Tensor) -> torch.Tensor:  # Σ_u w_u² G_u ⊙ G_u, flat, float64
        """In float64 on every form: the squares of float32 values are exact there (a float32 square overflows above
        1.8·10¹⁹, and 0·∞ would be NaN), and a sum of nonnegative terms rounds by a relative γ only."""
        raise NotImplementedError

    def release_error(self, scale_max: float) -> torch.Tensor | float:
        """E_u: the part of each user's term V_u of :meth:`weighted_sum` (and of its squares) that the float64 arithmetic
        before the final rounding to float32 may add beyond w_u·G_u, per unit |w_u| and in the scaled geometry:
        ‖s ⊙ V_u − w_u·s ⊙ G_u‖ ≤ |w_u|·E_u. 0 where each term is one float32 product of a materialized value (the
        margin of ``clip_factors`` and of :func:`_release_bounds` covers its roundings)."""
        return 0.0

    def extra_macs(self, scaled: bool, squares: bool) -> int:
        """Multiply-adds this path spends on the chunk's norms and squares beyond what training the users one at a
        time would (their backward pass forms each G_u once anyway): 0 where G_u is a closed form or small."""
        return 0


@dataclass
class _Dense(_PerUser):
    """G_u materialized: (C, numel). The node's sum is built from these very values."""

    grads: torch.Tensor

    def norm_sq(self, scale_sq):
        if scale_sq is None:
            return _squared_bounds(row_norms(self.grads))
        return _summed(_exact_squares(self.grads) * scale_sq.double(), 1)

    def weighted_sum(self, w):
        """float32 products of at most :data:`SUM_BLOCK` users at a time, added in float64 (a float32 sum over a
        chunk of 20,000 aligned users erred by 5% of ζ; a block's, by at most γ_1024 relative)."""
        return _blockwise(self.grads.shape[0], lambda users: w[users] @ self.grads[users], self.grads.shape[1],
                          self.grads.device)

    def weighted_squares(self, w_sq):
        return w_sq.double() @ self.grads.double().square()


@dataclass
class _Outer(_PerUser):
    """G_u = Σ_q δ_{u,q} x_{u,q}ᵀ with x: (C, Q, k) and δ: (C, Q, o); the parameter is (o, k) row-major.

    The node's sum is one product over every user's rows, so the bound must hold for the exact G_u of these
    float32 inputs: with P_u = Σ_q ‖x_q‖‖δ_q‖ ≥ ‖G_u‖, the rank-one form is exact up to roundings of
    nonnegative terms, the Gram form errs by at most γ·P_u² (cancellation is covered: the bound is absolute), and
    a G_u built in float64 errs by at most γ_Q·P_u in norm. Where G_u must be materialized, it is, in float64, for
    blocks of users whose gradients take at most ``block_bytes``."""

    x: torch.Tensor
    d: torch.Tensor
    block_bytes: int = 64 * 2**20

    def _rank_one(self) -> bool:
        return self.x.shape[1] == 1

    def _blocks(self, dtype: torch.dtype = FLAT_DTYPE) -> Iterator[tuple[slice, torch.Tensor]]:
        """(users, their G_u as (c, o·k) in ``dtype``) for consecutive blocks of users."""
        per_user = self.x.shape[2] * self.d.shape[2] * (8 if dtype == torch.float64 else self.x.element_size())
        size = max(1, self.block_bytes // per_user)
        for start in range(0, self.x.shape[0], size):
            users = slice(start, start + size)
            x, d = self.x[users].to(dtype), self.d[users].to(dtype)
            yield users, torch.bmm(d.transpose(1, 2), x).flatten(1)

    def dense(self) -> torch.Tensor:
        return torch.cat([grads for _, grads in self._blocks()])

    def _p(self) -> torch.Tensor:
        """P_u = Σ_q ‖x_q‖‖δ_q‖ (an upper bound of ‖G_u‖ and of the sum of |entries| the roundings scale with)."""
        users, q = self.x.shape[:2]
        x = row_norms(self.x.flatten(0, 1)).view(users, q)
        d = row_norms(self.d.flatten(0, 1)).view(users, q)
        return (x * d).sum(1) * (1 + _gamma(q + 2))

    def norm_sq(self, scale_sq):
        q, k, o = self.x.shape[1], self.x.shape[2], self.d.shape[2]
        if self._rank_one():  # ‖δ xᵀ‖² = ‖δ‖²‖x‖²; with s: Σ_jk s²_jk δ_j² x_k² = (δ²)ᵀ S² (x²)
            if scale_sq is None:
                return _squared_bounds(row_norms(self.x[:, 0]) * row_norms(self.d[:, 0]), operations=3)
            x2, d2 = _exact_squares(self.x[:, 0]), _exact_squares(self.d[:, 0])
            value = ((d2 @ scale_sq.double().view(o, k)) * x2).sum(1)  # nonnegative terms throughout
            return _SquaredNorms(value, value * _gamma(k + o + 8))
        if scale_sq is None and self.ghost_cheaper():  # Σ_{q,r} (x_qᵀx_r)(δ_qᵀδ_r), in float64
            x, d = self.x.double(), self.d.double()
            value = (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
            return _SquaredNorms(value, self._p().square() * _gamma(k + o + q * q + 8))
        norms = []
        for users, grads in self._blocks(torch.float64):  # Ĝ_u within γ_Q·P_u of G_u (Frobenius)
            squares = grads.square() if scale_sq is None else grads.square() * scale_sq.double()
            norms.append(_summed(squares, 1))
        computed = _SquaredNorms(torch.cat([n.value for n in norms]), torch.cat([n.error for n in norms]))
        scale_max = 1.0 if scale_sq is None else float(scale_sq.double().max().sqrt()) * (1 + 4 * _U64)
        e = self._p() * scale_max * _gamma(q + 2)  # ‖s ⊙ (G − Ĝ)‖ ≤ max s · γ_Q P
        root = (computed.value + computed.error).sqrt() * (1 + 2 * _U64)
        return _SquaredNorms(computed.value, computed.error + (2 * root * e + e.square()) * (1 + 8 * _U64))

    def extra_macs(self, scaled, squares):
        """Rank one: none. Otherwise the Gram matrices, C·Q²·(k + o), where they give the norm; G_u materialized,
        C·Q·k·o (float64), where they do not or where the scale needs G_u; once more (float32) for the squares."""
        c, q, k = self.x.shape
        o = self.d.shape[2]
        if self._rank_one():
            return 0
        norms = c * q * q * (k + o) if not scaled and self.ghost_cheaper() else c * q * k * o
        return norms + (c * q * k * o if squares else 0)

    def ghost_cheaper(self) -> bool:
        """Gram matrices (Q² (k + o) per user) against the gradient itself (Q k o per user)."""
        q, k, o = self.x.shape[1], self.x.shape[2], self.d.shape[2]
        return q * (k + o) < k * o

    def _row_blocks(self) -> Iterator[slice]:
        """Consecutive blocks of users whose rows in float64 take at most ``block_bytes``."""
        per_user = self.x.shape[1] * (self.x.shape[2] + self.d.shape[2]) * 8
        size = max(1, self.block_bytes // per_user)
        return (slice(start, start + size) for start in range(0, self.x.shape[0], size))

    def weighted_sum(self, w):
        """Σ_u w_u G_u. Rank one: float32 products of the re-weighted δ with x, :data:`SUM_BLOCK` users at a time, added
        in float64 (each user's term is fl(fl(w_u δ_j) x_k), two roundings, covered by :func:`_release_bounds`; where a
        product w_u δ_j would fall below float32's normal range, whose rounding is absolute, the chunk takes the float64
        form). Otherwise in float64, block by block of
        users: w_u δ_q is exact in float64 (two float32 factors) and every term of the sum over the n rows of the
        chunk goes through at most n + (blocks) roundings, so user u's part of the result is within
        γ_(n+blocks+2)·|w_u|·P_u of w_u·G_u (Higham 2002, §3.1), however much its rows cancel
        (:meth:`release_error`)."""
        if self._rank_one():
            weighted = self.d[:, 0] * w.to(self.d.dtype).unsqueeze(1)  # (C, o): fl(w_u δ_j)
            if not bool(((weighted.abs() < _FLOAT32_TINY) & (self.d[:, 0] != 0)).any()):
                return _blockwise(self.x.shape[0], lambda users: (weighted[users].T @ self.x[users, 0]).flatten(),
                                  self.d.shape[2] * self.x.shape[2], self.x.device)
            # a product w_u δ_j below float32's normal range rounds by an absolute 2⁻¹⁵⁰, not a relative 2⁻²⁴: in float64
        total = torch.zeros(self.d.shape[2], self.x.shape[2], dtype=torch.float64, device=self.x.device)
        for users in self._row_blocks():
            d = (self.d[users].double() * w[users].double().view(-1, 1, 1)).flatten(0, 1)
            total.addmm_(d.T, self.x[users].double().flatten(0, 1))
        return total.flatten()

    def weighted_squares(self, w_sq):
        """Σ_u w_u² G_u ⊙ G_u. Rank one: (w_u² δ_u²)(x_u²)ᵀ (no cancellation: every term is a product of squares).
        Otherwise from G_u materialized in float64 (:meth:`_blocks`, within γ_(Q+2)·P_u of G_u), so the squares of a
        user whose rows cancel are those of a vector within the released bound (a float32 G_u would carry 2⁻²⁴·P_u of
        rounding into them)."""
        if self._rank_one():  # Σ_u w_u² (δ_u²)(x_u²)ᵀ
            weighted = self.d[:, 0].double().square() * w_sq.double().unsqueeze(1)
            return (weighted.T @ self.x[:, 0].double().square()).flatten()
        return sum(w_sq[users].double() @ grads.square() for users, grads in self._blocks(torch.float64))

    def release_error(self, scale_max):
        """E_u = 2⁻²⁴·max(s)·P_u for Q > 1; 0 for rank one (no user has two rows to cancel). 2⁻²⁴ ≥ γ_h with
        h = n + blocks + Q + 4 (the float64 weighted sum, the float64 G_u of the squares, the scale's product) for any
        chunk of fewer than 2²⁸ rows, so it covers that rounding; and, being float32's own unit, it keeps
        |w_u|·P_u ≤ 2²⁴·ζ for every user, so no user's rows can put more than 2γ_h·2²⁴·ζ (h·2⁻²⁸·ζ) into the
        rounding of another user's terms: the order of a float32 sum's own rounding."""
        if self._rank_one():
            return 0.0
        rows = self.x.shape[0] * self.x.shape[1]
        h = rows + sum(1 for _ in self._row_blocks()) + self.x.shape[1] + 4
        if _gamma(h) > 2.0**-24:
            raise Unsupported(f"a chunk of {rows} rows is too large for the release bound (at most 2^28 rows)")
        return self._p() * (scale_max * 2.0**-24)


@dataclass
class _Rows(_PerUser):
    """An embedding's G_u: row v is Σ of δ_q over u's positions q with token v. ``rows`` (K, e) holds every
    (user, token) pair's row once, ``owner`` (K,) its user, ``token`` (K,) its token; the parameter is (V, e). The
    node's sum is built from these very rows."""

    rows: torch.Tensor
    owner: torch.Tensor
    token: torch.Tensor
    vocabulary: int
    users: int

    def norm_sq(self, scale_sq):
        if scale_sq is None:  # per row an upper bound of its squared norm, summed over each user's rows
            per_row, terms = _squared_bounds(row_norms(self.rows)).value, 2
        else:
            per_row = (_exact_squares(self.rows) * scale_sq.double().view(self.vocabulary, -1)[self.token]).sum(1)
            terms = self.rows.shape[1] + 3
        value = torch.zeros(self.users, dtype=torch.float64, device=self.rows.device)
        value.index_add_(0, self.owner, per_row)
        most = int(torch.bincount(self.owner, minlength=self.users).max()) if self.owner.numel() else 0
        return _SquaredNorms(value, value * _gamma(most + terms + 2))

    def _scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """Each (user, token) row added into its token's row, in ``rows``' dtype (float64: a user's term is its float32
        product, the sum over users float64)."""
        out = torch.zeros(self.vocabulary, rows.shape[1], dtype=rows.dtype, device=rows.device)
        return out.index_add_(0, self.token, rows).flatten()

    def weighted_sum(self, w):
        return self._scatter((self.rows * w.to(self.rows.dtype)[self.owner].unsqueeze(1)).double())

    def weighted_squares(self, w_sq):
        return self._scatter(self.rows.double().square() * w_sq.double()[self.owner].unsqueeze(1))


# --- each layer type's per-user gradients from one call's input and output gradient ----------------------------

def _positions(t: torch.Tensor, users: int) -> torch.Tensor:
    """(C·m, *, f) → (C, m·P, f): every user's examples and positions as rows."""
    return t.reshape(users, -1, t.shape[-1])


def _weight_and_bias(module: nn.Module, x: torch.Tensor, d: torch.Tensor) -> dict[str, _PerUser]:
    """A Linear-like layer's per-user gradients from its per-user rows x (C, Q, k) and δ (C, Q, o): the weight's
    Σ_q δ_q x_qᵀ and the bias's Σ_q δ_q."""
    grads: dict[str, _PerUser] = {"weight": _Outer(x, d)}
    if module.bias is not None:
        grads["bias"] = _Dense(d.sum(1))
    return grads


def _linear(call: _Call, users: int) -> dict[str, _PerUser]:
    return _weight_and_bias(call.module, _positions(call.input, users), _positions(call.grad, users))


def _conv(call: _Call, users: int) -> dict[str, _PerUser]:
    module = call.module
    x, d = call.input, call.grad
    if isinstance(module, nn.Conv1d):  # as a convolution of height 1
        x, d = x.unsqueeze(2), d.unsqueeze(2)
        kernel, stride, padding, dilation = ((1,) + module.kernel_size, (1,) + module.stride,
                                             (0,) + tuple(module.padding), (1,) + module.dilation)
    else:
        kernel, stride, padding, dilation = module.kernel_size, module.stride, module.padding, module.dilation
    if isinstance(padding, str):
        raise Unsupported(f"convolution with padding={padding!r}")
    patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (N, k, P)
    xs = _positions(patches.transpose(1, 2), users)  # (C, m·P, k)
    ds = _positions(d.flatten(2).transpose(1, 2), users)  # (C, m·P, o)
    return _weight_and_bias(module, xs, ds)


def _embedding(call: _Call, users: int) -> dict[str, _PerUser]:
    module = call.module
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise Unsupported("embedding with max_norm, scale_grad_by_freq or sparse gradients")
    tokens = call.input.reshape(users, -1)
    d = call.grad.reshape(users, tokens.shape[1], -1)
    owner = torch.arange(users, device=tokens.device).unsqueeze(1).expand_as(tokens)
    keep = tokens != module.padding_idx if module.padding_idx is not None else torch.ones_like(tokens, dtype=torch.bool)
    key = (owner * module.num_embeddings + tokens)[keep]
    pairs, inverse = torch.unique(key, return_inverse=True)
    rows = torch.zeros(pairs.numel(), d.shape[2], dtype=d.dtype, device=d.device).index_add_(0, inverse, d[keep])
    return {"weight": _Rows(rows, pairs // module.num_embeddings, pairs % module.num_embeddings,
                            module.num_embeddings, users)}


def _normalized(call: _Call) -> torch.Tensor:
    """x̂ of a LayerNorm or GroupNorm call: its input normalized without the affine part."""
    module, x = call.module, call.input
    with torch.no_grad():
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        return F.group_norm(x, module.num_groups, None, None, module.eps)


def _norm_layer(call: _Call, users: int) -> dict[str, _PerUser]:
    module, d = call.module, call.grad
    x_hat = _normalized(call)
    if isinstance(module, nn.LayerNorm):  # affine over the trailing normalized_shape, positions before it
        k = math.prod(module.normalized_shape)
        weight = (d * x_hat).reshape(users, -1, k).sum(1)
        bias = d.reshape(users, -1, k).sum(1)
    else:  # GroupNorm: per channel (dim 1), summed over every other position
        c = module.num_channels
        weight = (d * x_hat).reshape(users, -1, c, *d.shape[2:]).transpose(1, 2).reshape(users, c, -1).sum(2)
        bias = d.reshape(users, -1, c, *d.shape[2:]).transpose(1, 2).reshape(users, c, -1).sum(2)
    grads: dict[str, _PerUser] = {}
    if module.weight is not None:
        grads["weight"] = _Dense(weight)
    if module.bias is not None:
        grads["bias"] = _Dense(bias)
    return grads


_LAYERS: dict[type, Callable[[_Call, int], dict[str, _PerUser]]] = {
    nn.Linear: _linear, nn.Conv1d: _conv, nn.Conv2d: _conv, nn.Embedding: _embedding,
    nn.LayerNorm: _norm_layer, nn.GroupNorm: _norm_layer,
}


def _combine(parts: list[_PerUser]) -> _PerUser:
    """A parameter's per-user gradients over several calls of its layer (a layer applied more than once)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, _Outer) for p in parts):
        return _Outer(torch.cat([p.x for p in parts], 1), torch.cat([p.d for p in parts], 1))
    if all(isinstance(p, _Rows) for p in parts):
        first = parts[0]
        key = torch.cat([p.owner * first.vocabulary + p.token for p in parts])
        pairs, inverse = torch.unique(key, return_inverse=True)
        rows = torch.zeros(pairs.numel(), first.rows.shape[1], dtype=first.rows.dtype, device=first.rows.device)
        rows.index_add_(0, inverse, torch.cat([p.rows for p in parts]))
        return _Rows(rows, pairs // first.vocabulary, pairs % first.vocabulary, first.vocabulary, first.users)
    return _Dense(sum(p.dense() if isinstance(p, _Outer) else p.grads for p in parts))  # type: ignore[union-attr]


# --- one chunk of users -----------------------------------------------------------------------------------------

@dataclass
class _Chunk:
    """What one forward and backward pass of a chunk gives: each parameter's per-user gradients (by layout name)
    and every user's loss L_u."""

    grads: dict[str, _PerUser]
    losses: torch.Tensor  # (C,)


def _user_losses(loss: Loss, model: nn.Module, examples: Examples, users: int) -> torch.Tensor:
    """L_u = Σ_{i∈u} a_i / max(Σ_{i∈u} b_i, 1) for C users of m examples each, stacked user by user."""
    numerators, denominators = loss.per_example(model, examples.structure(examples.fields))
    if numerators.shape != (len(examples),) or denominators.shape != (len(examples),):
        raise Unsupported(f"{loss.__name__}.per_example returned shapes {tuple(numerators.shape)}, "
                           f"{tuple(denominators.shape)} for {len(examples)} examples (it must return two (b,) tensors)")
    return numerators.view(users, -1).sum(1) / denominators.view(users, -1).sum(1).clamp(min=1.0)


def _forward_backward(model: nn.Module, loss: Loss, examples: Examples, users: int,
                      names: dict[int, str]) -> _Chunk:
    recorder = _Recorder()
    handles = [m.register_forward_hook(recorder.hook) for m in model.modules()
               if isinstance(m, SUPPORTED) and any(p.requires_grad for p in m.parameters(recurse=False))]
    try:
        losses = _user_losses(loss, model, examples, users)
    finally:
        for handle in handles:
            handle.remove()
    for call in recorder.calls:
        if (call.input._version, call.output._version) != call.versions:
            raise Unsupported(f"the input or output of {type(call.module).__name__} is changed in place after the "
                               "layer (e.g. ReLU(inplace=True)); use the out-of-place form")
    live = [call for call in recorder.calls if call.output.requires_grad]
    grads = torch.autograd.grad(losses.sum(), [call.output for call in live], allow_unused=True)
    per_param: dict[str, list[_PerUser]] = {}
    for call, grad in zip(live, grads):
        if grad is None:
            continue
        call.grad = grad.detach()
        call.input = call.input.detach()
        for pname, part in _LAYERS[type(call.module)](call, users).items():
            param = getattr(call.module, pname)
            if param.requires_grad:
                per_param.setdefault(names[id(param)], []).append(part)
    return _Chunk({name: _combine(parts) for name, parts in per_param.items()}, losses.detach())


def _verify(model: nn.Module, loss: Loss, examples: Examples, users: int, layout: ParamLayout,
            names: dict[int, str], chunk: _Chunk) -> None:
    """Σ_u G_u from the hooks equals autograd's gradient of J = Σ_u L_u for every parameter (float tolerance; where a
    user's rows can cancel, autograd's own float32 sum may err by up to γ_n·Σ_u P_u, so that much more is allowed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = _user_losses(loss, model, examples, users)
    expected = torch.autograd.grad(losses.sum(), params, allow_unused=True)
    ones = torch.ones(users, dtype=FLAT_DTYPE, device=losses.device)
    for p, grad in zip(params, expected):
        name = names[id(p)]
        want = torch.zeros(p.numel(), device=p.device) if grad is None else grad.reshape(-1)
        got = chunk.grads[name].weighted_sum(ones).to(want.dtype) if name in chunk.grads else torch.zeros_like(want)
        part = chunk.grads.get(name)
        cancelling = isinstance(part, _Outer) and not part._rank_one()
        slack = 2 * float(part._p().sum()) * part.x.shape[0] * part.x.shape[1] * 2.0**-24 if cancelling else 0.0
        if not (torch.allclose(got, want, rtol=1e-3, atol=1e-5 * (1 + float(want.abs().max())))
                or float((got - want).double().norm()) <= 1e-3 * float(want.double().norm()) + slack):
            raise Unsupported(f"parameter {name} gets gradient from outside the forward of its layer (its "
                               "per-user gradients do not add up to autograd's)")


def _check_independent_users(model: nn.Module, loss: Loss, examples: Examples, users: int, names: dict[int, str],
                             result: _Chunk, norms: torch.Tensor,
                             norms_of: Callable[[_Chunk, int], torch.Tensor]) -> None:
    """Each user's loss and norm are its own: the same when the chunk's users come in reverse order and when its first
    half trains alone (relative 10⁻³). The hooks give row q of a layer's input to user q // (rows per user): a layer
    that sees its input sequence-first ((L, B, k): every "user" would hold rows of every user) or an operation that
    mixes examples (a batch statistic) passes the check of the sum against autograd, and then one user's data would
    move every user's clipped update (4.5 ζ measured). Raises ``Unsupported`` naming the cause."""
    per_user = len(examples) // users
    reverse = torch.arange(users - 1, -1, -1)
    rows = (reverse.view(-1, 1) * per_user + torch.arange(per_user)).flatten()
    half = users // 2
    for picked, rows_of in ((reverse, rows), (torch.arange(half), torch.arange(half * per_user))):
        rows_of = rows_of.to(examples.fields[0].device)
        again = _forward_backward(model, loss, Examples(tuple(t[rows_of] for t in examples.fields), examples.keys),
                                  len(picked), names)
        for name, mine, theirs in (("loss", result.losses[picked], again.losses),
                                   ("update norm", norms[picked], norms_of(again, len(picked)))):
            mine, theirs = mine.double(), theirs.double()
            if not torch.allclose(mine, theirs, rtol=1e-3, atol=1e-6 * (1 + float(mine.abs().max()))):
                raise Unsupported(
                    f"a user's {name} depends on the other users of its chunk: the one-step path needs every layer "
                    "to see its input batch first, one row block per example, and no operation that mixes examples "
                    "(a sequence-first layout (L, B, ...), a batch statistic); those users train with a model each")


def _check_loss(loss: Loss, model: nn.Module, examples: Examples) -> None:
    """``loss(model, batch)`` equals Σa / max(Σb, 1) from ``loss.per_example`` on one user's batch."""
    with torch.no_grad():
        value = loss(model, examples.structure(examples.fields))
        numerators, denominators = loss.per_example(model, examples.structure(examples.fields))
        decomposed = numerators.sum() / denominators.sum().clamp(min=1.0)
    if not torch.allclose(value.to(decomposed.dtype), decomposed, rtol=1e-4, atol=1e-6):
        raise Unsupported(f"{getattr(loss, '__name__', 'the loss')}.per_example does not add up to the loss "
                           f"({float(decomposed):.6g} against {float(value):.6g})")


# --- the node's contribution ------------------------------------------------------------------------------------

def _stack(chunk: Sequence[UserExamples], n: int, m: int, device: torch.device) -> Examples:
    """The first m of the n examples of every user of ``chunk``, concatenated user by user (C·m rows), on
    ``device``."""
    first = chunk[0][1]
    fields = []
    for f in range(len(first.fields)):
        parts = [examples.fields[f] for _, examples in chunk] if n == m else \
            [examples.fields[f][:m] for _, examples in chunk]
        try:
            fields.append(torch.cat(parts).to(device))
        except RuntimeError as error:
            raise ValueError(f"users {chunk[0][0]}..{chunk[-1][0]} hold examples of different structure (shapes "
                             f"after the first dimension or dtypes; {error}); every user of a task needs the same") from None
    return Examples(tuple(fields), first.keys)


def _chunks(users: Sequence[UserExamples], training: LocalTraining,
            budget: int) -> list[tuple[int, int, list[UserExamples]]]:
    """Users grouped by their number n of examples, as (n, m, users) with m the examples they train on, in chunks
    whose examples take ≤ ``budget``/8 bytes (activations and per-user gradients come on top). Raises ValueError
    for a user who does not train one full-batch step (:func:`one_step`)."""
    groups: dict[int, list[UserExamples]] = {}
    for user in users:
        groups.setdefault(len(user[1]), []).append(user)
    out = []
    for n, group in sorted(groups.items()):
        if not one_step(training, n):
            raise ValueError(f"users {[index for index, _ in group][:5]} train more than one full-batch step; this "
                             "path trains one")
        m = examples_used(training, n)
        per_user = sum(t[:m].numel() * t.element_size() for t in group[0][1].fields)
        size = max(1, budget // 8 // max(1, per_user))
        out.extend((n, m, group[i:i + size]) for i in range(0, len(group), size))
    return out


def _update_norms(result: _Chunk, offsets: dict[str, tuple[int, int]], scale_sq: torch.Tensor | None, lr: float,
                  users: int, device: torch.device) -> torch.Tensor:
    """N̄_u ≥ ‖Δ_u‖ = η·‖g_u‖ (‖s ⊙ Δ_u‖ for scale-then-privatize), float64: η·√(Σ_layers (S̃ + E)), where each
    layer's computed squared norm S̃ comes with its error bound E (:class:`_SquaredNorms`), raised by the few
    roundings of this sum, the square root and the product (≤ 2⁻⁵³ each)."""
    total = _SquaredNorms(torch.zeros(users, dtype=torch.float64, device=device),
                          torch.zeros(users, dtype=torch.float64, device=device))
    for name, grads in result.grads.items():
        lo, hi = offsets[name]
        total = total + grads.norm_sq(None if scale_sq is None else scale_sq[lo:hi])
    layers = len(result.grads)
    return (total.value + total.error).sqrt() * (lr * (1 + _gamma(2 * layers + 4)))


#: (1 + 2⁻²¹): room for the float32 roundings of a user's released terms beyond the one ``clip_factors`` covers: at
#: most four more (rank one: fl(w·δ), then the product with x; the scaled geometry's product with s; the squares'
#: δ², w², x² and their products), (1 + 2⁻²⁴)⁴ < 1 + 2⁻²¹.
RELEASE_MARGIN = 1 + 2.0**-21


def _release_bounds(result: _Chunk, offsets: dict[str, tuple[int, int]], scale: torch.Tensor | None, lr: float,
                    norms: torch.Tensor) -> torch.Tensor:
    """N̄′_u ≥ the norm of what user u's terms put into the node's sum before its final rounding to float32, per unit of
    the clip factor: N̄′_u = (N̄_u + η·Σ_layers E_u)·(1 + 2⁻²¹), with N̄_u ≥ ‖Δ_u‖ (:func:`_update_norms`) and E_u a
    bound of the float64 rounding of each layer's weighted sum (``_PerUser.release_error``: 2⁻²⁴·max(s)·P_u where a
    user's rows can cancel), rounded up by a few float64 ulps.

    Why (docs/explanation/floating-point.md, "One step"): the bound of ‖Δ_u‖ alone holds for the exact product w_u·G_u,
    but the node's sum is computed by products over all users' rows, whose rounding grows with P_u = Σ_q ‖x_q‖‖δ_q‖,
    not with ‖G_u‖: rows that cancel (an input and its negative, one example twice with two labels) released 10⁵ ζ in
    float32. With the factor f_u = clip_factors(N̄′_u), each user's part V_u of the float64 sum has
    ‖V_u‖ ≤ |w_u|(‖G_u‖ + E_u) ≤ f_u·N̄′_u/(1 + 2⁻²¹), and its float32 roundings (one covered by ``clip_factors``, the
    others by :data:`RELEASE_MARGIN`) keep a user alone at a node within ζ: l2_norm(released) ≤ ζ, squares within
    ζ². Between users, the node's sum adds only the roundings of a sum (docs: the sensitivity's κ)."""
    extra: torch.Tensor | float = 0.0
    for name, grads in result.grads.items():
        lo, hi = offsets[name]
        scale_max = 1.0 if scale is None else float(scale[lo:hi].double().max()) * (1 + 4 * _U64)
        extra = extra + grads.release_error(scale_max)
    return (norms + lr * extra * (1 + 8 * _U64)) * (RELEASE_MARGIN * (1 + 4 * _U64))


def _cost_refusal(result: _Chunk, users: int, *, scaled: bool, squares: bool, limit: float) -> None:
    """Raise ``Unsupported`` when this chunk's extra multiply-adds per user exceed ``limit``, naming the layers."""
    costs = {name: grads.extra_macs(scaled, squares) / users for name, grads in result.grads.items()}
    if sum(costs.values()) > limit:
        worst = sorted((name for name in costs if costs[name] > 0), key=costs.get, reverse=True)[:3]  # type: ignore[arg-type]
        raise Unsupported(
            f"per-user norms would cost {sum(costs.values()):.3g} extra multiply-adds per user (over "
            f"{limit:.3g}; most in {', '.join(worst)}): materializing per-user gradients over many positions is "
            "slower than training each user's own model")


def users_contribution(users: Sequence[UserExamples], work: LocalRound, *, budget_bytes: int = DEFAULT_CHUNK_BYTES,
                       max_extra_macs: float | None = None) -> tuple[Contribution, dict[str, float]]:
    """``clients.training.users_contribution`` for users whose update is one full-batch step (:func:`one_step`):
    the same arguments (``work.seed`` is not needed: a full batch has no order that matters) and the same return
    value.

    Raises ``Unsupported`` (caught by :func:`fed_dp.clients.training_paths.contribution`, which then takes the usual
    path) for what this path cannot train, before anything is summed, and, with ``max_extra_macs`` (the auto
    choice passes :data:`AUTO_MAX_EXTRA_MACS`), when the first chunk shows that its norms would cost more than that
    many multiply-adds per user beyond a per-user path's work (:func:`_cost_refusal`); ValueError, like the other
    paths, for a loss that becomes NaN/Inf or a non-finite update (naming the user).
    """
    params, model, layout, loss, scale = work.params, work.model, work.layout, work.loss, work.scale
    clip_norm, round_index, send_squares = work.clip_norm, work.round_index, work.send_squares
    reason = unsupported_reason(model, loss)
    if reason:
        raise Unsupported(reason)
    device, lr = params.device, work.training.lr
    names = {id(p): name for name, p in model.named_parameters()}
    offsets, start = {}, 0
    for spec in layout.specs:
        offsets[spec.name] = (start, start + spec.numel)
        start += spec.numel
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            dict(model.named_parameters())[name].copy_(value)
    scale_wide = None if scale is None else scale.double()
    scale_sq = None if scale is None else scale_wide.square()  # exact: a float32 squared fits in float64
    total = torch.zeros_like(params, dtype=torch.float64)  # the node's sum, rounded once to float32 at the end
    squares = torch.zeros_like(params, dtype=torch.float64) if send_squares else None
    loss_sum, norm_sum, clipped = 0.0, 0.0, 0
    verified = getattr(model, "_fed_dp_one_step_verified", None) is loss
    for n, m, chunk in _chunks(users, work.training, budget_bytes):
        examples = _stack(chunk, n, m, device)
        size = len(chunk)
        if not verified:
            _check_loss(loss, model, Examples(tuple(t[:m] for t in examples.fields), examples.keys))
        result = _forward_backward(model, loss, examples, size, names)
        bad_loss = ~torch.isfinite(result.losses)
        if bool(bad_loss.any()):
            check_finite_loss(float(result.losses[bad_loss][0]), chunk[int(bad_loss.nonzero()[0])][0], round_index)
        if max_extra_macs is not None:
            _cost_refusal(result, size, scaled=scale is not None, squares=send_squares, limit=max_extra_macs)
            max_extra_macs = None  # decided on the first chunk
        norms = _update_norms(result, offsets, scale_sq, lr, size, device)  # ≥ ‖Δ_u‖ (‖s ⊙ Δ_u‖ for STP)
        if not verified:
            _verify(model, loss, examples, size, layout, names, result)
            if size >= 2:  # a chunk of one user cannot show users mixing: the next chunk of several checks it
                _check_independent_users(model, loss, examples, size, names, result, norms,
                                         lambda r, c: _update_norms(r, offsets, scale_sq, lr, c, device))
                model._fed_dp_one_step_verified = loss
                verified = True
        if not bool(torch.isfinite(norms).all()):
            user = chunk[int((~torch.isfinite(norms)).nonzero()[0])][0]
            raise ValueError(f"the update of user {user} contains NaN or Inf values (round {round_index + 1}); it "
                             "cannot be clipped: lower local.lr, or check that user's data and the loss")
        # u_u = w_u·g_u (⊙ s for STP) with w_u = −η·f_u rounded towards 0, f_u from a bound of what the sums release
        bounds = _release_bounds(result, offsets, scale, lr, norms)
        w = -round_down_float32(lr * clip_factors(bounds, clip_norm, dim=layout.size))
        with float32_matmul_exactly():
            for name, grads in result.grads.items():
                lo, hi = offsets[name]
                part = grads.weighted_sum(w).double()
                total[lo:hi] += part if scale is None else part * scale_wide[lo:hi]
                if squares is not None:
                    sq = grads.weighted_squares(w.double().square())  # exact (a float32 w² can be subnormal)
                    squares[lo:hi] += sq if scale is None else sq * scale_sq[lo:hi]
        loss_sum += float(result.losses.double().sum())
        norm_sum += float(norms.sum())
        clipped += int((norms > clip_norm).sum())
    count = len(users)
    # squares rounded towards 0 (the sum's nearest rounding is covered by clip_factors; a square's could pass ζ² in the
    # subnormal range, where rounding is absolute)
    if squares is not None:
        squares = round_down_float32(squares) if params.dtype == torch.float32 else squares.to(params.dtype)
    return Contribution(total.to(params.dtype), count, squares, source=work.source, unclipped=count - clipped,
                        scaled=scale is not None), node_metrics(count, loss_sum, norm_sum, clipped)
