"""The one run-configuration schema: every key once, the same defaults in every front end, clear errors."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args

import fed_dp
from fed_dp.accounting import epsilon, resolve_privacy
from fed_dp.cli import build_parser
from fed_dp.clients.node import LocalTrainer
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.round_loop import run_rounds
from fed_dp.run_config import SECTIONS as SCHEMA_SECTIONS
from fed_dp.run_config import (DEFAULTS, KEYS, TABLES, TASK_GROUP, AdaptiveSettings, ClientSettings, RunConfig,
                               RunSettings, ServerSettings, TaskSettings, apply_overrides, flower_defaults,
                               flower_table, reference_markdown, registered_tasks, resolve_noise_source,
                               unflatten)
from fed_dp.schema import UNSET
from fed_dp.server.flower_strategy import UserLevelDP
from fed_dp.simulations.audit import run_audit

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"privacy": PrivacyConfig, "local": LocalTraining, "server": ServerSettings, "client": ClientSettings,
            "run": RunSettings, "adaptive": AdaptiveSettings}


def test_every_key_is_defined_once_with_a_type_and_a_meaning():
    names = [key.dotted for key in KEYS]
    assert len(names) == len(set(names))
    assert all(key.doc and key.kind in (int, float, str, bool) for key in KEYS)
    for key in KEYS:  # an optional key is unset by "", which is no value of a number or flag, nor a valid text
        assert key.unset == (UNSET if key.default is None else None) and key.optional == (key.default is None)
        assert key.flower_default == (UNSET if key.default is None else key.default)
        assert key.default is None or isinstance(key.default, key.kind)
    assert UNSET == ""


def test_the_keys_are_the_fields_of_the_sections():
    """One schema: every key is a field of its table's dataclass (declared with fed_dp.schema.setting), and every
    such field is a key; the only other fields are [task]'s open options."""
    assert set(SCHEMA_SECTIONS) == set(TABLES) and {key.table for key in KEYS} == set(TABLES)
    for table, section in SCHEMA_SECTIONS.items():
        declared = [f.name for f in dataclasses.fields(section) if "help" in f.metadata]
        assert declared == [key.field for key in KEYS if key.table == table], table
        assert {f.name for f in dataclasses.fields(section)} - set(declared) <= {"options"}, table


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


def _pyproject_flower_config() -> dict:
    return flatten_dict(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


def test_pyproject_flower_config_is_the_schema_plus_task_options():
    flat = _pyproject_flower_config()
    task_options = {k: v for k, v in flat.items() if k.startswith("task.") and k not in ("task.ref", "task.root")}
    assert flat == flower_defaults({k[5:]: v for k, v in task_options.items()})
    assert set(task_options.values()) == {""}  # listed so that --run-config can set them; "" = not given
    assert RunConfig.from_flat(flat) == RunConfig.from_flat({})  # the app's defaults are the schema's


def test_pyproject_flower_config_is_the_generated_table():
    """``[tool.flwr.app.config]`` is the output of ``python -m fed_dp.run_config --flower OPTION...``, line for line."""
    text = (REPO / "pyproject.toml").read_text()
    table = text[text.index("[tool.flwr.app.config]\n"):].split("\n", 1)[1].split("\n[", 1)[0].strip() + "\n"
    options = [k[5:] for k in _pyproject_flower_config() if k.startswith("task.") and k not in ("task.ref", "task.root")]
    assert table == flower_table(options)
    result = subprocess.run([sys.executable, "-m", "fed_dp.run_config", "--flower", *options], cwd=REPO,
                            capture_output=True, text=True, check=True)
    assert result.stdout == table


def test_the_configuration_reference_in_the_docs_is_generated_from_the_schema():
    """docs/reference/configuration.md is never written by hand: ``python -m fed_dp.run_config > docs/reference/
    configuration.md`` writes it, and it lists every key with its default."""
    page = (REPO / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference_markdown()
    result = subprocess.run([sys.executable, "-m", "fed_dp.run_config"], cwd=REPO, capture_output=True, text=True,
                            check=True)
    assert result.stdout == page
    for key in KEYS:
        shown = "unset" if key.default is None else str(key.default).lower() if isinstance(key.default, bool) \
            else f'"{key.default}"' if isinstance(key.default, str) else repr(key.default)
        assert f"| `{key.dotted}` | {key.kind.__name__} | `{shown}` |" in page, key.dotted


def test_a_flower_run_config_override_replaces_an_unset_key():
    """flwr's own parsing and merging of ``--run-config`` (no type check against the pyproject value): a key
    whose default is "" takes the number given."""
    overrides = parse_config_args(['privacy.noise-multiplier=1.5 privacy.epsilon-budget=9 run.seed=3'])
    run = RunConfig.from_flat(fuse_dicts(_pyproject_flower_config(), overrides))
    assert run.privacy.noise_multiplier == 1.5 and run.privacy.epsilon_budget == 9.0 and run.run.seed == 3
    overrides = parse_config_args(['privacy.target-epsilon=4.0'])
    run = RunConfig.from_flat(fuse_dicts(_pyproject_flower_config(), overrides))
    assert run.privacy.noise_multiplier is None and run.privacy.target_epsilon == 4.0


@pytest.mark.parametrize("flat, message", [
    ({"privacy.noise-multiplier": -1.0}, "privacy.noise-multiplier must be a finite number >= 0, got -1.0"),
    ({"privacy.noise-multiplier": "", "privacy.target-epsilon": 0.0}, "privacy.target-epsilon must be a finite number > 0"),
    ({"privacy.num-users": 0}, "privacy.num-users must be an integer >= 1"),
    ({"privacy.buffers": 0}, "buffers = 0 only applies to noise 'blt'"),
    ({"privacy.sampler": "min-sep", "privacy.max-participations": 0}, "privacy.max-participations must be an integer >= 1"),
    ({"privacy.epsilon-budget": 0.0}, "privacy.epsilon-budget must be a finite number > 0"),
    ({"optimizer.lr": 0.0}, "lr must be a finite number > 0"),
    ({"optimizer.beta1": -1.0}, r"beta1 must be in \[0, 1\)"),
    ({"optimizer.name": "dp-adamw", "optimizer.weight-decay": -1.0}, "optimizer.weight-decay must be a finite number >= 0"),
    ({"optimizer.name": "dp-adambc", "optimizer.bc-floor": 0.0}, "optimizer.bc-floor"),
    ({"local.steps": 0}, "local.steps must be an integer >= 1"),
    ({"local.max-examples": 0}, "local.max-examples must be an integer >= 1"),
    ({"adaptive.enabled": True, "adaptive.bit-noise-std": 0.0}, "bit_noise_std must be a finite number > 0"),
    ({"client.chunk-size": 0}, "client.chunk-size must be an integer >= 1"),
    ({"run.seed": -1}, "run.seed must be an integer >= 0"),
    ({"privacy.rounds": ""}, "privacy.rounds must be int"),  # "" unsets optional keys only
])
def test_the_former_unset_values_are_refused_as_values(flat, message):
    """Issue 27: no value a user could mean as a setting says "unset" (−1 was σ's unset value in a Flower run
    config, so a user's own −1 ran with σ = 1.0); only "" does, and every other value is checked."""
    with pytest.raises(ValueError, match=message):
        RunConfig.from_flat({**flower_defaults(), **flat})


CLIENT_KEYS = {"device": "client.device", "training": "client.training", "chunk_size": "client.chunk-size"}
LOOP_KEYS = {"eval_every": "run.eval-every", "max_empty_rounds": "server.max-empty-rounds"}
#: The public signatures whose defaults are run defaults: parameter → key.
SIGNATURES = {
    fed_dp.train: {"optimizer": "optimizer.name", **LOOP_KEYS, **CLIENT_KEYS, "noise_source": "server.noise-source"},
    run_rounds: LOOP_KEYS,
    UserLevelDP.__init__: {"optimizer": "optimizer.name", "checkpoint_dir": "server.checkpoint-dir", **LOOP_KEYS,
                           "min_nodes": "server.min-nodes", "node_wait": "server.node-wait",
                           "noise_source": "server.noise-source"},
    UserLevelDP.start: {"timeout": "server.reply-timeout"},
    LocalTrainer.__init__: CLIENT_KEYS,
    run_audit: {"training": "client.training", "chunk_size": "client.chunk-size"},
}
SIGNATURE_DEFAULTS = [(function, parameter, key) for function, keys in SIGNATURES.items()
                      for parameter, key in keys.items()]


@pytest.mark.parametrize("function, parameter, key", SIGNATURE_DEFAULTS,
                         ids=[f"{f.__qualname__}-{p}" for f, p, _ in SIGNATURE_DEFAULTS])
def test_public_signatures_default_to_the_schema(function, parameter, key):
    """fed_dp.train, run_rounds, UserLevelDP and LocalTrainer take these defaults from the schema's sections
    (``SERVER_DEFAULTS.max_empty_rounds``, ...): a Python caller and a run config get the same run."""
    defaults = {k.dotted: k.default for k in KEYS}
    assert inspect.signature(function).parameters[parameter].default == defaults[key]


@pytest.mark.parametrize("chosen, flower_run, seeded, source", [
    ("auto", True, False, "secure"),   # a deployment: noise keyed from OS entropy
    ("auto", True, True, "torch"),     # a seeded research run on Flower: reproducible noise
    ("auto", False, False, "torch"),   # a simulation
    ("auto", False, True, "torch"),
    ("secure", False, False, "secure"), ("torch", True, False, "torch"),
])
def test_auto_noise_source_is_secure_only_in_an_unseeded_flower_run(chosen, flower_run, seeded, source):
    """server.noise-source's help says what auto means; the one function that decides it for every engine."""
    assert resolve_noise_source(chosen, flower_run=flower_run, seeded=seeded) == source


def test_the_engines_resolve_auto_noise_as_the_help_says():
    """fed_dp.train and UserLevelDP take "auto" by default: torch noise in a simulation, secure noise in an unseeded
    Flower run (torch when seeded); a name that is not a source is refused, naming the choices."""
    assert UserLevelDP(PrivacyConfig(num_users=10, expected_cohort=2, rounds=2, noise_multiplier=1.0,
                                     delta=1e-5)).noise_source == "secure"
    assert UserLevelDP(PrivacyConfig(num_users=10, expected_cohort=2, rounds=2, noise_multiplier=1.0, delta=1e-5),
                       seed=3).noise_source == "torch"
    with pytest.raises(ValueError, match="noise source must be one of auto, secure, torch, got 'urandom'"):
        UserLevelDP(PrivacyConfig(num_users=10, expected_cohort=2, rounds=2, noise_multiplier=1.0, delta=1e-5),
                    noise_source="urandom")
    with pytest.raises(ValueError, match="noise source must be one of auto, secure, torch, got None"):
        resolve_noise_source(None, flower_run=False, seeded=False)


def test_the_accounting_cli_defaults_are_the_schemas():
    """``fed-dp epsilon`` / ``calibrate``: each privacy option left out takes the run config's default."""
    args = build_parser().parse_args(["epsilon", "--num-users", "100", "--expected-cohort", "10", "--rounds", "5",
                                      "--noise-multiplier", "1", "--delta", "1e-5"])
    for name in ("sampler", "noise", "bands", "buffers", "workload", "momentum", "max_participations", "accountant"):
        assert getattr(args, name) == DEFAULTS[f"privacy.{name.replace('_', '-')}"], name


def test_one_name_per_setting():
    """A keyword of a public signature that is a run-config setting has the key's name (``eval_every`` as
    ``run.eval-every``; ``evaluate_every`` is gone)."""
    # the two exceptions: the optimizer itself (or its name), and Flower's own keyword of Strategy.start
    named_otherwise = {("optimizer", "optimizer.name"), ("timeout", "server.reply-timeout")}
    for _, parameter, key in SIGNATURE_DEFAULTS:
        assert parameter == key.split(".")[1].replace("-", "_") or (parameter, key) in named_otherwise
    with pytest.raises(TypeError, match="evaluate_every"):
        UserLevelDP(PrivacyConfig(num_users=20, expected_cohort=5, rounds=2, delta=1e-5, noise_multiplier=1.0),
                    evaluate_every=1)


def test_defaults_and_unset_values():
    run = RunConfig.from_flat({})
    assert run.privacy.noise_multiplier == 1.0 and run.privacy.target_epsilon is None
    assert run.privacy.accountant == "pld" and run.privacy.num_users is None and run.privacy.epsilon_budget is None
    assert run.run.seed is None and run.server.checkpoint_dir is None and not run.adaptive.enabled
    assert run.adaptive == AdaptiveSettings() and run.adaptive.build(run.privacy) is None
    assert run.task.ref == "heavy-tail" and run.task.options == {}
    flat = {**flower_defaults(), "privacy.target-epsilon": 3.0, "privacy.epsilon-budget": 5.0, "run.seed": 2,
            "task.users": 30, "task.groups": ""}
    run = RunConfig.from_flat(flat)
    assert run.privacy.noise_multiplier is None and run.privacy.target_epsilon == 3.0
    assert run.privacy.epsilon_budget == 5.0 and run.run.seed == 2
    assert run.task.options == {"users": 30}  # "" means not given
    resolved = resolve_privacy(run.privacy, 30)
    assert epsilon(resolved) <= 3.0 and resolved.num_users == 30
    assert run.privacy.buffers is None  # privacy.buffers = "" is unset
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
    ({"privacy.expected-cohort": 0}, "privacy.expected-cohort must be an integer >= 1"),
    ({"local.lr": -1.0}, "local.lr must be"),
    ({"local.steps": 3, "local.epochs": 2}, "local.epochs or local.steps"),
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


@pytest.mark.parametrize(("tables", "message"), [
    ({"privacy": {"noise-multiplier": -1.0}}, "privacy.noise-multiplier must be a finite number >= 0, got -1.0"),
    ({"privacy": {"noise-multiplier": -1.0}}, "give privacy.target-epsilon to have σ calibrated"),
    ({"privacy": {"clip-norm": -2.0}}, "privacy.clip-norm must be a finite number > 0"),
    ({"local": {"batch-size": 0}}, "error: local.batch-size must be an integer >= 1, got 0"),
])
def test_a_bad_value_in_a_config_is_named_by_its_key(tables, message):
    """The sections' own checks name Python fields (noise_multiplier, for fed_dp.train's callers); read from a config
    they name the key to edit. The Python names stay for the Python API."""
    with pytest.raises(ValueError) as error:
        RunConfig.from_tables(tables)
    assert message.removeprefix("error: ") in str(error.value) and "_" not in str(error.value).split(" must")[0]
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        PrivacyConfig(num_users=10, expected_cohort=5, rounds=1, noise_multiplier=-1.0, delta=1e-5)


def test_the_schemas_optimizer_names_are_the_optimizers():
    """The schema names the optimizers without importing fed_dp.optimizers (torch), so that a config's names are
    checked before PyTorch loads (issue 40 item 5): the two lists must be one."""
    from fed_dp.optimizers import OPTIMIZERS
    from fed_dp.run_config import OPTIMIZER_NAMES

    assert OPTIMIZER_NAMES == tuple(OPTIMIZERS)
