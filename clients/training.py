"""Local training on a user's data and the clipped contribution a node sends (ALGORITHMS §1).

For each sampled user i hosted here:

    Δ_i = θ_i − θ_{t−1}   after local SGD from the broadcast θ_{t−1} on user i's data
    u_i = clip(Δ_i, ζ)    or clip(s_t ⊙ Δ_i, ζ) for scale-then-privatize (the broadcast s_t)

and the node replies with Σ u_i, the count, and Σ u_i² when the server's optimizer asks for squares
(independent moment estimation). Users are trained one at a time here; the fast engine vectorizes this.
The same code runs in the Flower ClientApp (one node, its users) and in the in-process simulation engine
(one node hosting every user), so both engines compute the same contributions.

Local training uses a generator seeded from (seed, round, user id), so a run is reproducible and another
engine reproduces the same local updates.

Users' data is moved to the device of the broadcast parameters (``params.device``: CPU or ``cuda``), and
image batches for convolutional models run in the channels-last memory format (see
:func:`input_memory_format`): the same numbers up to float32 rounding, measured 1.5–2× faster on the
2-core CPUs here for the W1 CNN, whose NCHW max-pooling was the slowest kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clipping import clip_scaled, clip_update
from fed_dp.flat import ParamLayout
from fed_dp.round import Contribution
from fed_dp.simulations.task import UserData


@dataclass(frozen=True, kw_only=True)
class LocalTraining:
    """Local SGD of one user: ``epochs`` passes over its data in shuffled minibatches of ``batch_size``."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"local epochs must be an integer >= 1, got {self.epochs!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"local batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"local lr must be a finite number > 0, got {self.lr!r}")


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


def input_memory_format(model: nn.Module, x: torch.Tensor) -> torch.memory_format:
    """``torch.channels_last`` when ``x`` is a batch of images (4-D) and ``model`` has a ``Conv2d``, else
    ``torch.contiguous_format``.

    Convolution, ReLU and max-pooling kernels are vectorized over channels in the NHWC layout; a model is
    switched to it with ``model.to(memory_format=torch.channels_last)`` (only its 4-D weights change
    strides, its parameters stay the same objects and the same values).
    """
    if x.ndim == 4 and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return torch.channels_last
    return torch.contiguous_format


def use_fast_format(model: nn.Module, users: Sequence[tuple[int, UserData]]) -> torch.memory_format:
    """The memory format the users' inputs should have (:func:`input_memory_format` of the first user's
    data); switches ``model`` to channels-last when that is the format."""
    if not users:
        return torch.contiguous_format
    memory_format = input_memory_format(model, users[0][1].x)
    if memory_format is torch.channels_last:
        model.to(memory_format=memory_format)
    return memory_format


def to_device(data: UserData, device: torch.device, memory_format: torch.memory_format) -> UserData:
    """``data`` on ``device`` with inputs in ``memory_format``; no copy when it is already so."""
    return UserData(data.x.to(device, memory_format=memory_format), data.y.to(device))


def user_generator(seed: int, round_index: int, user_id: int) -> torch.Generator:
    """The generator of user ``user_id``'s local training in round ``round_index`` (stable mixing)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + user_id * 0x94D049BB133111EB)
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


def local_delta(
    model: nn.Module,
    layout: ParamLayout,
    params: torch.Tensor,
    data: UserData,
    training: LocalTraining,
    generator: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """Δ_i = θ_i − θ_{t−1} after local SGD from ``params``; also the mean training loss seen.

    ``data`` must be on the device of ``params`` and the model (``users_contribution`` moves it there).
    The minibatch order comes from ``generator`` (a CPU generator), one ``randperm`` per epoch.
    """
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            named[name].copy_(value)
    losses = []
    n = len(data)
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=generator, device="cpu").to(data.x.device)
        for start in range(0, n, training.batch_size):
            batch = order[start : start + training.batch_size]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.x[batch]), data.y[batch])
            loss.backward()
            loss = loss.detach()
            with torch.no_grad():
                for p in model.parameters():
                    p -= training.lr * p.grad
            losses.append(loss)
    trained = layout.flatten({k: v.detach() for k, v in model.named_parameters()})
    return trained - params, float(torch.stack(losses).double().mean()) if losses else math.nan


def users_contribution(
    users: Sequence[tuple[int, UserData]],
    *,
    params: torch.Tensor,
    round_index: int,
    clip_norm: float,
    scale: torch.Tensor | None,
    send_squares: bool,
    model: nn.Module,
    layout: ParamLayout,
    training: LocalTraining,
    seed: int,
    source: str = "",
) -> tuple[Contribution, dict[str, float]]:
    """Train each (user id, data), clip its update in the broadcast geometry; return Σu, count (and Σu²).

    Runs on ``params.device``: the model must be there; each user's data is moved there (and to the fast
    memory format, :func:`use_fast_format`), one user at a time.
    """
    memory_format = use_fast_format(model, users)
    total = torch.zeros_like(params)
    squares = torch.zeros_like(params) if send_squares else None
    losses, norms, clipped = [], [], 0
    for user_id, data in users:
        data = to_device(data, params.device, memory_format)
        delta, loss = local_delta(model, layout, params, data, training, user_generator(seed, round_index, user_id))
        result = clip_update(delta, clip_norm) if scale is None else clip_scaled(delta, scale, clip_norm)
        total += result.update
        if squares is not None:
            squares += result.update.square()
        losses.append(loss)
        norms.append(result.norm)
        clipped += result.clipped
    count = len(users)
    metrics = {
        "train_loss": sum(losses) / count if count else math.nan,
        "mean_update_norm": sum(norms) / count if count else math.nan,
        "fraction_clipped": clipped / count if count else math.nan,
    }
    return Contribution(total, count, squares, source=source, unclipped=count - clipped), metrics
