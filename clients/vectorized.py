"""Per-user local training vectorized over users with ``torch.func`` (the fast path of ``users_contribution``).

Computes exactly what :func:`clients.training.users_contribution` computes, for many users at once.
For every user i of the cohort, starting from the broadcast θ = θ_{t−1}:

    π_{i,e} = torch.randperm(m_i, generator=g_i) for every epoch e the schedule touches
                                                      (g_i = user_generator(seed, t, i); m_i = min(n_i, cap))
    for every minibatch (e, k) of local_schedule(training, n_i) (clients.training):   b = π_{i,e}[k·B : (k+1)·B]
        ℓ_i = loss(f(θ_i; ·), batch b of user i)          (the task's loss, e.g. mean cross-entropy)
        g = ∇ℓ_i + λ·θ_i ;  m_i = g, then μ·m_i + g ;  θ_i ← θ_i − η·m_i      (LocalTraining's SGD)
    Δ_i = θ_i − θ
    u_i = Δ_i · min(1, ζ/‖Δ_i‖₂)                      or, with the broadcast scale s (scale-then-privatize),
    u_i = (s ⊙ Δ_i) · min(1, ζ/‖s ⊙ Δ_i‖₂)

and the node replies with Σ_i u_i, the count, and Σ_i u_i ⊙ u_i when ``send_squares``.

How it is vectorized:

- Users are grouped by the number m of examples they train on: inside a group every user has the same
  minibatch schedule, so one step of every user of the group is one call of
  ``vmap(grad_and_value(loss))`` over a stacked parameter matrix. The task's loss receives a functional
  view of the model (calling it runs ``torch.func.functional_call`` with that user's parameters).
- A group is processed in chunks of at most ``chunk_size`` users, which bounds memory (the chunk's data,
  its (C, d) parameter matrix and the per-user activations of one minibatch).
- The parameters of a chunk live in one flat (C, d) float32 matrix; the model sees them as per-tensor
  views (C, *shape) through ``torch.func.functional_call``; the SGD step updates the matrix in place and
  Δ is a row-wise subtraction, with no state_dict copies. All users of a chunk are then clipped at once
  with :func:`fed_dp.clipping.clip_rows`.
- The only per-user Python work is drawing the minibatch permutations from each user's own generator
  (the same stream the sequential path consumes) and stacking the users' data; training, clipping and
  summing have no loop over users.

Results equal the sequential path's up to float32 rounding: batched kernels (e.g. a grouped convolution
for a per-user conv weight) and the order of the sum over users round differently, typically a relative
difference of 1e-6 on Σu (the tests state their tolerances). The model module is not modified (the
sequential path leaves the last user's trained weights in it; nothing relies on that).

Not every model can be vmapped this way; :func:`can_vectorize` tells which (BatchNorm, active dropout and
non-float32 parameters cannot), and :func:`fed_dp.clients.training_paths.contribution` runs the vectorized path when
it can and the sequential one otherwise, and says which ran. A model or loss whose Python control flow depends on the
data cannot be traced by vmap either; that dispatcher then logs the reason once and trains that node's users
sequentially (the same arithmetic, so nothing about the result changes but the time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from fed_dp.clients.task import Examples, trainable_parameters
from fed_dp.clients.training import (LocalRound, UserExamples, check_finite_loss, examples_used, local_schedule,
                                     minibatch_orders, node_metrics, require_examples, scalar_loss, user_generator)
from fed_dp.clipping import clip_rows, round_down_float32
from fed_dp.config import LocalTraining
from fed_dp.flat import FLAT_DTYPE, ParamLayout
from fed_dp.contribution import Contribution
from fed_dp.validation import check_int

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "auto_chunk_size",
    "can_vectorize",
    "users_contribution",
]

#: Most users trained together in one vmapped call.
DEFAULT_CHUNK_SIZE = 256
#: Memory budget of a chunk's per-user parameter copies: the automatic chunk size is the number of users
#: whose θ_i, gradient, SGD temporary and clipped row (4 float32 vectors of d values each) fit in it.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def chunk_budget_bytes(device: torch.device) -> int:
    """The per-user parameter memory a chunk may use: ``DEFAULT_CHUNK_BYTES`` on the CPU; on CUDA a
    quarter of the device's free memory (at least the CPU budget), leaving room for activations."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(DEFAULT_CHUNK_BYTES, free // 4)
    return DEFAULT_CHUNK_BYTES


def auto_chunk_size(num_params: int, *, max_users: int = DEFAULT_CHUNK_SIZE,
                    budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """min(max_users, max(1, budget / (4 · 4 bytes · d))): 256 users for W1 (d = 25,578), 7 for the
    heavy-tail default (d = 9,216 · 255). Activations come on top (they scale with users × batch)."""
    return max(1, min(max_users, budget_bytes // (16 * max(1, num_params))))


_BATCHNORM_REASON = (
    "the model contains BatchNorm ({name}: {kind}); BatchNorm cannot be vectorized over users: its running "
    "statistics are buffers shared by every user, so training users together would leak one user's "
    "statistics into another's update (and vmap cannot update a shared buffer in place). Use GroupNorm or "
    "LayerNorm, or the sequential path (clients.training.users_contribution)"
)


def can_vectorize(model: nn.Module) -> tuple[bool, str]:
    """Whether :func:`users_contribution` can train ``model`` vectorized over users, and why not.

    Returns ``(True, "")`` or ``(False, reason)``. Rejected:

    - BatchNorm (any ``torch.nn.modules.batchnorm._BatchNorm``): its running statistics are shared
      buffers; per-user statistics would leak across users and vmap cannot update them in place.
      GroupNorm and LayerNorm are per-example and fine.
    - dropout with p > 0 in training mode: the sequential path draws its masks from the global RNG one
      user after another, which a vmapped call cannot reproduce.
    - trainable parameters that are not float32: the flat per-user buffer is float32 (the update dtype), the
      sequential path would train in the parameters' own dtype. Frozen parameters (``requires_grad=False``) are
      not copied per user: ``functional_call`` takes them from the module, shared by every user of a chunk.
    """
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            return False, _BATCHNORM_REASON.format(name=name or "<root>", kind=type(module).__name__)
        if isinstance(module, _DropoutNd) and module.training and module.p > 0:
            return False, (
                f"the model has active dropout ({name}: {type(module).__name__}(p={module.p})); its random "
                "masks come from the global RNG user after user in the sequential path and cannot be "
                "reproduced vectorized (call model.eval() or use the sequential path)"
            )
    for name, p in trainable_parameters(model).items():  # frozen ones are shared by every user, in any dtype
        if p.dtype != FLAT_DTYPE:
            return False, f"parameter {name!r} has dtype {p.dtype}; the vectorized path trains in {FLAT_DTYPE}"
    return True, ""


def _check_scale(scale: torch.Tensor, params: torch.Tensor) -> None:
    """The checks of ``fed_dp.clipping.clip_scaled`` on the broadcast s, done once per call."""
    if not isinstance(scale, torch.Tensor) or scale.ndim != 1 or not scale.dtype.is_floating_point:
        raise ValueError("scale must be a flat 1-D floating-point tensor (see fed_dp.flat.ParamLayout)")
    if scale.shape != params.shape:
        raise ValueError(f"scale has shape {tuple(scale.shape)}, update has {tuple(params.shape)}")
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("scale contains NaN or Inf values; it cannot be clipped")
    if not bool((scale > 0).all()):
        raise ValueError("scale must be positive in every coordinate")


def _check_layout(model: nn.Module, layout: ParamLayout) -> None:
    names = {name for name, _ in model.named_parameters()}
    missing = [n for n in layout.names if n not in names]
    if missing:
        raise ValueError(f"layout tensors {missing} are not parameters of the model")


class FunctionalModel:
    """The model as the loss sees it on the vectorized path: calling it runs ``functional_call`` with one
    user's parameters (inside vmap: every user's); other attributes are the module's."""

    def __init__(self, module: nn.Module, params: dict[str, torch.Tensor]) -> None:
        self._module, self._params = module, params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._module, self._params, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _stack(chunk: Sequence[UserExamples], m: int, device: torch.device) -> tuple[list[torch.Tensor], Examples]:
    """The chunk's examples as one (C, m, ...) tensor per field, on ``device``; the first user's Examples
    gives the batch structure. Users whose examples differ in structure are an error naming them."""
    first = chunk[0][1]
    for index, examples in chunk[1:]:
        same = (examples.keys == first.keys and len(examples.fields) == len(first.fields)
                and all(a.shape[1:] == b.shape[1:] and a.dtype == b.dtype for a, b in zip(examples.fields, first.fields)))
        if not same:
            raise ValueError(f"users {chunk[0][0]} and {index} hold examples of different structure (tensors, shapes "
                             "after the first dimension or dtypes); every user of a task needs the same")
    stacked = [torch.stack([examples.fields[f][:m] for _, examples in chunk]).to(device)
               for f in range(len(first.fields))]
    return stacked, first


def users_contribution(users: Sequence[UserExamples], work: LocalRound, *,
                       chunk_size: int | None = None) -> tuple[Contribution, dict[str, float]]:
    """Vectorized :func:`fed_dp.clients.training.users_contribution`: same arguments, same return value.

    Returns ``Contribution(Σ_i u_i, count, Σ_i u_i ⊙ u_i or None, source)`` and the metrics
    ``train_loss`` (mean over users of each user's mean minibatch loss), ``mean_update_norm`` (mean of
    ‖Δ_i‖₂, or ‖s ⊙ Δ_i‖₂ with ``scale``, before clipping) and ``fraction_clipped`` (share of users with
    that norm > ζ); NaN for an empty cohort. Everything runs on ``params.device`` (users' examples are moved
    there chunk by chunk). ``chunk_size`` is the most users trained in one vmapped call; ``None`` picks
    :func:`auto_chunk_size` of d (and, on CUDA, of the free memory). The result does not depend on it (up to
    float32 rounding of Σ).

    Raises ValueError for a model that :func:`can_vectorize` rejects (BatchNorm, ...), and, like the
    sequential path, for a loss that is not a scalar or becomes NaN/Inf (naming the user), a non-finite
    update, or an invalid ζ or scale.
    """
    params, chunk_size = _checked(users, work, chunk_size)
    scale, clip_norm, device = work.scale, work.clip_norm, params.device
    total = torch.zeros_like(params)
    squares = torch.zeros_like(params) if work.send_squares else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    norm_sum = torch.zeros((), dtype=torch.float64, device=device)
    clipped = torch.zeros((), dtype=torch.int64, device=device)
    for m, group in sorted(_by_examples_used(users, work.training).items()):
        for c0 in range(0, len(group), chunk_size):
            chunk = group[c0 : c0 + chunk_size]
            flat, user_losses = _train_chunk(chunk, m, work, params)
            bad = ~torch.isfinite(user_losses)
            if bool(bad.any()):
                check_finite_loss(float(user_losses[bad][0]), chunk[int(bad.nonzero()[0])][0], work.round_index)
            loss_sum += user_losses.sum()
            deltas = flat.sub_(params)  # Δ_i = θ_i − θ, row-wise, in place
            if scale is not None:
                deltas.mul_(scale)  # s ⊙ Δ_i
            updates, norms = clip_rows(deltas, clip_norm)
            total += updates.sum(dim=0)
            if squares is not None:  # each u ⊙ u rounded towards 0 (within ‖u‖² ≤ ζ²), row block by row block
                for block in updates.split(max(1, (1 << 20) // max(1, updates.shape[1]))):
                    squares += round_down_float32(block.double().square()).sum(dim=0)
            norm_sum += norms.double().sum()
            clipped += (norms > clip_norm).sum()

    count = len(users)
    return Contribution(total, count, squares, source=work.source, unclipped=count - int(clipped),
                        scaled=scale is not None), node_metrics(count, float(loss_sum), float(norm_sum), int(clipped))


def _checked(users: Sequence[UserExamples], work: LocalRound, chunk_size: int | None) -> tuple[torch.Tensor, int]:
    """The flat θ (detached) and the chunk size, after checking the model, the users, θ's shape and the scale."""
    ok, reason = can_vectorize(work.model)
    if not ok:
        raise ValueError(f"cannot vectorize local training over users: {reason}")
    require_examples(users)
    layout = work.layout
    if chunk_size is None:
        chunk_size = auto_chunk_size(layout.size, budget_bytes=chunk_budget_bytes(work.params.device))
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    _check_layout(work.model, layout)
    params = work.params.detach()
    if params.ndim != 1 or params.numel() != layout.size:
        raise ValueError(f"params must be a flat vector of {layout.size} values, got shape {tuple(params.shape)}")
    if work.scale is not None:
        _check_scale(work.scale, params)
    return params, chunk_size


def _by_examples_used(users: Sequence[UserExamples], training: LocalTraining) -> dict[int, list[UserExamples]]:
    """Users grouped by how many examples they train on: a group shares one minibatch schedule."""
    groups: dict[int, list[UserExamples]] = {}
    for index, examples in users:
        groups.setdefault(examples_used(training, len(examples)), []).append((index, examples))
    return groups


def _train_chunk(chunk: Sequence[UserExamples], m: int, work: LocalRound,
                 params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local training of a chunk of users with m examples each, from θ: their trained θ_i as one (C, d) matrix and
    each user's mean minibatch loss (C,), float64."""
    model, layout, training, device = work.model, work.layout, work.training, params.device
    size = len(chunk)
    # Minibatch order of every user: its own generator, one randperm per epoch (as sequentially).
    orders = [torch.stack(minibatch_orders(len(examples), training, user_generator(work.seed, work.round_index, index)))
              for index, examples in chunk]
    order = torch.stack(orders).to(device)  # (C, E, m)
    fields, structure = _stack(chunk, m, device)  # (C, m, ...) per field
    rows = torch.arange(size, device=device).unsqueeze(1)

    def loss_fn(p: dict[str, torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
        return scalar_loss(work.loss(FunctionalModel(model, p), structure.structure(batch)), chunk[0][0])

    step = vmap(grad_and_value(loss_fn))
    # θ_i for every user of the chunk: one (C, d) matrix, the model's tensors are views of it.
    flat = params.unsqueeze(0).repeat(size, 1)
    views, start = {}, 0
    for spec in layout.specs:
        views[spec.name] = flat[:, start : start + spec.numel].view(size, *spec.shape)
        start += spec.numel
    buffers: dict[str, torch.Tensor] = {}
    step_losses = []
    for epoch, begin, stop in local_schedule(training, m):
        grads, value = step(views, *[field[rows, order[:, epoch, begin:stop]] for field in fields])
        _sgd_step(views, grads, buffers, training)
        step_losses.append(value.detach())
    return flat, torch.stack(step_losses, dim=1).double().mean(dim=1)


@torch.no_grad()
def _sgd_step(views: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
              training: LocalTraining) -> None:
    """torch.optim.SGD's step on every user's θ_i at once (``LocalTraining``: weight decay, momentum, lr)."""
    for name, view in views.items():
        g = grads[name] + training.weight_decay * view if training.weight_decay else grads[name]
        if training.momentum:
            buffer = buffers.get(name)
            g = buffers[name] = g.clone() if buffer is None else buffer.mul_(training.momentum).add_(g)
        view -= training.lr * g


