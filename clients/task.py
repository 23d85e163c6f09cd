"""The task a user brings: a model factory, per-user data loaded on demand, a loss, and an optional evaluation.

    task = Task(
        model=lambda: MyNet(),                               # a fresh torch.nn.Module
        users=Users.split((x, y), user_of_example),          # or Users(ids, load) / Users.from_mapping / in_memory
        loss=losses.classification,                          # (model, batch) -> scalar tensor
        evaluate=evaluation.classification((x_test, y_test)),  # optional: (model) -> {"name": number}
    )

Users and their ids. The samplers draw *indices* 0 .. N−1; ``users.ids[i]`` is the user behind index i (any
hashable: an int, an author's name, a file name) and ``users[i]`` loads that user's examples. Only the
users sampled in a round are loaded, one at a time (or a chunk at a time), so a population of 100,000 users
whose data sits on disk never has to fit in memory. :meth:`Users.in_memory` and :meth:`Users.split` hold
every user's tensors up front: the fast special case for data that fits.

Examples and batches. A user's examples are tensors that share their first dimension n: a tuple
``(inputs, targets)`` (or any number of tensors), or a dict of tensors. A minibatch has the same structure
with n replaced by the batch size, and it is what the loss receives. A ``torch.utils.data.Dataset`` of
one user is read in full and collated with ``torch.utils.data.default_collate``.

Everything here fails early and says what to do: a loader that returns nothing usable, a user without
examples, a factory that does not return a ``torch.nn.Module``, a task reference that does not import.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch
from torch import nn

from fed_dp.flat import ParamLayout

Batch = Union[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]
Loss = Callable[[nn.Module, Batch], torch.Tensor]
Evaluation = Callable[[nn.Module], Mapping[str, float]]

__all__ = ["Batch", "Evaluation", "Examples", "Loss", "Task", "Users", "build_task", "check_model", "frozen_fingerprint",
           "frozen_parameters", "initial_model", "load_task", "model_fingerprint", "seeded_model", "trainable_layout",
           "trainable_parameters"]


def _tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise ValueError(f"{where} is a {type(value).__name__}; examples must be torch tensors or numpy arrays")


@dataclass(frozen=True)
class Examples:
    """One user's examples: tensors sharing their first dimension n, as a tuple or (with ``keys``) a dict."""

    fields: tuple[torch.Tensor, ...]
    keys: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("a user's examples need at least one tensor")
        sizes = {int(t.shape[0]) if t.ndim else -1 for t in self.fields}
        if len(sizes) != 1 or -1 in sizes:
            shapes = [tuple(t.shape) for t in self.fields]
            raise ValueError(f"the tensors of a user's examples must share their first dimension (the examples); "
                             f"got shapes {shapes}")
        if self.keys is not None and len(self.keys) != len(self.fields):
            raise ValueError(f"{len(self.keys)} keys for {len(self.fields)} tensors")

    @classmethod
    def of(cls, data: Any, *, user: Hashable = "?") -> "Examples":
        """``data`` as Examples: Examples, a tuple/list of tensors or arrays, a dict of them, one tensor, or a
        ``torch.utils.data.Dataset`` of the user (read in full and collated)."""
        where = f"the data of user {user!r}"
        if isinstance(data, Examples):
            return data
        if isinstance(data, (torch.Tensor, np.ndarray)):
            return cls((_tensor(data, where),))
        if isinstance(data, Mapping):
            return cls(tuple(_tensor(v, f"{where}[{k!r}]") for k, v in data.items()), tuple(str(k) for k in data))
        if isinstance(data, (tuple, list)):
            return cls(tuple(_tensor(v, f"{where}[{i}]") for i, v in enumerate(data)))
        if isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__"):
            items = [data[i] for i in range(len(data))]
            if not items:
                raise ValueError(f"user {user!r} has no examples (its Dataset is empty); every user of the "
                                 "population needs at least one, or leave the user out of the population")
            return cls.of(torch.utils.data.default_collate(items), user=user)
        raise ValueError(f"{where} is a {type(data).__name__}; give a tuple of tensors (inputs, targets), a dict "
                         "of tensors, one tensor, or a torch.utils.data.Dataset of that user's examples")

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    def structure(self, tensors: Sequence[torch.Tensor]) -> Batch:
        """``tensors`` (one per field) in this structure: a tuple, or a dict with these keys."""
        return dict(zip(self.keys, tensors)) if self.keys is not None else tuple(tensors)

    def select(self, index: torch.Tensor | slice) -> Batch:
        """The minibatch of the examples at ``index``."""
        return self.structure([t[index] for t in self.fields])

    def head(self, count: int) -> "Examples":
        """The first ``count`` examples (the example cap of local training)."""
        return self if count >= len(self) else Examples(tuple(t[:count] for t in self.fields), self.keys)

    def to(self, device: torch.device | str, memory_format: torch.memory_format = torch.contiguous_format) -> "Examples":
        """On ``device``; 4-D floating-point tensors (image batches) in ``memory_format``."""
        moved = []
        for t in self.fields:
            if t.ndim == 4 and t.dtype.is_floating_point:
                moved.append(t.to(device, memory_format=memory_format))
            else:
                moved.append(t.to(device))
        return Examples(tuple(moved), self.keys)


class Users:
    """A population of N users: ``ids[i]`` names the user behind sampler index i, ``users[i]`` loads it.

    ``load(user_id)`` may return anything :meth:`Examples.of` takes. The population is fixed when the task is
    built (its size N drives the sampler and the accounting); loading happens when a user is sampled.
    """

    def __init__(self, ids: Sequence[Hashable] | int, load: Callable[[Any], Any]) -> None:
        ids = tuple(range(ids)) if isinstance(ids, int) and not isinstance(ids, bool) else tuple(ids)
        if not ids:
            raise ValueError("a population needs at least one user")
        if len(set(ids)) != len(ids):
            raise ValueError("user ids must be distinct")
        if not callable(load):
            raise ValueError(f"load must be a callable user id -> examples, got {type(load).__name__}")
        self._ids = ids
        self._load = load
        self._examples: tuple[Examples, ...] | None = None

    # --- constructors ----------------------------------------------------------------------------------------
    @classmethod
    def in_memory(cls, per_user: Sequence[Any], ids: Sequence[Hashable] | None = None) -> "Users":
        """Every user's examples held in memory (converted and checked now): the fast special case."""
        ids = tuple(range(len(per_user))) if ids is None else tuple(ids)
        if len(ids) != len(per_user):
            raise ValueError(f"{len(ids)} ids for {len(per_user)} users")
        examples = tuple(Examples.of(data, user=uid) for uid, data in zip(ids, per_user))
        for uid, ex in zip(ids, examples):
            _require_examples(ex, uid)
        users = cls(ids, dict(zip(ids, examples)).__getitem__)
        users._examples = examples
        return users

    @classmethod
    def from_mapping(cls, mapping: Mapping[Hashable, Any]) -> "Users":
        """Users = the keys of ``mapping`` (in its order), loaded with ``mapping[user_id]`` when sampled (a
        mapping may itself load lazily, e.g. a dict of per-user Datasets that read from disk)."""
        return cls(tuple(mapping.keys()), mapping.__getitem__)

    @classmethod
    def split(cls, data: Any, user_of_example: Sequence[Hashable] | np.ndarray | torch.Tensor) -> "Users":
        """Partition example-level tensors by a user column: ``user_of_example[j]`` owns example j.

        Users are the distinct values, in sorted order; each keeps its examples in their original order."""
        examples = Examples.of(data, user="(all)")
        owner = np.asarray(user_of_example.cpu() if isinstance(user_of_example, torch.Tensor) else user_of_example)
        if owner.shape != (len(examples),):
            raise ValueError(f"user_of_example has shape {owner.shape}, but there are {len(examples)} examples")
        ids = sorted(set(owner.tolist()))
        per_user = [examples.structure([t[torch.from_numpy(np.flatnonzero(owner == uid))] for t in examples.fields])
                    for uid in ids]
        return cls.in_memory(per_user, ids)

    # --- access ----------------------------------------------------------------------------------------------
    @property
    def ids(self) -> tuple[Hashable, ...]:
        return self._ids

    @property
    def num_users(self) -> int:
        return len(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def in_memory_examples(self) -> tuple[Examples, ...] | None:
        """Every user's examples when they are held in memory, else None."""
        return self._examples

    def __getitem__(self, index: int) -> Examples:
        """The examples of the user at sampler index ``index`` (loaded now, for lazy populations)."""
        if not 0 <= index < len(self._ids):
            raise IndexError(f"user index {index} is outside 0..{len(self._ids) - 1}")
        if self._examples is not None:
            return self._examples[index]
        uid = self._ids[index]
        try:
            data = self._load(uid)
        except Exception as error:
            raise ValueError(f"loading the examples of user {uid!r} failed: {type(error).__name__}: {error}") from error
        return _require_examples(Examples.of(data, user=uid), uid)

    def to(self, device: torch.device | str, memory_format: torch.memory_format = torch.contiguous_format) -> "Users":
        """The same population with examples on ``device``: moved once for in-memory users, after loading
        for lazy ones."""
        if self._examples is not None:
            moved = Users(self._ids, self._load)
            moved._examples = _moved_together(self._examples, torch.device(device), memory_format)
            return moved
        return Users(self._ids, lambda uid: Examples.of(self._load(uid), user=uid).to(device, memory_format))


def _moved_together(examples: tuple[Examples, ...], device: torch.device,
                    memory_format: torch.memory_format) -> tuple[Examples, ...]:
    """Every user's examples on ``device``. Users of one structure (field count, keys, dtypes, shapes after the
    first dimension) travel as one tensor per field, concatenated, moved in one copy and split back into each
    user's rows (views of it): one host-to-device copy per field instead of one per user and field (8,192 users of
    seed 003's paper-size task: 16,384 copies, 0.27 s on an H200's host). Users of differing structures are moved
    one by one. Values, shapes and dtypes are those of :meth:`Examples.to` either way."""
    first = examples[0]
    alike = all(ex.keys == first.keys and len(ex.fields) == len(first.fields) and all(
        t.dtype == u.dtype and t.shape[1:] == u.shape[1:] and t.device == u.device
        for t, u in zip(ex.fields, first.fields)) for ex in examples)
    if len(examples) == 1 or not alike or all(t.device == device for t in first.fields):
        return tuple(ex.to(device, memory_format) for ex in examples)
    sizes = [len(ex) for ex in examples]
    together = Examples(tuple(torch.cat([ex.fields[f] for ex in examples]) for f in range(len(first.fields))),
                        first.keys).to(device, memory_format)
    parts = [t.split(sizes) for t in together.fields]
    return tuple(Examples(tuple(p[i] for p in parts), first.keys) for i in range(len(examples)))


def _require_examples(examples: Examples, user: Hashable) -> Examples:
    if len(examples) == 0:
        raise ValueError(f"user {user!r} has no examples; every user of the population needs at least one "
                         "(leave users without data out of the population)")
    return examples


@dataclass(frozen=True, kw_only=True)
class Task:
    """What to train, on whose data, with which loss (see the module docstring).

    model: a factory returning a fresh ``torch.nn.Module`` (seeded by the caller); every engine calls it.
    users: the population (:class:`Users`).
    loss: ``loss(model, batch) -> scalar tensor``, the mean loss of a minibatch (``fed_dp.losses`` has
        classification, next-token and regression losses). It must call the model as ``model(...)``: the
        vectorized path hands it a functional view of the model.
    evaluate: optional ``evaluate(model) -> {metric: number}`` on held-out data, run on the server with the
        current global model (in eval mode, without gradients); ``fed_dp.evaluation`` builds common ones.
    class_groups: optional (num_classes,) int tensor of class frequency groups (seed 003), for reports.
    """

    model: Callable[[], nn.Module]
    users: Users
    loss: Loss
    evaluate: Evaluation | None = None
    name: str = "task"
    description: str = ""
    class_groups: torch.Tensor | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise ValueError(f"Task.model must be a factory (a callable returning a torch.nn.Module), got "
                             f"{type(self.model).__name__}; pass the class or a lambda, not an instance")
        if isinstance(self.model, nn.Module):
            raise ValueError("Task.model must be a factory returning a fresh torch.nn.Module, not a module "
                             "instance: pass e.g. `model=MyNet` or `model=lambda: MyNet(...)`")
        if not isinstance(self.users, Users):
            raise ValueError(f"Task.users must be a fed_dp.Users, got {type(self.users).__name__}; wrap your data "
                             "with Users.in_memory(...), Users.split(...), Users.from_mapping(...) or Users(ids, load)")
        if not callable(self.loss):
            raise ValueError(f"Task.loss must be a callable (model, batch) -> scalar tensor, got {self.loss!r}")
        if self.evaluate is not None and not callable(self.evaluate):
            raise ValueError(f"Task.evaluate must be None or a callable model -> metrics, got {self.evaluate!r}")

    @property
    def num_users(self) -> int:
        return self.users.num_users

    def build_model(self, seed: int | None = None) -> nn.Module:
        """A fresh model from the factory, checked (:func:`check_model`): a ``torch.nn.Module`` with at least one
        trainable floating-point parameter and no running statistics. With ``seed``, built with the global torch RNG
        seeded to it (and restored afterwards): every process that builds it with the same seed holds the same
        initial weights, frozen ones included (a ServerApp and its nodes: ``run.seed``)."""
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return self.build_model()
        model = self.model()
        if not isinstance(model, nn.Module):
            raise ValueError(f"the model factory of task {self.name!r} returned a {type(model).__name__}, not a "
                             "torch.nn.Module")
        check_model(model, self.name)
        return model


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters users train, by name, in ``named_parameters()`` order: those with ``requires_grad``.

    The trainable part is what a run trains end to end: each user's update Δ_i, its clip, the sums, the noise
    (its dimension d is the trainable count), the server optimizer and its state, the checkpoints and the arrays
    of every TRAIN message. Parameters with ``requires_grad=False`` (a frozen pretrained base, the base weights
    under a LoRA adapter) are *frozen*: never sent, never noised, never changed; every process builds them itself
    (:func:`frozen_parameters`)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def frozen_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters with ``requires_grad=False``, by name: the frozen part of the model (see
    :func:`trainable_parameters`). Nothing of a run writes them; the server and every node build them from the
    task's model factory (pretrained weights loaded from a local folder, or initialized from ``run.seed``), and a
    node whose frozen part differs from the server's is refused before round 1 (``fed_dp.query_reply``)."""
    return {name: p for name, p in model.named_parameters() if not p.requires_grad}


def _digest(tensor: torch.Tensor) -> str:
    """16 hex digits of BLAKE2b over a tensor's bytes (its values, in row-major order): equal exactly when the
    bytes are equal, but for a collision (probability about 2⁻⁶⁴ for two different tensors)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


def frozen_fingerprint(model: nn.Module) -> list[str]:
    """``["name:d0xd1x...:frozen:<digest>", ...]``: the frozen parameters of ``model`` (``requires_grad=False``,
    :func:`frozen_parameters`), each with a digest of its values. They are never sent; these
    entries let the server check, before round 1, that a node built the same ones (``fed_dp.clients.protocol``),
    and a resumed run that it builds the model it checkpointed (``fed_dp.run_setup``)."""
    return [f"{name}:{'x'.join(str(int(n)) for n in p.shape)}:frozen:{_digest(p)}"
            for name, p in frozen_parameters(model).items()]


def model_fingerprint(model: nn.Module | Mapping[str, torch.Tensor | Sequence[int]]) -> list[str]:
    """``["name:d0xd1x...", ...]``: the names and shapes of a model's trained parameters, in order, then its frozen
    parameters (:func:`frozen_fingerprint`): for a module, its trainable ``named_parameters()`` (those with
    ``requires_grad``) and its frozen ones; for a mapping of name → tensor (or shape), every entry as trained. A
    scalar's shape is empty (``"name:"``)."""
    if isinstance(model, nn.Module):
        return model_fingerprint(trainable_parameters(model)) + frozen_fingerprint(model)
    return [f"{name}:{'x'.join(str(int(n)) for n in getattr(value, 'shape', value))}" for name, value in model.items()]


def trainable_layout(model: nn.Module) -> tuple[ParamLayout, torch.Tensor]:
    """The layout of the model's trainable parameters (:func:`trainable_parameters`) and their flat vector θ."""
    named = {k: v.detach() for k, v in trainable_parameters(model).items()}
    layout = ParamLayout.from_state_dict(named)
    return layout, layout.flatten(named)


def _running_statistics(model: nn.Module) -> list[str]:
    """Modules that update buffers from the data they see in training mode: BatchNorm and InstanceNorm layers
    with ``track_running_stats`` (their running mean and variance)."""
    return [f"{name or '<root>'} ({type(module).__name__})" for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats]


def check_model(model: nn.Module, task_name: str = "task") -> None:
    """ValueError, saying what to do, for a model that a private run cannot train as it is:

    - no trainable parameter (every parameter has ``requires_grad=False``);
    - a trainable parameter that is not floating point;
    - running statistics (BatchNorm, InstanceNorm with ``track_running_stats``): they are buffers that local
      training updates in place from a user's data, which no update carries, no noise covers and the server
      never aggregates, so its model would evaluate with the initial statistics. Refused on every path;
      GroupNorm and LayerNorm normalize each example by itself and need no buffers. A pretrained model whose
      statistics should stay as they are can replace each BatchNorm with a frozen one (no running update, e.g.
      ``torchvision.ops.FrozenBatchNorm2d``)."""
    named = dict(model.named_parameters())
    if not named:
        raise ValueError(f"the model of task {task_name!r} has no parameters to train")
    if not any(p.requires_grad for p in named.values()):
        raise ValueError(f"every parameter of the model of task {task_name!r} has requires_grad=False: nothing "
                         "would be trained; leave the parameters to fine-tune trainable in the model factory")
    bad = [name for name, p in named.items() if p.requires_grad and not p.dtype.is_floating_point]
    if bad:
        raise ValueError(f"model parameters {bad} are not floating point; they cannot be trained by SGD")
    running = _running_statistics(model)
    if running:
        raise ValueError(
            f"the model of task {task_name!r} keeps running statistics in {', '.join(running[:3])}: local training "
            "would update them in place from users' data, outside any update, clip or noise, and the server "
            "would never aggregate them (it would evaluate with the initial statistics). Use GroupNorm or "
            "LayerNorm (per-example normalization, no buffers), track_running_stats=False, or, to keep a "
            "pretrained model's statistics fixed, a frozen BatchNorm (e.g. torchvision.ops.FrozenBatchNorm2d)")


def load_task(target: str, options: Mapping[str, Any] | None = None) -> Task:
    """Import ``package.module:factory`` and call it with ``options``; the result must be a :class:`Task`.

    Errors say what went wrong: a module that does not import (with the import error), a missing factory,
    keyword arguments the factory does not take (listing those it takes), a factory that fails or returns
    something else than a Task.
    """
    options = dict(options or {})
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"task reference {target!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"task reference {target!r}: module {module_name!r} does not import ({error}); is it "
                         "installed, or on PYTHONPATH (for Flower: inside the app folder or installed on every "
                         "machine)?") from error
    except Exception as error:  # the module itself fails: a syntax error, or code at its top level that raises
        raise ValueError(f"task reference {target!r}: importing module {module_name!r} raised "
                         f"{type(error).__name__}: {error}; fix the module (python -c 'import "
                         f"{module_name}' shows the traceback)") from error
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"task reference {target!r}: {module_name} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"task reference {target!r} names a {type(factory).__name__}, not a function")
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = sorted(set(options) - set(parameters)) if not takes_any else []
    if unknown:
        raise ValueError(f"task {target!r} does not take {', '.join(k.replace('_', '-') for k in unknown)}; it "
                         f"takes {', '.join(k.replace('_', '-') for k in parameters) or 'no options'}")
    needed = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty and name not in options
              and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if needed:
        raise ValueError(f"task {target!r} needs {', '.join(k.replace('_', '-') for k in needed)}: set "
                         + " and ".join(f"task.{k.replace('_', '-')}" for k in needed) + " in the config's [task] "
                         "table (with fed-dp simulate also --set task.KEY=VALUE)")
    task = factory(**options)
    if not isinstance(task, Task):
        raise ValueError(f"task factory {target!r} returned a {type(task).__name__}; it must return a fed_dp.Task")
    return task


def build_task(settings: Any, node_root: str | None = None) -> Task:
    """The task of a run config's ``[task]`` section (``RunConfig.task``, a ``fed_dp.run_config.TaskSettings``):
    its factory (:func:`load_task`) called with its options, and ``root`` = the node's own data folder (a
    SuperNode's ``data-root``) or ``task.root``. A ServerApp: ``build_task(RunConfig.from_flat(context.run_config)
    .task)``."""
    options = dict(settings.options)
    root = node_root or settings.root
    if root:
        options["root"] = str(root)
    return load_task(settings.target, options)


def seeded_model(task: Task, seed: int | None) -> nn.Module:
    """The task's model built with the global torch RNG seeded to ``seed`` (and restored afterwards); unseeded
    for None (:meth:`Task.build_model`). Processes that build it with the same seed hold the same initial weights,
    frozen ones included."""
    return task.build_model(seed)


def initial_model(task: Task, seed: int) -> tuple[nn.Module, ParamLayout, torch.Tensor]:
    """θ_0 of a run: the task's model built with the global torch RNG seeded to ``seed`` (:func:`seeded_model`),
    the layout of its trainable parameters and their flat vector (:func:`trainable_layout`). Every engine starts
    from this for a given seed; the frozen parameters stay in the model."""
    model = seeded_model(task, seed)
    layout, params = trainable_layout(model)
    return model, layout, params
