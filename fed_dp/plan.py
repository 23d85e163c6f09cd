"""The plan of one run: what an engine executes, built once and validated once (as jax_privacy's ``DPExecutionPlan``).

Both engines run the same plan: the in-process simulator (``fed_dp.simulations.engine.inprocess.run_plan``; its
public ``fed_dp.train`` builds a plan from its keywords) and the Flower strategy (``UserLevelDP(plan=...)``; its
keywords build one too). A run configuration becomes a plan in one place, :meth:`RunPlan.from_run_config`, which
``fed-dp simulate`` and fed-dp's own ServerApp call; nothing downstream unpacks the run configuration again.

What a plan holds: the privacy mechanism (:class:`~fed_dp.config.PrivacyConfig`; resolved — N and σ known — or
resolved once by the engine that runs it, with the task's population), the server optimizer, the local training
the users run, adaptive clipping, the seeds (``seed``: the sampler and the noise; ``training_seed``: the model's
initialization and local training), the noise source as decided for the engine (``"torch"`` or ``"secure"``,
never ``"auto"``), the checkpoint folder, how often to evaluate and how many empty rounds stop the run. Where the
users train (``[client]``) and what only Flower runs wait for (``[server]``'s nodes and timeouts) are not part of
it: each engine takes those itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.run_config import RUN_DEFAULTS, SERVER_DEFAULTS, resolve_noise_source
from fed_dp.validation import check_seed
from fed_dp.validation import is_int as _is_int
from fed_dp.validation import require as _require

if TYPE_CHECKING:
    from fed_dp.optimizers import ServerOptimizer
    from fed_dp.run_config import RunConfig

#: The noise sources a plan may hold: ``"auto"`` is decided when the plan is built (``resolve_noise_source``).
PLANNED_NOISE_SOURCES = ("torch", "secure")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One run as an engine executes it, validated once here (see the module docstring).

    Fields:
        privacy: the mechanism; an engine resolves it once (``fed_dp.accounting.resolve_privacy``) unless it is
            resolved already (then its N must be the task's).
        optimizer: the server optimizer (a ``fed_dp.optimizers.ServerOptimizer``, built).
        local: the users' local training; None: not recorded (a Flower strategy whose ServerApp does not say it);
            the in-process engine then trains with ``LocalTraining()``.
        adaptive_clipping: adaptive clipping, or None.
        seed: seeds the sampler and the noise (None: OS entropy).
        training_seed: seeds the model's initialization and local training (None: ``seed``).
        noise_source: ``"torch"`` (seeded, reproducible) or ``"secure"`` (AES-CTR from OS entropy), as decided for
            the engine (``fed_dp.run_config.resolve_noise_source``). Required: a plan has no default source,
            because the right one depends on the engine (a Flower run without a server seed needs "secure"; a
            default "torch" would give such a run a non-cryptographic generator without a word).
        checkpoint_dir: checkpoint folder (None: none).
        eval_every: evaluate round 0, every round t with t % k == 0 and the last (0: never).
        max_empty_rounds: stop after this many rounds in a row that sampled users but counted none.
    """

    privacy: PrivacyConfig
    optimizer: ServerOptimizer
    local: LocalTraining | None = None
    adaptive_clipping: AdaptiveClipConfig | None = None
    seed: int | None = None
    training_seed: int | None = None
    noise_source: str
    checkpoint_dir: str | None = SERVER_DEFAULTS.checkpoint_dir
    eval_every: int = RUN_DEFAULTS.eval_every
    max_empty_rounds: int = SERVER_DEFAULTS.max_empty_rounds

    def __post_init__(self) -> None:
        from fed_dp.optimizers import ServerOptimizer  # torch, loaded when a plan is built (not with the schema)

        _require(isinstance(self.privacy, PrivacyConfig),
                 f"privacy must be a fed_dp PrivacyConfig, got {type(self.privacy).__name__}")
        _require(isinstance(self.optimizer, ServerOptimizer),
                 f"optimizer must be a name or a fed_dp ServerOptimizer, got {type(self.optimizer).__name__}")
        _require(self.local is None or isinstance(self.local, LocalTraining),
                 f"local must be a fed_dp LocalTraining, got {type(self.local).__name__}")
        _require(self.adaptive_clipping is None or isinstance(self.adaptive_clipping, AdaptiveClipConfig),
                 f"adaptive_clipping must be a fed_dp AdaptiveClipConfig or None, got "
                 f"{type(self.adaptive_clipping).__name__}")
        check_seed("seed", self.seed)
        check_seed("training_seed", self.training_seed)
        _require(self.noise_source in PLANNED_NOISE_SOURCES,
                 f"a plan's noise_source must be {' or '.join(PLANNED_NOISE_SOURCES)} (decide 'auto' with "
                 f"fed_dp.run_config.resolve_noise_source), got {self.noise_source!r}")
        _require(self.checkpoint_dir is None or isinstance(self.checkpoint_dir, str),
                 f"checkpoint_dir must be a folder name or None, got {self.checkpoint_dir!r}")
        _require(_is_int(self.eval_every) and self.eval_every >= 0,
                 f"eval_every must be an integer >= 0, got {self.eval_every!r}")
        _require(_is_int(self.max_empty_rounds) and self.max_empty_rounds >= 1,
                 f"max_empty_rounds must be an integer >= 1, got {self.max_empty_rounds!r}")

    @classmethod
    def from_run_config(cls, run: RunConfig, *, privacy: PrivacyConfig | None = None, seed: int | None,
                        training_seed: int | None, checkpoint_dir: str | None, flower_run: bool) -> "RunPlan":
        """The plan of a run configuration: its optimizer and adaptive clipping built, ``[local]``,
        ``run.eval-every``, ``server.max-empty-rounds`` and ``server.noise-source`` decided for the engine
        (``flower_run``: a Flower run; ``seed`` given: seeded). ``privacy``: the configuration's ``[privacy]``
        resolved already (σ calibrated once for several plans), default ``run.privacy``. The seeds and the
        checkpoint folder are the engine's (``fed-dp simulate`` draws its seeds and gives each optimizer a folder;
        a ServerApp takes the server's seed from its environment)."""
        privacy = run.privacy if privacy is None else privacy
        return cls(privacy=privacy, optimizer=run.optimizer.build(), local=run.local,
                   adaptive_clipping=run.adaptive.build(privacy), seed=seed, training_seed=training_seed,
                   noise_source=resolve_noise_source(run.server.noise_source, flower_run=flower_run,
                                                     seeded=seed is not None),
                   checkpoint_dir=checkpoint_dir, eval_every=run.run.eval_every,
                   max_empty_rounds=run.server.max_empty_rounds)
