"""Local training on a user's data and the clipped contribution a node sends (ALGORITHMS §1).

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

import math
from collections.abc import Sequence

import torch
from torch import nn

from fed_dp.clients.task import Examples, Loss
from fed_dp.clipping import clip_scaled, clip_update
from fed_dp.config import LocalTraining
from fed_dp.flat import ParamLayout
from fed_dp.contribution import Contribution

#: (user index, that user's examples): what a node trains in a round.
UserExamples = tuple[int, Examples]


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


def minibatch_orders(n: int, training: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """One permutation of the user's m = min(n, max_examples) examples per epoch its schedule touches, drawn
    from ``generator`` on the CPU in epoch order (the vectorized path draws the same ones)."""
    m = training.examples_used(n)
    return [torch.randperm(m, generator=generator, device="cpu") for _ in range(training.epochs_needed(n))]


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
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            named[name].copy_(value)
    trained = [(name, named[name]) for name in layout.names]
    orders = [order.to(params.device) for order in minibatch_orders(len(examples), training, generator)]
    buffers: dict[str, torch.Tensor] = {}
    losses = []
    for epoch, start, stop in training.schedule(len(examples)):
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


def users_contribution(
    users: Sequence[UserExamples],
    *,
    params: torch.Tensor,
    round_index: int,
    clip_norm: float,
    scale: torch.Tensor | None,
    send_squares: bool,
    model: nn.Module,
    layout: ParamLayout,
    training: LocalTraining,
    loss: Loss,
    seed: int,
    source: str = "",
) -> tuple[Contribution, dict[str, float]]:
    """Train each (user index, examples), clip its update in the broadcast geometry; return Σu, count (and Σu²).

    Runs on ``params.device``: the model must be there; each user's examples are moved there (and to the fast
    memory format, :func:`use_fast_format`), one user at a time. Raises ValueError naming the user for a loss
    that is not a scalar or becomes NaN/Inf, and for a non-finite update.
    """
    require_examples(users)
    memory_format = use_fast_format(model, users)
    total = torch.zeros_like(params)
    squares = torch.zeros_like(params) if send_squares else None
    losses, norms, clipped = [], [], 0
    for index, examples in users:
        examples = examples.to(params.device, memory_format)
        delta, mean_loss = local_delta(model, layout, params, examples, training, loss,
                                       user_generator(seed, round_index, index), user=index)
        check_finite_loss(mean_loss, index, round_index)
        result = clip_update(delta, clip_norm) if scale is None else clip_scaled(delta, scale, clip_norm)
        total += result.update
        if squares is not None:
            squares += result.update.square()
        losses.append(mean_loss)
        norms.append(result.norm)
        clipped += result.clipped
    count = len(users)
    metrics = {
        "train_loss": sum(losses) / count if count else math.nan,
        "mean_update_norm": sum(norms) / count if count else math.nan,
        "fraction_clipped": clipped / count if count else math.nan,
    }
    return Contribution(total, count, squares, source=source, unclipped=count - clipped,
                        scaled=scale is not None), metrics
