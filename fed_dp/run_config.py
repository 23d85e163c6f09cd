"""The one run configuration: every key once, with its type, default and meaning, parsed into frozen sections.

Three front ends read this schema and nothing else:

* ``fed-dp simulate`` / ``compare`` TOML files (tables ``[task]``, ``[privacy]``, ...) and ``--set table.key=value``;
* Flower's run config (``[tool.flwr.app.config]`` in a pyproject.toml, ``flwr run --run-config``): the same
  keys flattened to ``table.key`` (:meth:`RunConfig.from_flat`);
* Python: :class:`RunConfig` and its sections directly, or :meth:`RunConfig.from_tables`.

Keys are hyphenated (``privacy.noise-multiplier``); Python fields use underscores. An optional key is unset
when it is absent or when it holds its key's *unset value* (``unset`` in :data:`KEYS`: 0 for positive
numbers, −1 for numbers that may be 0, "" for text): a Flower run config cannot leave a key out, so this is
how it says "not set". ``[task]`` is open: besides ``ref`` and ``root``, every key is a keyword argument of
the task factory (a value of "" means "not given": the factory's own default applies).

``privacy.noise-multiplier`` and ``privacy.target-epsilon``: give one. σ = 1.0 applies when neither is given;
in a Flower run config, which always holds both keys, set ``privacy.noise-multiplier=0`` to calibrate σ for
``privacy.target-epsilon``.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import ACCOUNTANTS, NOISES, SAMPLERS, WORKLOADS, LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.optimizers import OPTIMIZERS, ServerOptimizer, make_optimizer
from fed_dp.validation import is_int as _integer
from fed_dp.validation import is_real as _real
from fed_dp.validation import require as _check

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
TABLES = ("task", "privacy", "optimizer", "local", "adaptive", "server", "client", "run")


@dataclass(frozen=True)
class Key:
    """One run-configuration key: ``table.name``, its Python type, default (None: unset), meaning, the value
    that means "unset" in a text config (None: the key always has a value) and, for text keys, the choices."""

    table: str
    name: str
    kind: type
    default: Any
    doc: str
    unset: Any = None
    choices: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.table}.{self.name}"

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flower_default(self) -> Any:
        """The value a Flower run config holds for the default (the unset value for an unset default)."""
        return self.unset if self.default is None else self.default


KEYS: tuple[Key, ...] = (
    Key("task", "ref", str, "heavy-tail", "the task: a built-in name (" + ", ".join(registered_tasks())
        + ") or 'package.module:factory', a function returning a fed_dp.Task; the other [task] keys are its "
        "keyword arguments"),
    Key("task", "root", str, None, "local data folder of a task that reads files (a SuperNode's data-root wins)",
        unset=""),
    Key("privacy", "num-users", int, None, "N; unset: the task's number of users (if set, it must equal it)",
        unset=0),
    Key("privacy", "expected-cohort", int, 10, "B: expected users per round, the fixed denominator"),
    Key("privacy", "rounds", int, 5, "T: server rounds the accounting plans for"),
    Key("privacy", "noise-multiplier", float, None, "σ: noise std on the sum of clipped updates / ζ (1.0 when "
        "neither σ nor target-epsilon is given; 0: a non-private baseline, no noise, ε infinite)", unset=-1.0),
    Key("privacy", "target-epsilon", float, None, "calibrate σ with dp_accounting so that the whole run has "
        "this user-level ε at delta", unset=0.0),
    Key("privacy", "clip-norm", float, 1.0, "ζ: L2 bound of one user's whole update"),
    Key("privacy", "delta", float, 1e-5, "δ of (ε, δ); choose below 1/N"),
    Key("privacy", "sampler", str, "poisson", "user sampler (README: Samplers and their accounting)",
        choices=SAMPLERS),
    Key("privacy", "noise", str, "independent", "independent Gaussian, or bandmf or blt (correlated) noise",
        choices=NOISES),
    Key("privacy", "bands", int, 1, "b: BandMF bands = cyclic-poisson groups = required min-separation"),
    Key("privacy", "buffers", int, None, "ℓ: buffers of the BLT strategy (noise blt; 1 … 16)", unset=0),
    Key("privacy", "max-participations", int, None, "k for min-sep (unset: ceil(T / (N // B)))", unset=0),
    Key("privacy", "accountant", str, "pld", "pld (tighter) or rdp (faster per round; needed by "
        "without-replacement)", choices=ACCOUNTANTS),
    Key("privacy", "epsilon-budget", float, None, "refuse any round that would take ε above this", unset=0.0),
    Key("privacy", "workload", str, "prefix-sum", "workload of the BandMF or BLT strategy", choices=WORKLOADS),
    Key("privacy", "momentum", float, 0.0, "μ of the momentum workload"),
    Key("optimizer", "name", str, "dp-adam", "server optimizer (README: Server optimizers)",
        choices=tuple(OPTIMIZERS)),
    Key("optimizer", "lr", float, None, "η (unset: the optimizer's default)", unset=0.0),
    Key("optimizer", "beta1", float, None, "β₁ of the Adam variants", unset=-1.0),
    Key("optimizer", "beta2", float, None, "β₂ of the Adam variants", unset=-1.0),
    Key("optimizer", "eps", float, None, "ε of the adaptive optimizers", unset=0.0),
    Key("optimizer", "weight-decay", float, None, "λ, decoupled weight decay (dp-adamw*)", unset=-1.0),
    Key("optimizer", "momentum", float, None, "μ of dp-sgd / dp-sgdm", unset=-1.0),
    Key("optimizer", "bc-floor", float, None, "γ of bias correction (unset: the noise variance Φ̂_t, "
        "= (σζ/B)² for independent noise)", unset=0.0),
    Key("optimizer", "ime-alpha", float, None, "α of independent moment estimation", unset=0.0),
    Key("optimizer", "stp-eps", float, None, "ε_s of scale-then-privatize", unset=0.0),
    Key("local", "epochs", int, 1, "passes over a user's examples per round"),
    Key("local", "steps", int, None, "minibatch steps per round instead of epochs", unset=0),
    Key("local", "batch-size", int, 16, "minibatch size of local SGD"),
    Key("local", "lr", float, 0.1, "local learning rate"),
    Key("local", "momentum", float, 0.0, "local SGD momentum"),
    Key("local", "weight-decay", float, 0.0, "local SGD weight decay (L2)"),
    Key("local", "max-examples", int, None, "train on a user's first k examples only", unset=0),
    Key("adaptive", "enabled", bool, False, "adaptive clipping to a quantile of update norms (Andrew et al. 2021)"),
    Key("adaptive", "target-quantile", float, 0.5, "γ: the quantile of update norms to track"),
    Key("adaptive", "learning-rate", float, 0.2, "η_ζ of the geometric clip update"),
    Key("adaptive", "bit-noise-std", float, None, "σ_b on the clip-bit sum (unset: B/20)", unset=0.0),
    Key("server", "checkpoint-dir", str, None, "folder of the checkpoints (a public part, and secret/ with the "
        "noise state and the operator's diagnostics) and results.json (absolute under Flower); unset: none",
        unset=""),
    Key("server", "reply-timeout", float, 120.0, "seconds to wait for the replies of one round (size it from the "
        "slowest node's round; a node still connected that misses it is named in secret/operator.log)"),
    Key("server", "min-nodes", int, 1, "SuperNodes hosting users that must be connected before every round"),
    Key("server", "node-wait", float, 60.0, "seconds to wait for min-nodes; then the run stops with an error, "
        "resumable"),
    Key("server", "max-empty-rounds", int, 2, "stop with an error after this many rounds in a row in which "
        "users were sampled but no valid reply came"),
    Key("server", "noise-source", str, "auto", "Gaussian noise from secure (AES-CTR keyed from OS entropy) or "
        "torch (a seeded generator, reproducible); auto: secure in a Flower run without FED_DP_SERVER_SEED, else torch",
        choices=("auto", "secure", "torch")),
    Key("client", "device", str, "auto", "where users train: auto (CUDA when present), cpu, cuda, cuda:N"),
    Key("client", "training", str, "auto", "auto (users whose update is one full-batch step: without a model per user, unless "
        "their norms would cost more; the others vectorized over users on CUDA, and on the CPU for small models "
        "without convolutions; one at a time otherwise), vectorized or sequential", choices=TRAINING_PATHS),
    Key("client", "chunk-size", int, None, "most users in one vectorized call (unset: from memory)", unset=0),
    Key("run", "seed", int, None, "seeds the model and local training, and in fed-dp simulate the sampler and noise "
        "too (a reproducible research run); a Flower run sends it to every client, so its sampler and noise come "
        "from FED_DP_SERVER_SEED in the server's environment, else OS entropy; unset: OS entropy", unset=-1),
    Key("run", "eval-every", int, 1, "evaluate the initial model (round 0), every round t with t % k == 0 and "
        "the last (0: never)"),
)

# --- sections ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """Which task to build: ``ref`` (built-in name or ``package.module:factory``), its data folder and the
    factory's keyword arguments."""

    ref: str = "heavy-tail"
    root: str | None = None
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
    """The server optimizer: a name of :data:`fed_dp.optimizers.OPTIMIZERS` and the hyper-parameters given."""

    name: str = "dp-adam"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.build()  # validates the name and every hyper-parameter now, before anything runs

    def build(self) -> ServerOptimizer:
        """The optimizer (non-private baselines are built as simulations; deployments refuse them)."""
        with simulation():
            return make_optimizer(self.name, **self.options)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    checkpoint_dir: str | None = None
    reply_timeout: float = 120.0
    min_nodes: int = 1
    node_wait: float = 60.0
    max_empty_rounds: int = 2
    noise_source: str = "auto"

    def __post_init__(self) -> None:
        for name in ("reply_timeout", "node_wait"):
            value = getattr(self, name)
            _check(_real(value) and value > 0, f"server.{name.replace('_', '-')} must be a number > 0, got {value!r}")
        for name in ("min_nodes", "max_empty_rounds"):
            value = getattr(self, name)
            _check(_integer(value) and value >= 1, f"server.{name.replace('_', '-')} must be an integer >= 1, "
                   f"got {value!r}")
        _check(self.noise_source in ("auto", "secure", "torch"),
               f"server.noise-source must be auto, secure or torch, got {self.noise_source!r}")

    @property
    def chosen_noise_source(self) -> str | None:
        """The noise source to ask for: None for auto (each engine's default), else the one named."""
        return None if self.noise_source == "auto" else self.noise_source


@dataclass(frozen=True, kw_only=True)
class ClientSettings:
    device: str = "auto"
    training: str = "auto"
    chunk_size: int | None = None

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
    seed: int | None = None
    eval_every: int = 1

    def __post_init__(self) -> None:
        _check(self.seed is None or (_integer(self.seed) and self.seed >= 0),
               f"run.seed must be an integer >= 0 (or unset), got {self.seed!r}")
        _check(_integer(self.eval_every) and self.eval_every >= 0,
               f"run.eval-every must be an integer >= 0, got {self.eval_every!r}")


@dataclass(frozen=True, kw_only=True)
class AdaptiveSettings:
    """Adaptive clipping as configured; :meth:`build` turns it into fed_dp's config once B and ζ are known."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    bit_noise_std: float | None = None

    def build(self, privacy: PrivacyConfig) -> AdaptiveClipConfig:
        """ζ_0 = privacy.clip_norm; σ_b defaults to B/20 (Andrew et al. 2021)."""
        std = self.bit_noise_std if self.bit_noise_std is not None else privacy.expected_cohort / 20
        return AdaptiveClipConfig(target_quantile=self.target_quantile, learning_rate=self.learning_rate,
                                  bit_noise_std=std, initial_clip_norm=privacy.clip_norm)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run, validated: what every engine and app reads (see the module docstring for the keys)."""

    task: TaskSettings = field(default_factory=TaskSettings)
    privacy: PrivacyConfig
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    local: LocalTraining = field(default_factory=LocalTraining)
    adaptive: AdaptiveSettings | None = None
    server: ServerSettings = field(default_factory=ServerSettings)
    client: ClientSettings = field(default_factory=ClientSettings)
    run: RunSettings = field(default_factory=RunSettings)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any]) -> "RunConfig":
        """Parse nested tables (a TOML document): unknown tables or keys, wrong types and bad values are errors
        that name the key; absent keys take their defaults."""
        tables = {name: dict(value) if isinstance(value, Mapping) else value for name, value in tables.items()}
        unknown = sorted(set(tables) - set(TABLES))
        _check(not unknown, f"unknown config table(s) {unknown}; tables are {', '.join(TABLES)}")
        for name, value in tables.items():
            _check(isinstance(value, dict), f"[{name}] must be a table of keys, got {value!r}")
        values = {table: _table_values(table, tables.get(table, {})) for table in TABLES if table != "task"}
        return cls(
            task=_task_settings(tables.get("task", {})),
            privacy=_privacy(values["privacy"]),
            optimizer=OptimizerSettings(name=values["optimizer"].pop("name"), options=values["optimizer"]),
            local=LocalTraining(**values["local"]),
            adaptive=_adaptive(values["adaptive"]),
            server=ServerSettings(**values["server"]),
            client=ClientSettings(**values["client"]),
            run=RunSettings(**values["run"]),
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


def _table_values(table: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of one table as Python fields: given values typed, unset values dropped to None (or to the
    default when the key has one), absent keys at their defaults."""
    keys = {key.name: key for key in KEYS if key.table == table}
    unknown = sorted(set(given) - set(keys))
    _check(not unknown, f"unknown key(s) {', '.join(f'{table}.{k}' for k in unknown)}; [{table}] has "
           f"{', '.join(keys)}")
    values: dict[str, Any] = {}
    for name, key in keys.items():
        if name not in given or (key.unset is not None and given[name] == key.unset):
            values[key.field] = key.default
        else:
            values[key.field] = _typed(key, given[name])
    if table == "optimizer":  # hyper-parameters left unset take the optimizer's own defaults
        values = {k: v for k, v in values.items() if v is not None}
    return values


def _task_settings(given: Mapping[str, Any]) -> TaskSettings:
    values = _table_values("task", {k: v for k, v in given.items() if k in ("ref", "root")})
    options = {k.replace("-", "_"): v for k, v in given.items() if k not in ("ref", "root") and v != ""}
    return TaskSettings(ref=values["ref"], root=values["root"], options=options)


def _privacy(values: dict[str, Any]) -> PrivacyConfig:
    if values["noise_multiplier"] is None and values["target_epsilon"] is None:
        values["noise_multiplier"] = 1.0
    if values["noise_multiplier"] is not None and values["target_epsilon"] is not None:
        raise ValueError(
            f"privacy.noise-multiplier = {values['noise_multiplier']} and privacy.target-epsilon = "
            f"{values['target_epsilon']} are both set: give one (in a Flower run config, set "
            "privacy.noise-multiplier=0 to calibrate σ for the target ε)"
        )
    return PrivacyConfig(**values)


def _adaptive(values: dict[str, Any]) -> AdaptiveSettings | None:
    enabled = values.pop("enabled")
    settings = AdaptiveSettings(**values)
    if not enabled:
        changed = [k for k, v in values.items() if v != getattr(AdaptiveSettings(), k)]
        _check(not changed, f"adaptive.{changed[0].replace('_', '-') if changed else ''} is set but "
               "adaptive.enabled is false; enable adaptive clipping or leave its keys out")
        return None
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
               f"--set {dotted}: unknown table {path[0]!r}; tables are {', '.join(TABLES)}")
        target = tables
        for table in path:
            target = target.setdefault(table, {})
        target[name] = value
    return tables
