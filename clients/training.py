"""Local training on a user's data and the clipped contribution a node sends (docs/explanation/mechanism.md).

For each sampled user i hosted here:

    Δ_i = θ_i − θ_{t−1}   after local training from the broadcast θ_{t−1} on user i's examples with the task's
                          loss (fed_dp.config.LocalTraining: epochs or steps, minibatches, SGD with momentum
                          and weight decay, an optional example cap)
    u_i = clip(Δ_i, ζ)    or clip(s_t ⊙ Δ_i, ζ) for scale-then-privatize (the broadcast s_t)

and the node replies with Σ u_i, the count, and Σ u_i² when the server's optimizer asks for squares
(independent moment estimation). Users are trained one at a time here; ``clients.vectorized`` trains many at
once with the same arithmetic. The same code runs in the Flower ClientApp (one node, its users) and in the
in-process engine, so both compute the same contributions.

Local training draws its minibatch order from a generator seeded from (seed, round, user index), so a run is
reproducible and the vectorized path reproduces the same order.

A user's examples are moved to the device of the broadcast parameters (``params.device``), and image batches
for convolutional models use the channels-last memory format (:func:`input_memory_format`): the same numbers
up to float32 rounding, measured 1.5–2× faster on the 2-core CPUs here for the W1 CNN.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fed_dp.clients.task import Examples, Loss, trainable_parameters
from fed_dp.clipping import clip_scaled, clip_update, round_down_float32
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout
from fed_dp.contribution import Contribution

#: (user index, that user's examples): what a node trains in a round.
UserExamples = tuple[int, Examples]


@dataclass(frozen=True)
class LocalRound:
    """What every training path needs to train a node's users in round ``round_index``: the broadcast (the flat
    θ_{t−1} ``params``, the clip ζ, s_t for scale-then-privatize, whether Σu² is sent, the training ``seed``) and the
    node's own ``model``, its ``layout``, ``training`` and ``loss``; ``source`` names the node in a Contribution."""

    params: torch.Tensor
    round_index: int
    clip_norm: float
    scale: torch.Tensor | None
    send_squares: bool
    model: nn.Module
    layout: ParamLayout
    training: LocalTraining
    loss: Loss
    seed: int
    source: str = ""


def node_metrics(count: int, loss_sum: float, norm_sum: float, clipped: int) -> dict[str, float]:
    """A node's training metrics over ``count`` users: mean loss, mean update norm (before clipping), fraction
    clipped; NaN for no users."""
    return {
        "train_loss": loss_sum / count if count else math.nan,
        "mean_update_norm": norm_sum / count if count else math.nan,
        "fraction_clipped": clipped / count if count else math.nan,
    }


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → ``cuda`` when available, else ``cpu``; anything else as ``torch.device``, with a clear
    error for a CUDA device this machine does not have."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this machine has no CUDA device; use 'cpu' or 'auto'")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s), numbered from 0")
    return resolved


#: glibc's ``mallopt`` parameters (malloc.h) and the values :func:`keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 64 << 20}
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """On glibc, let this process reuse the memory it frees instead of handing it back to the OS at every step:
    blocks under 32 MiB come from the heap (``M_MMAP_THRESHOLD``), and the heap's free top is returned only
    beyond 64 MiB (``M_TRIM_THRESHOLD``). Once per process; skipped where the libc has no ``mallopt`` or when
    the environment sets ``MALLOC_*`` itself. Returns whether the thresholds are set.

    Why: training one small user after another frees and regrows the heap at every minibatch, and glibc's own
    thresholds let it trim and re-fault those pages: 80,000 to 230,000 page faults per W1 run on the CPU
    (0.2–0.4 s of 2.1 s), against none for the same minibatches trained as one model. With these thresholds:
    under 1,000. Setting them fixes glibc's otherwise adaptive thresholds at these values.
    """
    global _kept
    if _kept is None:
        _kept = False
        if not any(name.startswith("MALLOC_") for name in os.environ):
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): leave the allocator alone
                return False
            _kept = all(mallopt(param, value) == 1 for param, value in _KEEP.items())
    return _kept


def input_memory_format(model: nn.Module, examples: Examples) -> torch.memory_format:
    """``torch.channels_last`` when ``examples`` hold a batch of images (a 4-D floating-point tensor) and
    ``model`` has a ``Conv2d``, else ``torch.contiguous_format``.

    Convolution, ReLU and max-pooling kernels are vectorized over channels in the NHWC layout; a model is
    switched to it with ``model.to(memory_format=torch.channels_last)`` (only its 4-D weights change
    strides, its parameters stay the same objects and the same values).
    """
    images = any(t.ndim == 4 and t.dtype.is_floating_point for t in examples.fields)
    if images and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return torch.channels_last
    return torch.contiguous_format


def use_fast_format(model: nn.Module, users: Sequence[UserExamples]) -> torch.memory_format:
    """The memory format the users' inputs should have (:func:`input_memory_format` of the first user's
    examples); switches ``model`` to channels-last when that is the format."""
    if not users:
        return torch.contiguous_format
    memory_format = input_memory_format(model, users[0][1])
    if memory_format is torch.channels_last:
        model.to(memory_format=memory_format)
    return memory_format


def user_generator(seed: int, round_index: int, user_id: int) -> torch.Generator:
    """The generator of user ``user_id``'s local training in round ``round_index`` (stable mixing)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + user_id * 0x94D049BB133111EB)
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


def examples_used(training: LocalTraining, n: int) -> int:
    """How many of a user's n examples it trains on: min(n, max_examples)."""
    return n if training.max_examples is None else min(n, training.max_examples)


def local_schedule(training: LocalTraining, n: int) -> list[tuple[int, int, int]]:
    """The minibatches of a user with n examples: (epoch, start, stop) into that epoch's permutation.

    With m = :func:`examples_used` and s = ⌈m / batch_size⌉ steps per epoch: step k is minibatch k mod s of
    epoch ⌊k / s⌋; there are ``epochs``·s steps, or ``steps``. Users with the same m have the same schedule (what
    lets the vectorized path train them together). Empty for m = 0.
    """
    m = examples_used(training, n)
    if m == 0:
        return []
    per_epoch = math.ceil(m / training.batch_size)
    total = training.steps if training.steps is not None else training.epochs * per_epoch
    batches = []
    for k in range(total):
        start = (k % per_epoch) * training.batch_size
        batches.append((k // per_epoch, start, min(start + training.batch_size, m)))
    return batches


def epochs_needed(training: LocalTraining, n: int) -> int:
    """Permutations a user with n examples draws: one per epoch its schedule touches."""
    schedule = local_schedule(training, n)
    return schedule[-1][0] + 1 if schedule else 0


def minibatch_orders(n: int, training: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """One permutation of the user's m = min(n, max_examples) examples per epoch its schedule touches, drawn
    from ``generator`` on the CPU in epoch order (the vectorized path draws the same ones)."""
    m = examples_used(training, n)
    return [torch.randperm(m, generator=generator, device="cpu") for _ in range(epochs_needed(training, n))]


def scalar_loss(value: object, user: object) -> torch.Tensor:
    """The loss value, checked: a floating-point scalar tensor (else a ValueError naming the user)."""
    if not isinstance(value, torch.Tensor) or value.ndim != 0 or not value.dtype.is_floating_point:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"the loss returned {shape} for a minibatch of user {user}; it must return a scalar "
                         "floating-point tensor (the mean loss of the minibatch)")
    return value


def require_examples(users: Sequence[UserExamples]) -> None:
    """Every user to train has at least one example (else a ValueError naming the first that has none)."""
    for index, examples in users:
        if len(examples) == 0:
            raise ValueError(f"user {index} has no examples to train on; every user of the population needs at "
                             "least one (leave users without data out of the population)")


def check_finite_loss(mean_loss: float, user: object, round_index: int) -> None:
    if not math.isfinite(mean_loss):
        raise ValueError(f"the loss of user {user} became {mean_loss} in local training (round {round_index + 1}): "
                         "lower local.lr, or check that user's data and the loss")


class FlatParameters:
    """The model's trainable parameters and their gradients as views into two flat buffers, for the plain SGD step (no
    momentum, no weight decay) of :func:`local_delta`: loading θ is one copy, a step is ``values −= η · grads``
    in one operation, and Δ needs no flattening.

    Each parameter keeps its own strides (a channels-last convolution weight stays channels-last, so the kernels
    are unchanged); the buffers therefore hold the parameters in memory order, and ``to_memory`` maps the layout's
    flat order to it (None when the two agree). Autograd adds each backward's gradient into the existing
    ``p.grad`` view in place, so ``grads`` is zeroed before every backward; a parameter the loss does not reach
    keeps a zero gradient and does not move, as ``torch.optim.SGD`` leaves it.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout) -> None:
        named = trainable_parameters(model)  # frozen parameters keep their own storage and get no gradient
        if list(named) != list(layout.names):
            raise ValueError(f"the model's trainable parameters {list(named)[:5]} do not follow the layout "
                             f"{list(layout.names)[:5]}")
        first = next(iter(named.values()))
        self.values = torch.empty(layout.size, device=first.device, dtype=first.dtype)
        self.grads = torch.zeros_like(self.values)
        memory_order, offset = [], 0
        for name in layout.names:
            param = named[name]
            if param.dtype != first.dtype or param.device != first.device or not _dense(param):
                raise ValueError(f"parameter {name!r} cannot live in one flat {first.dtype} buffer on {first.device}")
            n = param.numel()
            index = torch.empty_strided(param.shape, param.stride(), dtype=torch.int64, device=first.device)
            index.copy_(torch.arange(offset, offset + n, device=first.device).view(param.shape))
            memory_order.append(index.as_strided((n,), (1,)))  # the layout position of each memory slot
            view = torch.as_strided(self.values, param.shape, param.stride(), offset)
            view.copy_(param.detach())
            param.data = view
            param.grad = torch.as_strided(self.grads, param.shape, param.stride(), offset)
            offset += n
        order = torch.cat(memory_order)
        identity = bool(torch.equal(order, torch.arange(layout.size, device=first.device)))
        self.to_memory = None if identity else order
        self.to_layout = None if identity else torch.argsort(order)
        self._pointers = [(param, param.data_ptr(), param.grad.data_ptr()) for param in named.values()]

    def intact(self) -> bool:
        """Whether every parameter and gradient is still its view (nothing replaced them since)."""
        return all(param.data_ptr() == data and param.grad is not None and param.grad.data_ptr() == grad
                   for param, data, grad in self._pointers)

    def load(self, params: torch.Tensor) -> None:
        """Set the model's parameters to the flat θ (layout order)."""
        if self.to_memory is None:
            self.values.copy_(params)
        else:
            torch.index_select(params, 0, self.to_memory, out=self.values)

    def read(self) -> torch.Tensor:
        """The model's parameters as a new flat vector in layout order."""
        return self.values.clone() if self.to_layout is None else self.values.index_select(0, self.to_layout)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers exactly ``numel`` consecutive elements of memory (its dimensions in any order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_parameters(model: nn.Module, layout: ParamLayout) -> FlatParameters:
    """The model's :class:`FlatParameters`, made on first use and kept on the model (made again when something
    replaced its parameters or gradients since: a memory-format change, ``zero_grad(set_to_none=True)``, ...)."""
    flat = getattr(model, "_fed_dp_flat_parameters", None)
    if flat is None or not flat.intact():
        flat = FlatParameters(model, layout)
        model._fed_dp_flat_parameters = flat
    return flat


def local_delta(
    model: nn.Module,
    layout: ParamLayout,
    params: torch.Tensor,
    examples: Examples,
    training: LocalTraining,
    loss: Loss,
    generator: torch.Generator,
    *,
    user: object = "?",
) -> tuple[torch.Tensor, float]:
    """Δ_i = θ_i − θ_{t−1} after local training from ``params``; also the mean minibatch loss.

    ``examples`` must be on the device of ``params`` and the model (``users_contribution`` moves them there).
    The minibatch order comes from ``generator`` (:func:`minibatch_orders`); the step is
    ``fed_dp.config.LocalTraining``'s SGD (weight decay, then momentum, then θ −= η·m).
    """
    orders = [order.to(params.device) for order in minibatch_orders(len(examples), training, generator)]
    if not training.momentum and not training.weight_decay:  # plain SGD: the flat path (FlatParameters)
        flat = flat_parameters(model, layout)
        with torch.no_grad():
            flat.load(params)
        losses = []
        for epoch, start, stop in local_schedule(training, len(examples)):
            flat.grads.zero_()
            value = scalar_loss(loss(model, examples.select(orders[epoch][start:stop])), user)
            value.backward()
            with torch.no_grad():
                flat.values.sub_(flat.grads, alpha=training.lr)
            losses.append(value.detach())
        with torch.no_grad():
            delta = flat.read().sub_(params)
        return delta, float(torch.stack(losses).double().mean()) if losses else math.nan
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            named[name].copy_(value)
    trained = [(name, named[name]) for name in layout.names]
    buffers: dict[str, torch.Tensor] = {}
    losses = []
    for epoch, start, stop in local_schedule(training, len(examples)):
        model.zero_grad(set_to_none=True)
        value = scalar_loss(loss(model, examples.select(orders[epoch][start:stop])), user)
        value.backward()
        with torch.no_grad():
            for name, p in trained:
                if p.grad is None:  # a parameter the loss does not reach (as torch.optim.SGD, skip it)
                    continue
                g = p.grad + training.weight_decay * p if training.weight_decay else p.grad
                if training.momentum:
                    buffer = buffers.get(name)
                    g = buffers[name] = g.clone() if buffer is None else buffer.mul_(training.momentum).add_(g)
                p -= training.lr * g
        losses.append(value.detach())
    flat = layout.flatten({name: p.detach() for name, p in trained})
    return flat - params, float(torch.stack(losses).double().mean()) if losses else math.nan


def users_contribution(users: Sequence[UserExamples], work: LocalRound) -> tuple[Contribution, dict[str, float]]:
    """Train each (user index, examples), clip its update in the broadcast geometry; return Σu, count (and Σu²).

    Runs on ``params.device``: the model must be there; each user's examples are moved there (and to the fast
    memory format, :func:`use_fast_format`), one user at a time. Raises ValueError naming the user for a loss
    that is not a scalar or becomes NaN/Inf, and for a non-finite update.
    """
    params, scale, round_index, seed = work.params, work.scale, work.round_index, work.seed
    require_examples(users)
    memory_format = use_fast_format(work.model, users)
    total = torch.zeros_like(params)
    squares = torch.zeros_like(params) if work.send_squares else None
    losses, norms, clipped = [], [], 0
    for index, examples in users:
        examples = examples.to(params.device, memory_format)
        delta, mean_loss = local_delta(work.model, work.layout, params, examples, work.training, work.loss,
                                       user_generator(seed, round_index, index), user=index)
        check_finite_loss(mean_loss, index, round_index)
        result = clip_update(delta, work.clip_norm) if scale is None else clip_scaled(delta, scale, work.clip_norm)
        total += result.update
        if squares is not None:  # u ⊙ u rounded towards 0: each user's squares within ‖u‖² ≤ ζ² in float32 too
            squares += round_down_float32(result.update.double().square())
        losses.append(mean_loss)
        norms.append(result.norm)
        clipped += result.clipped
    count = len(users)
    return Contribution(total, count, squares, source=work.source, unclipped=count - clipped,
                        scaled=scale is not None), node_metrics(count, sum(losses), sum(norms), clipped)
