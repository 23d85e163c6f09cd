"""Hugging Face ``transformers`` models, with or without a ``peft`` adapter, as the model of a fed-dp Task.

An optional part: ``pip install -e ".[hf]"`` installs ``transformers`` and ``peft``; nothing else of fed-dp imports
them.

    from peft import LoraConfig
    from transformers import GPT2Config
    from fed_dp.clients import hf

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)      # or a save_pretrained folder
    model = lambda: hf.transformer("/models/gpt2", "causal-lm",
                                   peft_config=LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))
    task = hf.hf_task(model=model, head="causal-lm", users=users, held_out=(tokens, mask))

:func:`transformer` builds the model (from a local ``save_pretrained`` folder, a hub name when the machine has the
network, or a ``transformers`` config: the architecture with fresh weights), applies the adapter (``peft``'s own
LoRA and the rest: fed-dp has no adapter code of its own), freezes what is not to be trained, and wraps the result in
:class:`Logits`, so that the model returns a tensor of logits instead of a ``ModelOutput``. fed-dp's losses then
apply as they are, per head (:data:`HEADS`):

| head | model | batch | loss | evaluation |
|---|---|---|---|---|
| ``causal-lm`` | ``AutoModelForCausalLM`` | ``(tokens, mask)`` (b, L) | ``losses.next_token``: mean cross-entropy of every scored next token | ``evaluation.next_token`` |
| ``sequence-classification`` | ``AutoModelForSequenceClassification`` | ``(inputs, labels)``; inputs (b, L) ids or (b, 2, L) ids and token types | ``losses.classification``: mean cross-entropy | ``evaluation.classification`` |

Both losses carry ``per_example``, so users whose local training is one full-batch step take the one-step path
(``fed_dp.clients.one_step``; LoRA's ``lora_A``/``lora_B`` are ``nn.Linear`` layers it trains, and frozen layers
of other types, such as GPT-2's ``Conv1D``, are no obstacle); the others train vectorized or one at a time.

What is trained is what has ``requires_grad`` after :func:`transformer` (``fed_dp.clients.task.trainable_parameters``):
the adapter's parameters under ``peft``, the parameters matching ``trainable`` otherwise. The rest is frozen: never
noised, never sent; every node builds it the same way (the same folder, or ``init_seed``), and the server refuses a
node whose frozen values differ before round 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fed_dp.clients import evaluation, losses
from fed_dp.clients.task import Loss, Task, Users, trainable_parameters

__all__ = ["HEADS", "Logits", "hf_task", "pretrained_config", "require", "trainable_count", "transformer"]

#: head → (the ``transformers`` auto class's name, the loss, the evaluation builder): see the module docstring.
HEADS: dict[str, tuple[str, Loss, Callable[..., Any]]] = {
    "causal-lm": ("AutoModelForCausalLM", losses.next_token, evaluation.next_token),
    "sequence-classification": ("AutoModelForSequenceClassification", losses.classification,
                                evaluation.classification),
}


def require() -> Any:
    """The ``transformers`` module, or a ValueError saying how to install the optional part."""
    try:
        import transformers
    except ImportError as error:
        raise ValueError("this needs Hugging Face transformers (and peft for adapters), fed-dp's optional 'hf' "
                         "part: pip install -e \".[hf]\" (or pip install transformers peft)") from error
    return transformers


class Logits(nn.Module):
    """A ``transformers`` model called the way fed-dp's losses and evaluations call a model: ``forward(inputs)``
    returns the ``logits`` of the model's output.

    ``inputs``: (b, L) input ids, or (b, 2, L) for sentence pairs: input ids and token type ids. With
    ``pad_token_id`` the attention mask is ``ids != pad_token_id`` (bidirectional encoders such as BERT must not
    attend to padding); without it no mask is passed: a causal model with right padding needs none, since every
    padded position comes after the positions the loss scores. The wrapped model is ``self.model``
    (``model.model.save_pretrained(folder)`` saves it in the ``transformers`` format)."""

    def __init__(self, model: nn.Module, pad_token_id: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.pad_token_id = pad_token_id

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        extra: dict[str, torch.Tensor] = {}
        ids = inputs
        if inputs.ndim == 3:
            ids, extra["token_type_ids"] = inputs[:, 0], inputs[:, 1]
        if self.pad_token_id is not None:
            extra["attention_mask"] = (ids != self.pad_token_id).long()
        return self.model(input_ids=ids, **extra).logits


def _unloadable(source: str, error: Exception) -> ValueError:
    return ValueError(f"task.pretrained = {source!r}: no model could be loaded from it ({error}); give a local folder "
                      "written by save_pretrained (or a hub name on a machine with the network)")


def pretrained_config(source: str) -> Any:
    """The ``transformers`` config of a pretrained model (a ``save_pretrained`` folder or a hub name), or a
    ValueError naming ``task.pretrained``."""
    try:
        return require().AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise _unloadable(source, error) from error


def _build(source: Any, auto_class: Any, init_seed: int | None, num_labels: int | None) -> nn.Module:
    if isinstance(source, str):
        try:
            return auto_class.from_pretrained(source, **({} if num_labels is None else {"num_labels": num_labels}))
        except (OSError, ValueError) as error:
            raise _unloadable(source, error) from error
    if init_seed is None:
        return auto_class.from_config(source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return auto_class.from_config(source)


def transformer(source: Any, head: str, *, peft_config: Any = None, trainable: Sequence[str] | None = None,
                pad_token_id: int | None = None, init_seed: int | None = None, dropout: float | None = 0.0,
                num_labels: int | None = None) -> Logits:
    """A ``transformers`` model for ``head`` (:data:`HEADS`), ready to be a Task's model (module docstring).

    source: a ``save_pretrained`` folder or a hub name (``from_pretrained``), or a ``transformers`` config (the
        architecture, weights initialized: with the torch RNG seeded to ``init_seed`` when given, so that every
        process builds the same frozen weights whatever its own seed).
    peft_config: an optional ``peft`` config (e.g. ``LoraConfig``): ``peft.get_peft_model`` adds the adapter and
        freezes the base model.
    trainable: optional regular expressions; a parameter is then trainable exactly when its name matches one of
        them (``re.search``), e.g. ``[r"encoder\\.layer\\.11\\.", r"pooler", r"classifier"]``. Applied after the
        adapter. A pattern that matches no parameter is an error.
    pad_token_id: the id of padding, for models that must not attend to it (:class:`Logits`).
    dropout: the probability every dropout layer is set to (0 by default: active dropout draws its masks from the
        global RNG, which only the sequential path reproduces; the one-step and vectorized paths refuse it).
        None leaves the model's own.
    num_labels: the classes of a sequence classifier loaded from ``source`` (a pretrained base gets a new
        classifier of that size); a config says it itself.
    """
    transformers = require()
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    model = _build(source, getattr(transformers, HEADS[head][0]), init_seed, num_labels)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False  # training: no key/value cache in the outputs
    if peft_config is not None:
        try:
            import peft
        except ImportError as error:
            raise ValueError("an adapter needs peft: pip install -e \".[hf]\" (or pip install peft)") from error
        model = peft.get_peft_model(model, peft_config)
    if trainable is not None:
        patterns = [re.compile(p) for p in trainable]
        unused = [p.pattern for p in patterns if not any(p.search(n) for n, _ in model.named_parameters())]
        if unused:
            raise ValueError(f"trainable patterns {unused} match no parameter of the model (its parameters are named "
                             f"like {[n for n, _ in model.named_parameters()][:3]})")
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(any(p.search(name) for p in patterns))
    if dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = float(dropout)
    return Logits(model, pad_token_id)


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of ``model`` (tied parameters counted once)."""
    return (sum(p.numel() for p in trainable_parameters(model).values()),
            sum(p.numel() for p in model.parameters()))


def hf_task(*, model: Callable[[], nn.Module], head: str, users: Users, held_out: Any = None, name: str = "hf",
            description: str = "", info: dict[str, Any] | None = None) -> Task:
    """A Task whose model is a :func:`transformer` factory, with the loss and the evaluation of ``head``
    (:data:`HEADS`): ``held_out`` (the server's own data, in the batch structure of the head) is evaluated with
    ``evaluation.next_token`` or ``evaluation.classification``; None: no evaluation."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    _, loss, evaluate = HEADS[head]
    return Task(model=model, users=users, loss=loss, evaluate=None if held_out is None else evaluate(held_out),
                name=name, description=description, info=dict(info or {}))
