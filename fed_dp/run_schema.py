"""The run configuration's schema: one frozen section dataclass per table, every key declared once on its field.

Each field's default, meaning and choices are written with :func:`fed_dp.schema.setting`; :data:`KEYS` reads them
back for the parser (``fed_dp.run_parsing``), the generated Flower table and configuration reference
(``fed_dp.run_rendering``), and the public signatures' defaults (:data:`SERVER_DEFAULTS` and its siblings).
``fed_dp.run_config`` is the public entry: :class:`fed_dp.run_config.RunConfig`, a whole run, is built of these
sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import simulation
from fed_dp.schema import Key, keys_of, setting
from fed_dp.task_registry import _unknown_task, registered_tasks
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
