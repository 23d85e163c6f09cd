"""Which of the three training paths trains a node's users, and the dispatcher that runs it (:func:`contribution`).

Every path computes the same contribution (Σ of the users' clipped updates, with the same per-user generators):

- one-step (``fed_dp.clients.one_step``): users whose local training is one full-batch gradient step, without a
  model per user;
- vectorized (``fed_dp.clients.vectorized``): many users at once with ``torch.func.vmap``, for models
  :func:`fed_dp.clients.vectorized.can_vectorize` accepts;
- sequential (``fed_dp.clients.training``): one user after another, for every model.

The automatic choice (``client.training = "auto"``): one-step users take the one-step path unless it refuses the
model or loss; the others are vectorized on CUDA, and on the CPU only for small models without convolutions
(:func:`vectorizes_on_cpu`, measured), sequential otherwise (:func:`select_path`, which says why). A model that vmap
cannot trace falls back to the sequential path with one log line. ``True`` forces the vectorized path (or an error),
``False`` the sequential one. :func:`path_metrics` records which path ran.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from fed_dp.clients import one_step
from fed_dp.clients import training as sequential
from fed_dp.clients.training import LocalRound, UserExamples
from fed_dp.clients.vectorized import can_vectorize, users_contribution
from fed_dp.contribution import Contribution

log = logging.getLogger("fed_dp.clients")

__all__ = ["CPU_VECTORIZE_MAX_PARAMS", "Path", "contribution", "path_metrics", "select_path", "vectorizes_on_cpu"]

#: The path that trained a node's users: "one-step" (``clients.one_step``, every user), "vectorized" or "sequential",
#: or "one-step+vectorized" / "one-step+sequential" when only some users train one full-batch step.
Path = str

#: The largest model the auto choice vectorizes on a CPU. Measured on 2 cores, one torch thread, a few rounds of
#: each workload, vectorized against sequential: linear models of 448 to 8,255 parameters (heavy-tail-quick,
#: seed000-adagrad-1d, the main job with one-step training switched off) 3-5x faster; the 130,012-parameter
#: bigram language model (embedding, LayerNorm, 10,000-word output layer) 1.7x slower. The bound lies between.
CPU_VECTORIZE_MAX_PARAMS = 2**15


def vectorizes_on_cpu(model: nn.Module) -> tuple[bool, str]:
    """Whether vmap over users beats one user at a time on a CPU for ``model``, and why not: no convolution
    (vmap turns a per-user convolution into a grouped one, whose CPU backward kernel is several times slower than
    the per-user kernels: the W1 CNN trains 3x slower vectorized) and at most :data:`CPU_VECTORIZE_MAX_PARAMS`
    parameters (per-user copies of a larger model cost more memory traffic than the per-user loop's overhead)."""
    for name, module in model.named_modules():
        if isinstance(module, _ConvNd):
            return False, f"it has a convolution ({name}: {type(module).__name__})"
    size = sum(p.numel() for p in model.parameters())
    if size > CPU_VECTORIZE_MAX_PARAMS:
        return False, f"{size:,} parameters, more than {CPU_VECTORIZE_MAX_PARAMS:,}"
    return True, ""


def select_path(model: nn.Module, vectorized: bool | None = None,
                device: torch.device | str | None = None) -> tuple[Path, str]:
    """Which path :func:`contribution` takes for ``model`` on ``device``: ``(path, reason)``.

    ``vectorized=None`` (auto): ``"vectorized"`` on a CUDA device when :func:`can_vectorize` allows it; on the
    CPU only for small models without convolutions (:func:`vectorizes_on_cpu`), ``"sequential"`` for the others
    and for models that cannot be vectorized, with the reason.
    ``True``: ``"vectorized"`` or a ValueError with the reason. ``False``: ``"sequential"``.
    """
    if vectorized is False:
        return "sequential", "vectorized=False"
    ok, reason = can_vectorize(model)
    if vectorized is None and ok and torch.device(device or "cpu").type == "cpu":
        fits, why = vectorizes_on_cpu(model)
        if not fits:
            return "sequential", f"auto on CPU: the sequential path is the faster one for this model ({why})"
    if ok:
        return "vectorized", ""
    if vectorized:
        raise ValueError(f"cannot vectorize local training over users: {reason}")
    return "sequential", reason


#: Errors of torch.func that mean "this model or loss cannot be traced by vmap" (data-dependent control flow,
#: ``.item()``, in-place ops on captured tensors, ...), as opposed to errors of the user's code.
_VMAP_MARKERS = ("vmap", "functorch", "batched tensor", "data-dependent", "item()", "BatchedTensor")
_reported_fallbacks: set[str] = set()


def _untraceable(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(marker.lower() in str(error).lower() for marker in _VMAP_MARKERS)


def contribution(users: Sequence[UserExamples], work: LocalRound, *, vectorized: bool | None = None,
                 chunk_size: int | None = None) -> tuple[Contribution, dict[str, float], Path]:
    """The node's contribution by the one-step, the vectorized or the sequential path, on ``work.params.device``.

    The arguments of ``users_contribution`` plus ``vectorized`` (``None``: auto; ``True``: vectorized or
    ValueError; ``False``: sequential) and ``chunk_size`` (vectorized path only). Returns ``(Contribution, metrics,
    path)``: the first two exactly as ``users_contribution`` returns them (metrics stay floats, ready for a Flower
    MetricRecord) and ``path`` (:data:`Path`), the path that ran.

    Auto: users whose local training is one full-batch step train on ``clients.one_step`` (no model per user);
    the others by device (:func:`select_path`). When the one-step path cannot train the model or loss, or vmap
    cannot trace them (data-dependent control flow and the like), the reason is logged once per model and those
    users take the next path; with ``vectorized=True`` a vmap error is raised.
    """
    if work.scale is not None:  # s_t arrives from the server; it must sit with θ
        work = replace(work, scale=work.scale.to(work.params.device))
    model = work.model
    mine: Sequence[UserExamples] = []
    if vectorized is None and getattr(model, "_fed_dp_one_step_refused", None) is None:
        mine, users = one_step.one_step_users(users, work.training)
    if mine:
        try:
            fast, fast_metrics = one_step.users_contribution(mine, work, max_extra_macs=one_step.AUTO_MAX_EXTRA_MACS)
        except one_step.Unsupported as refusal:
            model._fed_dp_one_step_refused = str(refusal)
            log.warning("training users with a model per user: %s cannot take the one-step path (%s)",
                        type(model).__name__, refusal)
            users = [*mine, *users]
        else:
            if not users:
                return fast, fast_metrics, "one-step"
            rest, rest_metrics, path = _model_per_user(users, work, vectorized, chunk_size)
            return _merge(fast, rest), _merge_metrics(fast_metrics, len(mine), rest_metrics, len(users)), \
                f"one-step+{path}"
    return _model_per_user(users, work, vectorized, chunk_size)


def path_metrics(path: Path) -> dict[str, float]:
    """The record of which path trained a node's users: ``vectorized`` (1 when the users that needed a model per
    user were vectorized) and ``one_step`` (1 when some trained on the one-step path). Which users were sampled
    decides it, so the server keeps it with the non-private diagnostics (``nonprivate_`` in simulations)."""
    return {"vectorized": float(path.endswith("vectorized")), "one_step": float(path.startswith("one-step"))}


def _model_per_user(users: Sequence[UserExamples], work: LocalRound, vectorized: bool | None,
                    chunk_size: int | None) -> tuple[Contribution, dict[str, float], Path]:
    """The vectorized or the sequential path (:func:`select_path`), with the vmap fallback of :func:`contribution`."""
    model = work.model
    path, _ = select_path(model, vectorized, work.params.device)
    if path == "vectorized":
        try:
            result, metrics = users_contribution(users, work, chunk_size=chunk_size)
            return result, metrics, path
        except RuntimeError as error:
            if vectorized or not _untraceable(error):
                raise
            name = type(model).__name__
            if name not in _reported_fallbacks:
                _reported_fallbacks.add(name)
                log.warning("training users one at a time: %s cannot be vectorized over users with torch.func "
                            "(%s: %s)", name, type(error).__name__, str(error).splitlines()[0])
    result, metrics = sequential.users_contribution(users, work)
    return result, metrics, "sequential"


def _merge(a: Contribution, b: Contribution) -> Contribution:
    """One node's reply from two disjoint sets of its users."""
    squares = None if a.total_squares is None else a.total_squares + b.total_squares
    return Contribution(a.total + b.total, a.count + b.count, squares, source=a.source,
                        unclipped=a.unclipped + b.unclipped, scaled=a.scaled)


def _merge_metrics(a: dict[str, float], count_a: int, b: dict[str, float], count_b: int) -> dict[str, float]:
    """Per-user means over both sets (each metric is a mean over its users)."""
    return {key: (a[key] * count_a + b[key] * count_b) / (count_a + count_b) for key in a}
