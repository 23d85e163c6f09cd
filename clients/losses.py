"""Ready losses ``loss(model, batch) -> scalar``: the mean loss of one user's minibatch.

| loss | batch | model output | value |
|---|---|---|---|
| :func:`classification` | ``(inputs, labels)``, integer labels (b,) | logits (b, classes) | mean cross-entropy |
| :func:`next_token` | ``(tokens,)`` integer (b, L), or ``(tokens, mask)`` | logits (b, L − 1, vocabulary) for ``tokens[:, :-1]`` | mean cross-entropy of each (masked-in) next token |
| :func:`multi_label` | ``(inputs, targets)``, float multi-hot targets (b, labels) | logits (b, labels) | mean binary cross-entropy |
| :func:`regression` | ``(inputs, targets)``, floating-point targets | the targets' shape (or with a trailing 1) | mean squared error |

Each checks what it can from shapes and dtypes and says what is wrong and what to use instead: a float target
given to the classification loss (a regression target: use :func:`regression`), integer labels given to the
regression loss, outputs that do not fit the targets. These checks use shapes and dtypes only, so the losses
also run vectorized over users (``torch.func.vmap``). Write your own loss the same way: take ``(model,
batch)``, call ``model(...)``, return a scalar tensor.

Each also has ``per_example(model, batch) -> (a, b)``, two (batch,) tensors with loss = Σ a_i / max(Σ b_i, 1)
(cross-entropy: a_i = ℓ_i, b_i = 1; masked next-token: a_i = Σ_t w_t ℓ_t, b_i = Σ_t w_t). With it, users whose
local training is one full-batch step train together without a model per user (``fed_dp.clients.one_step``).
Give your own loss the same attribute to use that path; it is checked against the loss on the first batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fed_dp.clients.task import Batch

__all__ = ["classification", "multi_label", "next_token", "regression"]


def _pair(batch: Batch, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict) or len(batch) != 2:
        got = f"keys {list(batch)}" if isinstance(batch, dict) else f"{len(batch)} tensor(s)"
        raise ValueError(f"the {loss} loss takes batches (inputs, targets): each user's examples must be a pair "
                         f"of tensors; got {got}")
    return batch[0], batch[1]


def _logits_and_labels(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = _pair(batch, "classification")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"the classification loss got targets of dtype {labels.dtype}: class labels must be "
                         "integers (torch.long). Floating-point targets are a regression target: use "
                         "fed_dp.losses.regression (mean squared error)")
    logits = model(inputs)
    if logits.ndim != 2 or logits.shape[0] != labels.shape[0] or labels.ndim != 1:
        raise ValueError(f"the model's outputs of shape {tuple(logits.shape)} do not fit the classification loss "
                         f"with labels of shape {tuple(labels.shape)}: it needs logits (batch, classes) and labels "
                         "(batch,)")
    return logits, labels


def classification(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of logits ``model(inputs)`` (batch, classes) against integer ``labels`` (batch,)."""
    return F.cross_entropy(*_logits_and_labels(model, batch))


def _classification_terms(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: (cross-entropy ℓ_i, 1)."""
    losses = F.cross_entropy(*_logits_and_labels(model, batch), reduction="none")
    return losses, torch.ones_like(losses)


def _token_losses(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-entropy of every next token (b, L − 1) and the mask (b, L) or None."""
    tokens, mask = _tokens_and_mask(batch)
    logits = model(tokens[:, :-1])
    if logits.ndim != 3 or tuple(logits.shape[:2]) != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(f"the model's outputs of shape {tuple(logits.shape)} do not fit the next-token loss: for "
                         f"inputs of shape {tuple(tokens[:, :-1].shape)} it needs logits (batch, length, vocabulary)")
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    return losses.view(tokens.shape[0], -1), mask


def next_token(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token language modelling: logits = ``model(tokens[:, :-1])`` of shape (b, L − 1, V), mean
    cross-entropy against ``tokens[:, 1:]``. A batch is ``(tokens,)`` with integer tokens (b, L), L ≥ 2, or
    ``(tokens, mask)`` with a float mask (b, L) that weights each target token (1 = scored, 0 = not: padding,
    or the prompt of conditional generation); the loss is then the mean over the scored tokens."""
    losses, mask = _token_losses(model, batch)
    losses = losses.reshape(-1)
    if mask is None:
        return losses.mean()
    weights = mask[:, 1:].reshape(-1).to(losses.dtype)
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


def _next_token_terms(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: (Σ_t w_t ℓ_t, Σ_t w_t) with w = the mask's target part (1 without a mask)."""
    losses, mask = _token_losses(model, batch)
    weights = torch.ones_like(losses) if mask is None else mask[:, 1:].to(losses.dtype)
    return (losses * weights).sum(1), weights.sum(1)


def _tokens_and_mask(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict) or len(batch) not in (1, 2):
        raise ValueError("the next-token loss takes batches (tokens,) or (tokens, mask): each user's examples must "
                         "be an integer tensor of token sequences (examples, sequence length), optionally with a "
                         "float mask of the same shape marking the target tokens")
    tokens = batch[0]
    if tokens.dtype.is_floating_point or tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"the next-token loss needs integer tokens of shape (batch, length >= 2), got "
                         f"{tuple(tokens.shape)} of dtype {tokens.dtype}")
    mask = batch[1] if len(batch) == 2 else None
    if mask is not None and (mask.shape != tokens.shape or not mask.dtype.is_floating_point):
        raise ValueError(f"the next-token mask must be a float tensor of the tokens' shape {tuple(tokens.shape)}, "
                         f"got {tuple(mask.shape)} of dtype {mask.dtype}")
    return tokens, mask


def _multi_label_pair(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = _pair(batch, "multi-label")
    if not targets.dtype.is_floating_point or targets.ndim != 2:
        raise ValueError(f"the multi-label loss needs float multi-hot targets (batch, labels), got "
                         f"{tuple(targets.shape)} of dtype {targets.dtype}")
    logits = model(inputs)
    if logits.shape != targets.shape:
        raise ValueError(f"the model's outputs of shape {tuple(logits.shape)} do not fit multi-hot targets of shape "
                         f"{tuple(targets.shape)}: it needs one logit per label")
    return logits, targets


def multi_label(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Multi-label classification (FLAIR): mean over examples and labels of the binary cross-entropy of logits
    ``model(inputs)`` (batch, labels) against float multi-hot ``targets`` (batch, labels) in {0, 1}."""
    return F.binary_cross_entropy_with_logits(*_multi_label_pair(model, batch))


def _multi_label_terms(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: (Σ over labels of the binary cross-entropy, the number of labels)."""
    losses = F.binary_cross_entropy_with_logits(*_multi_label_pair(model, batch), reduction="none")
    return losses.sum(1), torch.full_like(losses[:, 0], losses.shape[1])


def _outputs_and_targets(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = _pair(batch, "regression")
    if not targets.dtype.is_floating_point:
        raise ValueError(f"the regression loss got targets of dtype {targets.dtype}: integer targets look like class "
                         "labels; use fed_dp.losses.classification, or convert the targets to float")
    outputs = model(inputs)
    if outputs.shape != targets.shape and tuple(outputs.shape) == tuple(targets.shape) + (1,):
        outputs = outputs.squeeze(-1)
    if outputs.shape != targets.shape:
        raise ValueError(f"the model's outputs of shape {tuple(outputs.shape)} do not fit targets of shape "
                         f"{tuple(targets.shape)} (the regression loss compares them element by element; "
                         "broadcasting them would silently compare every output with every target)")
    return outputs, targets


def regression(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean squared error of ``model(inputs)`` against floating-point ``targets`` of the same shape (an output
    with one extra trailing dimension of size 1, as ``nn.Linear(k, 1)`` gives for targets (b,), is squeezed)."""
    return F.mse_loss(*_outputs_and_targets(model, batch))


def _regression_terms(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: (Σ of its squared errors, its number of targets)."""
    errors = F.mse_loss(*_outputs_and_targets(model, batch), reduction="none")
    errors = errors.reshape(errors.shape[0], -1)  # (b,) targets: one error per example
    return errors.sum(1), torch.full_like(errors[:, 0], errors.shape[1])


classification.per_example = _classification_terms
next_token.per_example = _next_token_terms
multi_label.per_example = _multi_label_terms
regression.per_example = _regression_terms
