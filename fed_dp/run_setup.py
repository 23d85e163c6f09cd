"""What a checkpoint records of its run besides the privacy configuration, and the check that a resume changes none
of it.

A resume continues the run its checkpoint folder holds. The privacy configuration is recorded with the ledger; the
rest of what decides the released models is described here, once, as a mapping of plain values that the engines
build with :func:`describe_run` and the round loop stores with every commit (in the public part of the checkpoint,
``extra["setup"]``: nothing in it is secret):

    optimizer      the server optimizer: its class and every hyper-parameter                 optimizer.*
    local          the users' local training (absent when the engine does not know it: a     local.*
                   Flower app whose ClientApps read it themselves)
    seed           the seed of the model's initialization and of local training              run.seed
                   (None: each process draws its own, a Flower run without run.seed)
    model          the trainable parameters' names and shapes in order, then the frozen ones  the task's model
                   with a digest of their values (``fed_dp.clients.task.model_fingerprint``)
    noise_source   ``torch`` (seeded) or ``secure``                                          server.noise-source
    adaptive       adaptive clipping's settings, or None                                     adaptive.*

When a run starts on a folder that holds a checkpoint, :func:`check_resume` compares the new run's privacy
configuration and description with the recorded ones and refuses every difference at once (ValueError naming each
key with its recorded and its new value), before anything is resumed or released. Each entry changes the mechanism
or the models released after the resume, so a resume that changed one would go on with a run that the folder's
ledger, ``results.json`` and the experiment's ``config.json`` no longer describe. What is not recorded may change
on a resume: evaluation (``run.eval-every``), the device and training path, timeouts and node settings, and how many
of the planned rounds one start runs. An entry the checkpoint does not hold (written before it was recorded) is
not compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fed_dp.config import LocalTraining, PrivacyConfig

#: The key of the description in the public part's ``extra`` (``fed_dp.checkpoint``).
SETUP_KEY = "setup"

#: Entries of the description → the run-configuration table an operator edits (``None``: named as is).
_TABLES = {"optimizer": "optimizer", "local": "local", "adaptive": "adaptive", "seed": "run.seed",
           "noise_source": "server.noise-source", "model": None}


def _fields(value: Any) -> dict[str, Any]:
    """A dataclass's compared fields as plain values (a non-dataclass optimizer: its class name only)."""
    if not dataclasses.is_dataclass(value):
        return {}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}


def describe_run(*, optimizer: Any, adaptive: Any, noise_source: str, seed: int | None,
                 model: Sequence[str] | None = None, local: LocalTraining | None = None) -> dict[str, Any]:
    """The description of a run: its server ``optimizer``, its ``adaptive`` clipping config as the server runs it
    (σ_b decided; None: off), the resolved ``noise_source``, the ``seed`` of the model's initialization and local
    training, the ``model``'s fingerprint and its ``local`` training. ``model`` or ``local`` None: unknown, left
    out (an experiment runner checks what it knows before it builds the model; the engine then checks it all)."""
    setup = {
        "optimizer": {"class": type(optimizer).__name__, **_fields(optimizer)},
        "seed": seed,
        "noise_source": noise_source,
        "adaptive": None if adaptive is None else _fields(adaptive),
    }
    if model is not None:
        setup["model"] = list(model)
    if local is not None:
        setup["local"] = _fields(local)
    return setup


def _key(table: str, name: str) -> str:
    return f"{table}.{name.replace('_', '-')}"


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _model_change(recorded: Sequence[str], new: Sequence[str]) -> str:
    """The first parameter where two model fingerprints differ, and their sizes."""
    index = next((i for i, (a, b) in enumerate(zip(recorded, new)) if a != b), min(len(recorded), len(new)))
    at = lambda entries: entries[index] if index < len(entries) else "nothing"  # noqa: E731
    return (f"the model: recorded {len(recorded)} parameter tensors, now {len(new)}; the first difference, at "
            f"position {index + 1}: recorded {at(recorded)}, now {at(new)} (name:shape, and :frozen:digest for a "
            "frozen one: the same task, trainable set and frozen values must be built, from the same run.seed)")


def setup_changes(recorded: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Each difference between two descriptions (:func:`describe_run`) as ``key: recorded …, now …``; entries
    that either lacks are not compared."""
    changes = []
    for entry in (name for name in _TABLES if name in recorded and name in new):
        old, now, table = recorded[entry], new[entry], _TABLES[entry]
        if old == now:
            continue
        if entry == "model":
            changes.append(_model_change(old, now))
        elif isinstance(old, Mapping) and isinstance(now, Mapping) and old.get("class") == now.get("class"):
            changes += [f"{_key(table, name)}: recorded {_shown(old.get(name))}, now {_shown(now.get(name))}"
                        for name in dict.fromkeys([*old, *now]) if old.get(name) != now.get(name)]
        elif isinstance(old, Mapping) or isinstance(now, Mapping):
            describe = lambda value: "off" if value is None else ", ".join(  # noqa: E731
                f"{k}={v!r}" for k, v in value.items())
            changes.append(f"{table}: recorded {describe(old)}; now {describe(now)}")
        else:
            changes.append(f"{table}: recorded {_shown(old)}, now {_shown(now)}")
    return changes


def privacy_changes(recorded: PrivacyConfig, new: PrivacyConfig) -> list[str]:
    """Each field where two privacy configurations differ, as ``privacy.key: recorded …, now …``."""
    old, now = recorded.to_dict(), new.to_dict()
    return [f"{_key('privacy', name)}: recorded {_shown(old[name])}, now {_shown(now[name])}"
            for name in old if old[name] != now[name]]


def check_resume(folder: str | Path, recorded_privacy: PrivacyConfig, recorded_setup: Mapping[str, Any] | None,
                 privacy: PrivacyConfig, setup: Mapping[str, Any] | None) -> None:
    """Refuse (ValueError) to resume the run checkpointed in ``folder`` with another privacy configuration or
    description: the message lists every difference and what to do. ``setup`` or ``recorded_setup`` None: the
    privacy configuration alone is compared."""
    changes = privacy_changes(recorded_privacy, privacy)
    if recorded_setup is not None and setup is not None:
        changes += setup_changes(recorded_setup, setup)
    if not changes:
        return
    calibrated = any(change.startswith("privacy.noise-multiplier") for change in changes)
    raise ValueError(
        f"cannot resume the run checkpointed in {folder}: this run's configuration differs from the one it "
        f"was started with ({'; '.join(changes)}). A resume continues the same mechanism and model, which the "
        "folder's ledger and results describe. Start the run again with the recorded values to resume it"
        + (" (σ is calibrated from privacy.target-epsilon and the other privacy keys when a target is given)"
           if calibrated else "")
        + "; to train with the new values, start a new run in another checkpoint folder (on the same users, its "
        "ε adds to this run's)")
