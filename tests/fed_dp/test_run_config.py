"""The one run-configuration schema: every key once, the same defaults in every front end, clear errors."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict

from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.run_config import (KEYS, TASK_GROUP, AdaptiveSettings, ClientSettings, RunConfig, RunSettings,
                               ServerSettings, TaskSettings, apply_overrides, flower_defaults, registered_tasks,
                               unflatten)

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"privacy": PrivacyConfig, "local": LocalTraining, "server": ServerSettings, "client": ClientSettings,
            "run": RunSettings, "adaptive": AdaptiveSettings}


def test_every_key_is_defined_once_with_a_type_and_a_meaning():
    names = [key.dotted for key in KEYS]
    assert len(names) == len(set(names))
    assert all(key.doc and key.kind in (int, float, str, bool) for key in KEYS)
    for key in KEYS:  # an optional key has an unset value of its own type, which its checks reject as a value
        if key.default is None:
            assert key.unset is not None and isinstance(key.unset, key.kind)


@pytest.mark.parametrize("table", sorted(SECTIONS))
def test_dataclass_defaults_are_the_schema_defaults(table):
    """The Python API and the text configs cannot disagree: where a section's dataclass has a default, it is
    the schema's (the accountant default of PrivacyConfig and of a Flower run are one value)."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[table])}
    for key in (k for k in KEYS if k.table == table and k.field in fields):
        field = fields[key.field]
        if field.default is not dataclasses.MISSING:
            assert field.default == key.default, key.dotted


def test_optimizer_keys_left_unset_keep_each_variants_own_defaults():
    run = RunConfig.from_tables({"optimizer": {"name": "dp-sgdm"}})
    assert run.optimizer.options == {} and run.optimizer.build() == make_optimizer("dp-sgdm")
    run = RunConfig.from_flat({**flower_defaults(), "optimizer.name": "dp-adamw"})
    assert run.optimizer.build() == make_optimizer("dp-adamw")  # its weight decay 1e-2, not a flattened default


def test_pyproject_flower_config_is_the_schema_plus_task_options():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    flat = flatten_dict(config)
    task_options = {k: v for k, v in flat.items() if k.startswith("task.") and k not in ("task.ref", "task.root")}
    assert flat == flower_defaults({k[5:]: v for k, v in task_options.items()})
    assert set(task_options.values()) == {""}  # listed so that --run-config can set them; "" = not given
    assert RunConfig.from_flat(flat) == RunConfig.from_flat({})  # the app's defaults are the schema's


def test_defaults_and_unset_values():
    run = RunConfig.from_flat({})
    assert run.privacy.noise_multiplier == 1.0 and run.privacy.target_epsilon is None
    assert run.privacy.accountant == "pld" and run.privacy.num_users is None and run.privacy.epsilon_budget is None
    assert run.run.seed is None and run.server.checkpoint_dir is None and run.adaptive is None
    assert run.task.ref == "heavy-tail" and run.task.options == {}
    flat = {**flower_defaults(), "privacy.target-epsilon": 3.0, "privacy.epsilon-budget": 5.0, "run.seed": 2,
            "task.users": 30, "task.groups": ""}
    run = RunConfig.from_flat(flat)
    assert run.privacy.noise_multiplier is None and run.privacy.target_epsilon == 3.0
    assert run.privacy.epsilon_budget == 5.0 and run.run.seed == 2
    assert run.task.options == {"users": 30}  # "" means not given
    resolved = resolve_privacy(run.privacy, 30)
    assert epsilon(resolved) <= 3.0 and resolved.num_users == 30
    assert run.privacy.buffers is None  # privacy.buffers = 0 is unset
    blt = RunConfig.from_flat({**flower_defaults(), "privacy.noise": "blt", "privacy.buffers": 4,
                               "privacy.sampler": "min-sep"})
    assert blt.privacy.noise == "blt" and blt.privacy.buffers == 4


@pytest.mark.parametrize("flat, message", [
    ({"privacy.sampler": "uniform"}, "privacy.sampler must be one of"),
    ({"optimizer.name": "dp-lion"}, "optimizer.name must be one of"),
    ({"colour.red": 1}, "unknown config table"),
    ({"privacy.colour": 1}, "unknown key.*privacy.colour"),
    ({"privacy.rounds": 2.5}, "privacy.rounds must be int"),
    ({"privacy.noise-multiplier": 1.2, "privacy.target-epsilon": 3.0}, "both set"),
    ({"privacy.expected-cohort": 0}, "expected_cohort must be an integer >= 1"),
    ({"local.lr": -1.0}, "local lr"),
    ({"local.steps": 3, "local.epochs": 2}, "epochs or local steps"),
    ({"server.reply-timeout": 0.0}, "server.reply-timeout"),
    ({"run.eval-every": -1}, "run.eval-every"),
    ({"optimizer.momentum": 0.9}, "momentum"),  # dp-adam has no momentum: the optimizer says so
    ({"task.ref": "nonsense"}, "package.module:factory"),
    ({"rounds": 3}, "table.key"),
    ({"privacy.noise": "blt", "privacy.sampler": "min-sep"}, "needs buffers"),
    ({"privacy.buffers": 3}, "only applies to noise 'blt'"),
])
def test_invalid_values_name_the_key(flat, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_flat(flat)


def test_overrides_and_unflatten():
    tables = apply_overrides({"privacy": {"rounds": 3}}, ["privacy.rounds=7", 'privacy.sampler="all"', "local.lr=0.5",
                                                         "optimizers.dp-sgd.lr=2"])
    assert tables == {"privacy": {"rounds": 7, "sampler": "all"}, "local": {"lr": 0.5}, "optimizers": {"dp-sgd": {"lr": 2}}}
    with pytest.raises(ValueError, match="unknown table"):
        apply_overrides({}, ["model.width=3"])
    with pytest.raises(ValueError, match="table.key=value"):
        apply_overrides({}, ["rounds=3"])
    assert unflatten({"a.b": 1, "a.c": 2, "d.e": 3}) == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}


def test_the_built_in_tasks_are_found_by_name_through_the_entry_point_group():
    """The core names no upper layer: the short names come from the installed metadata (pyproject.toml's
    ``[project.entry-points."fed_dp.tasks"]``), read without importing any task."""
    tasks = registered_tasks()
    assert {"heavy-tail", "w1", "cifar10", "flair"} <= set(tasks)
    assert TaskSettings(ref="w1").target == tasks["w1"] == "fed_dp.simulations.tasks.builtin:w1_task"
    assert TaskSettings(ref="my_tasks:make").target == "my_tasks:make"


def test_an_unknown_task_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"task.ref 'nonsense' is neither a built-in task \(.*heavy-tail.*\) nor "
                                         r"'package.module:factory'"):
        TaskSettings(ref="nonsense")


def _registry(monkeypatch, *entries: tuple[str, str]) -> None:
    points = importlib.metadata.EntryPoints(
        importlib.metadata.EntryPoint(name, value, TASK_GROUP) for name, value in entries)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points.select(group=group))
    registered_tasks.cache_clear()


@pytest.fixture
def fresh_registry():
    registered_tasks.cache_clear()
    yield
    registered_tasks.cache_clear()


def test_a_task_name_registered_twice_with_different_factories_is_refused(monkeypatch, fresh_registry):
    _registry(monkeypatch, ("twin", "a.tasks:make"), ("twin", "b.tasks:make"))
    with pytest.raises(ValueError, match="'twin' is registered twice .* 'a.tasks:make' and 'b.tasks:make': uninstall"):
        registered_tasks()


def test_without_registered_tasks_the_error_says_to_reinstall(monkeypatch, fresh_registry):
    _registry(monkeypatch)
    with pytest.raises(ValueError, match=r"no task names are registered .*reinstall it \(pip install -e \."):
        TaskSettings(ref="heavy-tail")
    assert TaskSettings(ref="my_tasks:make").target == "my_tasks:make"
