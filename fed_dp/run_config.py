"""The one run configuration: every key once, with its type, default and meaning, parsed into frozen sections.

Three front ends read this schema and nothing else:

* ``fed-dp simulate`` / ``compare`` TOML files (tables ``[task]``, ``[privacy]``, ...) and ``--set table.key=value``;
* Flower's run config (``[tool.flwr.app.config]`` in a pyproject.toml, ``flwr run --run-config``): the same
  keys flattened to ``table.key`` (:meth:`RunConfig.from_flat`);
* Python: :class:`RunConfig` and its sections directly, or :meth:`RunConfig.from_tables`.

The schema is written once, on the section dataclasses (:data:`SECTIONS`; :func:`fed_dp.schema.setting`): each
field's default, meaning and choices. :data:`KEYS` reads them back; the Flower run-config table
(:func:`flower_table`, checked against pyproject.toml by the tests) and the configuration reference
(:func:`reference_markdown`, ``python -m fed_dp.run_config > docs/reference/configuration.md``) are generated
from it, and the public signatures take their defaults from :data:`SERVER_DEFAULTS` and its siblings.

Keys are hyphenated (``privacy.noise-multiplier``); Python fields use underscores. An optional key (default
None) is unset when it is absent or when it holds "" (:data:`fed_dp.schema.UNSET`), which no valid value of any
key is: a Flower run config cannot leave a key out, so this is how it says "not set"; any other value is
checked as a value (``privacy.noise-multiplier = -1`` is refused). ``[task]`` is open: besides ``ref`` and
``root``, every key is a keyword argument of the task factory (a value of "" means "not given": the factory's
own default applies).

``privacy.noise-multiplier`` and ``privacy.target-epsilon``: give one. σ = 1.0 applies when neither is given.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import importlib.metadata
import json
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import DEFAULT_NOISE_MULTIPLIER, LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.schema import UNSET, Key, keys_of, setting
from fed_dp.validation import check_seed
from fed_dp.validation import is_int as _integer
from fed_dp.validation import is_real as _real
from fed_dp.validation import require as _check

if TYPE_CHECKING:
    from fed_dp.optimizers import ServerOptimizer

# Nothing here imports torch (fed_dp.optimizers is imported when an optimizer is built): a command checks the keys of
# its config (check_names) before it loads PyTorch, so a mistyped key is reported at once.

#: The server optimizers by name, the choices of ``optimizer.name``: the keys of ``fed_dp.optimizers.OPTIMIZERS``, written
#: here too so that this schema loads without torch (tests/fed_dp/test_run_config.py checks that they are the same).
OPTIMIZER_NAMES = ("dp-fedavg", "dp-sgd", "dp-sgdm", "dp-adam", "dp-adambc", "dp-adamw", "dp-adamw-bc", "dp-adam-ime",
                   "dp-adam-stp", "noiseless-adam", "noiseless-adam-stp", "dp-adagrad", "dp-adagrad-bc",
                   "dp-adagrad-ime", "noiseless-adagrad")

#: The entry-point group of tasks by short name (``task.ref = "heavy-tail"``): fed-dp's own built-in tasks
#: (``fed_dp.simulations.tasks.builtin``, declared in pyproject.toml's ``[project.entry-points."fed_dp.tasks"]``)
#: and those any other installed package registers the same way. Any other task is named ``package.module:factory``.
TASK_GROUP = "fed_dp.tasks"


@functools.cache
def registered_tasks() -> dict[str, str]:
    """Short name → ``package.module:factory`` of every task registered under :data:`TASK_GROUP` by an installed
    distribution, read from the installed metadata (``importlib.metadata``) without importing any task: the core
    finds the built-in tasks without naming the layer that defines them. A name two distributions register with
    different factories is refused."""
    tasks: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group=TASK_GROUP):
        _check(tasks.get(entry.name, entry.value) == entry.value,
               f"the task name {entry.name!r} is registered twice under the entry-point group {TASK_GROUP!r}, as "
               f"{tasks.get(entry.name)!r} and {entry.value!r}: uninstall one of the packages that register it")
        tasks[entry.name] = entry.value
    return tasks


def _unknown_task(ref: str) -> str:
    """What to say about a ``task.ref`` that is neither a registered name nor ``package.module:factory``."""
    names = registered_tasks()
    if not names:
        return (f"task.ref {ref!r} is not 'package.module:factory', and no task names are registered (entry-point "
                f"group {TASK_GROUP!r}): fed-dp's installed metadata is missing or stale; reinstall it "
                "(pip install -e . in a checkout)")
    return f"task.ref {ref!r} is neither a built-in task ({', '.join(names)}) nor 'package.module:factory'"


TRAINING_PATHS = ("auto", "vectorized", "sequential")
NOISE_SOURCES = ("auto", "secure", "torch")


# --- sections: the schema (fed_dp.schema.setting), with PrivacyConfig and LocalTraining of fed_dp.config -------


@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """Which task to build: ``ref`` (built-in name or ``package.module:factory``), its data folder and the
    factory's keyword arguments (every other key of ``[task]``)."""

    ref: str = setting("heavy-tail", help="the task: a built-in name (" + ", ".join(registered_tasks())
                       + ") or 'package.module:factory', a function returning a fed_dp.Task; the other [task] keys "
                       "are its keyword arguments")
    root: str | None = setting(None, help="local data folder of a task that reads files (a SuperNode's data-root "
                               "wins)")
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(isinstance(self.ref, str) and self.ref, f"task.ref must be a non-empty string, got {self.ref!r}")
        _check(self.ref in registered_tasks() or ":" in self.ref, _unknown_task(self.ref))

    @property
    def target(self) -> str:
        """``package.module:factory`` of the task."""
        return registered_tasks().get(self.ref, self.ref)


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """The server optimizer: a name of :data:`fed_dp.optimizers.OPTIMIZERS` and the hyper-parameters given (an
    unset one keeps the optimizer's own default)."""

    name: str = setting("dp-adam", help="server optimizer (docs/explanation/server-optimizers.md)", choices=OPTIMIZER_NAMES)
    lr: float | None = setting(None, help="η (unset: the optimizer's default)")
    beta1: float | None = setting(None, help="β₁ of the Adam variants")
    beta2: float | None = setting(None, help="β₂ of the Adam variants")
    eps: float | None = setting(None, help="ε of the adaptive optimizers")
    weight_decay: float | None = setting(None, help="λ, decoupled weight decay (dp-adamw*)")
    momentum: float | None = setting(None, help="μ of dp-sgd / dp-sgdm")
    bc_floor: float | None = setting(None, help="γ of bias correction (unset: the noise variance Φ̂_t, = (σζ/B)² "
                                     "for independent noise)")
    ime_alpha: float | None = setting(None, help="α of independent moment estimation")
    stp_eps: float | None = setting(None, help="ε_s of scale-then-privatize")

    def __post_init__(self) -> None:
        _check(self.name in OPTIMIZER_NAMES, f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
        if self.options:
            self.build()  # validates every hyper-parameter now, before anything runs (this loads torch)

    @property
    def options(self) -> dict[str, Any]:
        """The hyper-parameters given, as keyword arguments of :func:`fed_dp.optimizers.make_optimizer`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name" and getattr(self, f.name)
                is not None}

    def build(self) -> ServerOptimizer:
        """The optimizer (non-private baselines are built as simulations; deployments refuse them)."""
        from fed_dp.optimizers import make_optimizer

        with simulation():
            return make_optimizer(self.name, **self.options)


@dataclass(frozen=True, kw_only=True)
class AdaptiveSettings:
    """Adaptive clipping as configured; :meth:`build` turns it into fed_dp's config once B and ζ are known."""

    enabled: bool = setting(False, help="adaptive clipping to a quantile of update norms (Andrew et al. 2021)")
    # γ's and η_ζ's defaults are written once, on fed_dp.adaptive_clipping.AdaptiveClipConfig (the Python API)
    target_quantile: float = setting(AdaptiveClipConfig.target_quantile, help="γ: the quantile of update norms to "
                                     "track")
    learning_rate: float = setting(AdaptiveClipConfig.learning_rate, help="η_ζ of the geometric clip update")
    bit_noise_std: float | None = setting(None, help="σ_b on the clip-bit sum (unset: max(B/20, 2.5σ), the update's "
                                          "noise then within 2% of σ)")

    def build(self, privacy: PrivacyConfig) -> AdaptiveClipConfig | None:
        """None when not enabled; else ζ_0 = privacy.clip_norm and σ_b as set, or, unset, decided once σ is known
        (``fed_dp.adaptive_clipping.default_bit_noise_std``: max(B/20, 2.5σ))."""
        if not self.enabled:
            return None
        return AdaptiveClipConfig(target_quantile=self.target_quantile, learning_rate=self.learning_rate,
                                  bit_noise_std=self.bit_noise_std, initial_clip_norm=privacy.clip_norm)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    checkpoint_dir: str | None = setting(None, help="folder of the checkpoints (a public part, and secret/ with the "
                                         "noise state and the operator's diagnostics) and results.json (absolute "
                                         "under Flower); unset: none")
    reply_timeout: float = setting(120.0, help="seconds to wait for the replies of one round (size it from the "
                                   "slowest node's round; a node still connected that misses it is named in "
                                   "secret/operator.log)")
    min_nodes: int = setting(1, help="SuperNodes hosting users that must be connected before every round")
    node_wait: float = setting(60.0, help="seconds to wait for min-nodes; then the run stops with an error, "
                               "resumable")
    max_empty_rounds: int = setting(2, help="stop with an error after this many rounds in a row in which users "
                                    "were sampled but no valid reply came")
    noise_source: str = setting("auto", help="Gaussian noise from secure (AES-CTR keyed from OS entropy) or torch "
                                "(a seeded generator, reproducible); auto: secure in a Flower run without "
                                "FED_DP_SERVER_SEED, else torch", choices=NOISE_SOURCES)
    allow_unreported_model: bool = setting(False, help="use nodes whose ClientApp does not report its model "
                                           "(fed_dp.query_reply without model=) unchecked; refused before round 1 "
                                           "otherwise")

    def __post_init__(self) -> None:
        for name in ("reply_timeout", "node_wait"):
            value = getattr(self, name)
            _check(_real(value) and value > 0, f"server.{name.replace('_', '-')} must be a number > 0, got {value!r}")
        for name in ("min_nodes", "max_empty_rounds"):
            value = getattr(self, name)
            _check(_integer(value) and value >= 1, f"server.{name.replace('_', '-')} must be an integer >= 1, "
                   f"got {value!r}")
        _check(self.noise_source in NOISE_SOURCES,
               f"server.noise-source must be {', '.join(NOISE_SOURCES)}, got {self.noise_source!r}")
        _check(isinstance(self.allow_unreported_model, bool),
               f"server.allow-unreported-model must be true or false, got {self.allow_unreported_model!r}")


def resolve_noise_source(chosen: str, *, flower_run: bool, seeded: bool) -> str:
    """The noise source ``server.noise-source = chosen`` means for an engine: the one named, or for auto "secure"
    in a Flower run without a server seed and "torch" otherwise (a simulation, or a seeded research run)."""
    _check(chosen in NOISE_SOURCES, f"noise source must be one of {', '.join(NOISE_SOURCES)}, got {chosen!r}")
    if chosen != "auto":
        return chosen
    return "secure" if flower_run and not seeded else "torch"


@dataclass(frozen=True, kw_only=True)
class ClientSettings:
    device: str = setting("auto", help="where users train: auto (CUDA when present), cpu, cuda, cuda:N")
    training: str = setting("auto", help="auto (users whose update is one full-batch step: without a model per "
                            "user, unless their norms would cost more; the others vectorized over users on CUDA, and "
                            "on the CPU for small models without convolutions; one at a time otherwise), vectorized "
                            "or sequential", choices=TRAINING_PATHS)
    chunk_size: int | None = setting(None, help="most users in one vectorized call (unset: from memory)")

    def __post_init__(self) -> None:
        _check(self.training in TRAINING_PATHS,
               f"client.training must be one of {', '.join(TRAINING_PATHS)}, got {self.training!r}")
        _check(self.chunk_size is None or (_integer(self.chunk_size) and self.chunk_size >= 1),
               f"client.chunk-size must be an integer >= 1, got {self.chunk_size!r}")

    @property
    def vectorized(self) -> bool | None:
        """The training dispatcher's argument: None (auto), True or False."""
        return {"auto": None, "vectorized": True, "sequential": False}[self.training]


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    seed: int | None = setting(None, help="seeds the model and local training, and in fed-dp simulate the sampler "
                               "and noise too (a reproducible research run); a Flower run sends it to every client, "
                               "so its sampler and noise come from FED_DP_SERVER_SEED in the server's environment, "
                               "else OS entropy; unset: OS entropy")
    eval_every: int = setting(1, help="evaluate the initial model (round 0), every round t with t % k == 0 "
                                                "and the last (0: never)")

    def __post_init__(self) -> None:
        check_seed("run.seed", self.seed)
        _check(_integer(self.eval_every) and self.eval_every >= 0,
               f"run.eval-every must be an integer >= 0, got {self.eval_every!r}")


#: The dataclass of each table, in the order of the configuration reference.
SECTIONS: dict[str, type] = {"task": TaskSettings, "privacy": PrivacyConfig, "optimizer": OptimizerSettings,
                             "local": LocalTraining, "adaptive": AdaptiveSettings, "server": ServerSettings,
                             "client": ClientSettings, "run": RunSettings}
TABLES = tuple(SECTIONS)

#: Every key of every table, read from the sections (:func:`fed_dp.schema.keys_of`).
KEYS: tuple[Key, ...] = tuple(key for table, section in SECTIONS.items() for key in keys_of(table, section))

#: ``table.key`` → its default (None: unset), for front ends other than the sections (the accounting CLI's options).
DEFAULTS: dict[str, Any] = {key.dotted: key.default for key in KEYS}

#: The sections at their defaults: what the public signatures' defaults read (``fed_dp.train``,
#: ``fed_dp.round_loop.run_rounds``, ``UserLevelDP``), so that a default is written once, on its section.
OPTIMIZER_DEFAULTS = OptimizerSettings()
SERVER_DEFAULTS = ServerSettings()
CLIENT_DEFAULTS = ClientSettings()
RUN_DEFAULTS = RunSettings()


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run, validated: what every engine and app reads (see the module docstring for the keys)."""

    task: TaskSettings = field(default_factory=TaskSettings)
    privacy: PrivacyConfig
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    local: LocalTraining = field(default_factory=LocalTraining)
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    client: ClientSettings = field(default_factory=ClientSettings)
    run: RunSettings = field(default_factory=RunSettings)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any]) -> "RunConfig":
        """Parse nested tables (a TOML document): unknown tables or keys, wrong types and bad values are errors
        that name the key; absent keys take their defaults."""
        tables = {name: dict(value) if isinstance(value, Mapping) else value for name, value in tables.items()}
        check_names(tables)
        values = {table: _table_values(table, tables.get(table, {})) for table in TABLES if table != "task"}
        privacy = _privacy(values["privacy"])
        return cls(
            task=_task_settings(tables.get("task", {})),
            privacy=privacy,
            optimizer=_built("optimizer", OptimizerSettings, values["optimizer"]),
            local=_built("local", LocalTraining, values["local"]),
            adaptive=_adaptive(values["adaptive"], privacy),
            server=_built("server", ServerSettings, values["server"]),
            client=_built("client", ClientSettings, values["client"]),
            run=_built("run", RunSettings, values["run"]),
        )

    @classmethod
    def from_flat(cls, run_config: Mapping[str, Any]) -> "RunConfig":
        """Parse a Flower run config (flat ``table.key`` names, as ``context.run_config`` holds them)."""
        return cls.from_tables(unflatten(run_config))


# --- parsing ------------------------------------------------------------------------------------------------


def _typed(key: Key, value: Any) -> Any:
    """``value`` checked against the key's type (an int is a float too); ValueError naming the key."""
    ok = {int: _integer, float: _real, bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}
    if not ok[key.kind](value):
        raise ValueError(f"{key.dotted} must be {key.kind.__name__}, got {value!r} ({type(value).__name__})")
    if key.choices and value not in key.choices:
        raise ValueError(f"{key.dotted} must be one of {', '.join(key.choices)}; got {value!r}")
    return float(value) if key.kind is float else value


def _closest(name: str, known: Sequence[str]) -> str:
    """" (did you mean X?)" for the known name closest to a mistyped one, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_names(given: Sequence[str], known: Sequence[str], what: str, listing: str) -> None:
    """A ValueError naming each of ``given`` that is not ``known`` (with the closest known name) and ``listing``."""
    unknown = [name for name in given if name not in known]
    _check(not unknown, f"unknown {what} {', '.join(name + _closest(name, known) for name in unknown)}; {listing}")


def check_names(tables: Mapping[str, Any]) -> None:
    """Every table and key of a config (nested tables, as TOML reads them) is one of the schema, else a ValueError
    naming the unknown ones, each with the closest known name. ``[task]`` is open (its other keys are the task's
    arguments). Names only, no values; nothing here loads torch, so a command checks its config's names first and
    a mistyped key is reported at once (``fed-dp simulate --set``)."""
    unknown_names(list(tables), TABLES, "config table(s)", f"tables are {', '.join(TABLES)}")
    for table, given in tables.items():
        _check(isinstance(given, Mapping), f"[{table}] must be a table of keys, got {given!r}")
        if table != "task":
            known = [key.name for key in KEYS if key.table == table]
            unknown_names([f"{table}.{name}" for name in given], [f"{table}.{name}" for name in known], "key(s)",
                          f"[{table}] has {', '.join(known)} (docs/reference/configuration.md)")


def _table_values(table: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of one table as Python fields: given values typed, absent keys at their defaults, and optional
    keys holding :data:`~fed_dp.schema.UNSET` ("") unset (None)."""
    keys = {key.name: key for key in KEYS if key.table == table}
    values: dict[str, Any] = {}
    for name, key in keys.items():
        if name not in given or (key.optional and given[name] == UNSET):
            values[key.field] = key.default
        else:
            values[key.field] = _typed(key, given[name])
    return values


def _task_settings(given: Mapping[str, Any]) -> TaskSettings:
    values = _table_values("task", {k: v for k, v in given.items() if k in ("ref", "root")})
    options = {k.replace("-", "_"): v for k, v in given.items() if k not in ("ref", "root") and v != ""}
    return TaskSettings(ref=values["ref"], root=values["root"], options=options)


def _privacy(values: dict[str, Any]) -> PrivacyConfig:
    if values["noise_multiplier"] is None and values["target_epsilon"] is None:
        values["noise_multiplier"] = DEFAULT_NOISE_MULTIPLIER
    if values["noise_multiplier"] is not None and values["target_epsilon"] is not None:
        raise ValueError(
            f"privacy.noise-multiplier = {values['noise_multiplier']} and privacy.target-epsilon = "
            f"{values['target_epsilon']} are both set: give one (in a Flower run config, set "
            "privacy.noise-multiplier=\"\" to calibrate σ for the target ε)"
        )
    return _built("privacy", PrivacyConfig, values)


def _built(table: str, section: Callable[..., Any], values: dict[str, Any]) -> Any:
    """``section(**values)``, where a ValueError that names a field by its Python name (``noise_multiplier``)
    names the config key instead (``privacy.noise-multiplier``): the reader of a config error edits keys. A name
    without an underscore is rewritten only after its table's name (``local steps``): ``rounds`` or ``delta`` are
    also plain words of a message."""
    try:
        return section(**values)
    except ValueError as error:
        message = str(error)
        for name in sorted(values, key=len, reverse=True):
            prefix = f"(?:{table} )?" if "_" in name else f"{table} "  # "local steps" is a field too
            message = re.sub(rf"(?<![\w.-]){prefix}{name}(?![\w-])", f"{table}.{name.replace('_', '-')}", message)
        if message == str(error):
            raise
        raise ValueError(message) from error


def _adaptive(values: dict[str, Any], privacy: PrivacyConfig) -> AdaptiveSettings:
    settings = AdaptiveSettings(**values)
    settings.build(privacy)  # validates the enabled settings now, before anything runs
    if not settings.enabled:
        changed = [k for k, v in values.items() if v != getattr(AdaptiveSettings(), k)]
        _check(not changed, f"adaptive.{changed[0].replace('_', '-') if changed else ''} is set but "
               "adaptive.enabled is false; enable adaptive clipping or leave its keys out")
    return settings


def unflatten(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"privacy.rounds": 5}`` → ``{"privacy": {"rounds": 5}}`` (one level: tables and their keys)."""
    tables: dict[str, dict[str, Any]] = {}
    for dotted, value in flat.items():
        table, _, name = str(dotted).partition(".")
        _check(bool(name), f"run-config key {dotted!r} is not 'table.key'; tables are {', '.join(TABLES)}")
        tables.setdefault(table, {})[name] = value
    return tables


def flower_defaults(task_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every key with its default as a Flower run config holds it (unset values for unset defaults), plus
    ``task.<option>`` entries: what ``[tool.flwr.app.config]`` of an app using fed-dp's apps lists."""
    defaults = {key.dotted: key.flower_default for key in KEYS}
    defaults.update({f"task.{name}": value for name, value in (task_options or {}).items()})
    return defaults


def _toml_value(value: Any) -> str:
    """A scalar as a TOML literal (``"text"``, ``true``, ``1e-05``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    return repr(value)


def flower_table(task_options: Sequence[str] = ()) -> str:
    """The body of ``[tool.flwr.app.config]`` (:func:`flower_defaults` as TOML lines), with ``task.<option> = ""``
    for each of ``task_options``: what fed-dp's pyproject.toml lists (``python -m fed_dp.run_config --flower``)."""
    values = flower_defaults({name: UNSET for name in task_options})
    return "".join(f"{name} = {_toml_value(value)}\n" for name, value in values.items())


def _shown_default(key: Key) -> str:
    return "unset" if key.optional else _toml_value(key.default)


def reference_markdown() -> str:
    """The configuration reference (``docs/reference/configuration.md``), generated from :data:`KEYS`: one table
    per section with each key's type, default and meaning, so that it is never written by hand."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from fed_dp/run_config.py by `python -m fed_dp.run_config > docs/reference/configuration.md`;"
        " do not edit by hand. -->",
        "",
        "Every key of a run, read by `fed-dp simulate` / `compare` TOML files (tables `[task]`, `[privacy]`, ...),"
        " `--set table.key=value`, Flower run configs (`[tool.flwr.app.config]`, `flwr run --run-config`, keys"
        " flattened to `table.key`) and `fed_dp.RunConfig` in Python, where each table is a frozen dataclass and each"
        " key a field (hyphens become underscores).",
        "",
        "A key whose default is *unset* is optional. A Flower run config cannot leave a key out, so there an unset"
        ' key holds the empty string `""`, which is never a valid value; any other value is checked as a value'
        " (`privacy.noise-multiplier = -1` is refused, not read as unset). Give `privacy.noise-multiplier` or"
        " `privacy.target-epsilon`, not both; σ = 1.0 applies when neither is given. `[task]` is open: besides"
        ' `ref` and `root`, every key is a keyword argument of the task function (`""`: not given, the function\'s'
        " own default applies).",
    ]
    for table in TABLES:
        lines += ["", f"## `[{table}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in (k for k in KEYS if k.table == table):
            choices = f" (one of {', '.join(f'`{c}`' for c in key.choices)})" if key.choices else ""
            doc = (key.doc + choices).replace("|", "\\|")
            lines.append(f"| `{key.dotted}` | {key.kind.__name__} | `{_shown_default(key)}` | {doc} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fed_dp.run_config``: print the configuration reference (Markdown); with ``--flower``, the body
    of the Flower run-config table, ``[tool.flwr.app.config]``, listing the given ``task.`` options."""
    parser = argparse.ArgumentParser(prog="python -m fed_dp.run_config", description=main.__doc__.split(";")[0])
    parser.add_argument("--flower", nargs="*", metavar="TASK_OPTION",
                        help="print the Flower run-config table instead, with task.OPTION = \"\" for each option")
    args = parser.parse_args(argv)
    sys.stdout.write(reference_markdown() if args.flower is None else flower_table(args.flower))
    return 0


def apply_overrides(tables: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``--set table.key=value`` on nested tables (the value parsed as a TOML literal, else kept as text).

    Keys of the experiment tables of ``fed-dp simulate`` (``optimizers.NAME.key``) are allowed too."""
    tables = copy.deepcopy(dict(tables))
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        _check(bool(sep) and "." in dotted, f"--set expects table.key=value (e.g. privacy.rounds=50), got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *path, name = dotted.split(".")
        _check(path[0] in TABLES + ("optimizers",),
               f"--set {dotted}: unknown table {path[0]!r}{_closest(path[0], TABLES)}; tables are {', '.join(TABLES)}")
        target = tables
        for table in path:
            target = target.setdefault(table, {})
        target[name] = value
    return tables


if __name__ == "__main__":
    raise SystemExit(main())
