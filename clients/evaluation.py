"""Evaluation of the global model on held-out data: ready ``evaluate(model) -> {metric: number}`` functions.

    evaluation.classification((x_test, y_test))          eval_loss, eval_accuracy (+ per frequency group)
    evaluation.held_out((x_test, y_test), losses.regression)  eval_loss of any loss (MSE here)
    evaluation.held_out((tokens,), losses.next_token, perplexity=True)   eval_loss and eval_perplexity
    evaluation.next_token((tokens, mask))                eval_loss, eval_perplexity, eval_accuracy per target token
    evaluation.multi_label((x_test, multi_hot))          eval_loss, eval_precision, eval_recall, eval_f1 (micro)

The server calls them with the current global model in eval mode and without gradients
(:func:`evaluate_params`); they run on the model's device, ``batch_size`` held-out examples at a time.
Held-out data is the server's own (public or separately consented) data: evaluating on it uses no user's data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clients.task import Evaluation, Examples, Loss
from fed_dp.flat import ParamLayout

__all__ = ["classification", "evaluate_params", "held_out", "load_params", "multi_label", "next_token"]


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def held_out(data: Any, loss: Loss, *, batch_size: int = 4096, perplexity: bool = False) -> Evaluation:
    """``eval_loss``: the example-weighted mean of ``loss`` over ``data`` (and ``eval_perplexity`` =
    exp(eval_loss) with ``perplexity``, for next-token losses)."""
    examples = Examples.of(data, user="held-out data")

    def evaluate(model: nn.Module) -> dict[str, float]:
        device, total = _model_device(model), 0.0
        for start in range(0, len(examples), batch_size):
            part = slice(start, start + batch_size)
            batch = examples.structure([t[part].to(device) for t in examples.fields])
            total += float(loss(model, batch)) * (min(start + batch_size, len(examples)) - start)
        value = total / len(examples) if len(examples) else math.nan
        metrics = {"eval_loss": value}
        if perplexity:
            metrics["eval_perplexity"] = math.exp(value) if value < 700 else math.inf
        return metrics

    return evaluate


def classification(data: Any, *, class_groups: torch.Tensor | None = None, batch_size: int = 4096) -> Evaluation:
    """``eval_loss`` (mean cross-entropy) and ``eval_accuracy`` of ``(inputs, labels)``; with ``class_groups``
    (the frequency group of every class, seed 003) also ``group{k}_accuracy`` and ``group{k}_loss``."""
    examples = Examples.of(data, user="held-out data")
    if len(examples.fields) != 2:
        raise ValueError("classification evaluation takes held-out data (inputs, labels)")
    inputs, labels = examples.fields

    def evaluate(model: nn.Module) -> dict[str, float]:
        if len(labels) == 0:
            return {}
        device = _model_device(model)
        logits = torch.cat([model(inputs[i : i + batch_size].to(device)).cpu() for i in range(0, len(labels), batch_size)])
        correct = (logits.argmax(dim=1) == labels).double()
        metrics = {"eval_loss": float(F.cross_entropy(logits, labels)), "eval_accuracy": float(correct.mean())}
        if class_groups is not None:
            example_groups = class_groups[labels]
            for group in range(int(class_groups.max()) + 1):
                mask = example_groups == group
                if bool(mask.any()):
                    metrics[f"group{group}_accuracy"] = float(correct[mask].mean())
                    metrics[f"group{group}_loss"] = float(F.cross_entropy(logits[mask], labels[mask]))
        return metrics

    return evaluate


def next_token(data: Any, *, batch_size: int = 512) -> Evaluation:
    """Language-model metrics over every scored target token of ``(tokens,)`` or ``(tokens, mask)`` (the
    batches of ``fed_dp.losses.next_token``): ``eval_loss`` (mean cross-entropy per token),
    ``eval_perplexity`` = exp(eval_loss) and ``eval_accuracy`` (top-1 next-token accuracy). Tokens, not
    sequences, are the unit, so long and short sequences weigh by their number of targets."""
    examples = Examples.of(data, user="held-out data")
    if len(examples.fields) not in (1, 2):
        raise ValueError("next-token evaluation takes held-out data (tokens,) or (tokens, mask)")

    def evaluate(model: nn.Module) -> dict[str, float]:
        device, loss_sum, correct, count = _model_device(model), 0.0, 0.0, 0.0
        for start in range(0, len(examples), batch_size):
            tokens = examples.fields[0][start : start + batch_size].to(device)
            weights = (examples.fields[1][start : start + batch_size].to(device)[:, 1:] if len(examples.fields) == 2
                       else torch.ones_like(tokens[:, 1:], dtype=torch.float32))
            logits = model(tokens[:, :-1])
            targets = tokens[:, 1:]
            token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            loss_sum += float((token_loss * weights.reshape(-1)).sum())
            correct += float(((logits.argmax(-1) == targets).float() * weights).sum())
            count += float(weights.sum())
        if count == 0:
            return {}
        loss = loss_sum / count
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
                "eval_accuracy": correct / count}

    return evaluate


def multi_label(data: Any, *, batch_size: int = 1024) -> Evaluation:
    """Multi-label metrics of ``(inputs, multi-hot targets)`` (FLAIR): ``eval_loss`` (mean binary
    cross-entropy) and the micro-averaged ``eval_precision``, ``eval_recall`` and ``eval_f1`` of the labels
    predicted with probability > 1/2 (FLAIR's benchmark reports micro and macro averages; this is micro)."""
    examples = Examples.of(data, user="held-out data")
    if len(examples.fields) != 2:
        raise ValueError("multi-label evaluation takes held-out data (inputs, multi-hot targets)")
    inputs, targets = examples.fields

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = _model_device(model)
        logits = torch.cat([model(inputs[i : i + batch_size].to(device)).cpu() for i in range(0, len(targets), batch_size)])
        predicted = (logits > 0).float()
        true_positive = float((predicted * targets).sum())
        precision = true_positive / max(float(predicted.sum()), 1.0)
        recall = true_positive / max(float(targets.sum()), 1.0)
        return {"eval_loss": float(F.binary_cross_entropy_with_logits(logits, targets)), "eval_precision": precision,
                "eval_recall": recall, "eval_f1": 2 * precision * recall / max(precision + recall, 1e-12)}

    return evaluate


def load_params(model: nn.Module, layout: ParamLayout, params: torch.Tensor) -> None:
    """Copy the flat θ into the model's parameters (by name, on the model's device)."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(params).items():
            named[name].copy_(value)


def evaluate_params(model: nn.Module, layout: ParamLayout, params: torch.Tensor,
                    evaluate: Callable[[nn.Module], Mapping[str, float]]) -> dict[str, float]:
    """Run ``evaluate`` on ``model`` holding θ = ``params``, in eval mode (restored after) and without
    gradients; the metrics must be numbers."""
    load_params(model, layout, params)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metrics = dict(evaluate(model))
    finally:
        model.train(was_training)
    bad = {k: v for k, v in metrics.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
    if bad:
        raise ValueError(f"the task's evaluate returned non-numeric metrics {bad}; return {{name: number}}")
    return {k: float(v) for k, v in metrics.items()}
