"""fed-dp's server as a Flower Strategy: user-level DP rounds inside any ServerApp, as ``FedAvg`` is used.

    strategy = UserLevelDP(PrivacyConfig(num_users=100, expected_cohort=10, rounds=50, target_epsilon=3.0,
                                         delta=1e-5), optimizer="dp-adambc", checkpoint_dir="/abs/path/ckpt")
    result = strategy.start(grid=grid, initial_arrays=model_arrays(model), evaluate_fn=centralized_evaluation(task))
    print(result.epsilon)                                       # user-level ε spent, at result.delta

Each round (docs/explanation/mechanism.md) runs through ``fed_dp.round`` in the one round loop (``fed_dp.round_loop``):
fed-dp's sampler picks users (not Flower's node sampling: one node may host many users), every node hosting
sampled users gets one TRAIN message (``fed_dp.clients.protocol``), replies are read and validated, re-clipped
to ζ per user, summed without weights, noised, divided by the fixed B, and the server optimizer steps; the
ledger refuses rounds over the ε budget; with a checkpoint folder every round is saved atomically and a new
run resumes there.

As in Flower's own ``Strategy.start``, every round of ``start`` goes through ``configure_train`` (the round's
messages), ``grid`` send-and-receive, ``aggregate_train`` (the new model and the round's metrics) and then the
centralized ``evaluate_fn``; the round loop around them adds the checkpoint, the ε ledger and the stop after
``max_empty_rounds`` rounds without any counted user, once per round. A subclass may override either method as
with ``FedAvg``, and call the base method inside its override:

- ``configure_train``: may add keys to ``config`` (they reach every node in the message's ``"config"`` record)
  or change the messages the base method returns (more content, fewer messages: users of a node left out count
  as dropped). It may not choose the users: they are the round's sample, drawn before the method is called.
- ``configure_evaluate`` / ``aggregate_evaluate``: no override; federated evaluation would read users' data
  outside the guarantee, and ``start`` refuses a subclass that overrides them. Evaluation is centralized:
  ``evaluate_fn(round, arrays)``, Flower's hook, on the server's held-out data before round 1 and every
  ``eval_every`` rounds.
- ``aggregate_train``: may log, add, rename or drop metrics; what it returns is the round's entry of
  ``result.train_metrics_clientapp``. The base method is the core round — re-clip to ζ per user, sum, Gaussian
  noise, divide by the fixed B, optimizer step, ε ledger — and runs on every round: an override that returns
  without calling it stops the run before any noise is drawn, and the arrays it returns must be the ones the base
  method returned (the model is the noised aggregate, never something computed from raw replies). Published
  records, ``results.json`` and the checkpoint hold the core round's metrics, not the override's.

An override runs in the server with the replies in hand: anything it computes from them itself (a norm, a
per-node count) is outside the privacy guarantee and must not be published. Called directly, one round at a
time (a caller driving its own rounds), the two methods run the same round without checkpoint, evaluation or
the empty-round stop, which only ``start`` adds.

Clients answer with ``fed_dp.query_reply`` (which users a node hosts, and the model it trains: a node whose
model differs from the server's is refused before round 1) and ``fed_dp.train_reply``
(the clipped sum of its sampled users). Federated evaluation on users' data would be outside the privacy
guarantee: this strategy evaluates centrally (``evaluate_fn``) and sends no EVALUATE messages.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from fed_dp.accounting import resolve_privacy
from fed_dp.checkpoint import committed_round
from fed_dp.adaptive_clipping import AdaptiveClipConfig
from fed_dp.clients import protocol
from fed_dp.clients.evaluation import evaluate_params
from fed_dp.clients.task import Task, trainable_layout, trainable_parameters
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.context import in_simulation
from fed_dp.flat import ParamLayout
from fed_dp.folder_lock import FolderInUseError
from fed_dp.optimizers import ServerOptimizer, make_optimizer
from fed_dp.randomness import derive_seed, entropy_seed
from fed_dp.contribution import RoundPlan
from fed_dp.round import ServerState, begin_round, finish_round, init_server
from fed_dp.server.membership import Membership, NotEnoughNodesError, probe_size
from fed_dp.server.messaging import retrying, send_and_receive
from fed_dp.round_loop import Aggregate, RoundReplies, run_rounds
from fed_dp.run_config import OPTIMIZER_DEFAULTS, RUN_DEFAULTS, SERVER_DEFAULTS, RunConfig, resolve_noise_source
from fed_dp.plan import RunPlan
from fed_dp.run_setup import describe_run
from fed_dp.validation import check_int, check_seed

log = logging.getLogger("fed_dp.server")

__all__ = ["DPResult", "RunStopped", "SERVER_SEED_VARIABLE", "UserLevelDP", "centralized_evaluation",
           "configure_logging", "model_arrays", "resume_advice", "server_seed", "with_advice"]


#: The environment variable of the ServerApp's process that seeds the sampler and the noise (never the run config,
#: which every ClientApp receives).
SERVER_SEED_VARIABLE = "FED_DP_SERVER_SEED"


def server_seed(environ: Mapping[str, str]) -> int | None:
    """The seed of the sampler and the noise from ``FED_DP_SERVER_SEED`` (None when unset or empty: OS entropy)."""
    text = environ.get(SERVER_SEED_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{SERVER_SEED_VARIABLE}={text!r} must be an integer >= 0 (the seed of the sampler and "
                         "the noise of a research run); unset it for OS entropy")
    return check_seed(SERVER_SEED_VARIABLE, int(text))


def configure_logging() -> None:
    """Print fed-dp's own messages (rounds, ε, dropped users) on stderr at INFO, unless the application has
    configured the ``fed_dp`` logger itself (a level or a handler): then its settings stay. The messages do not
    propagate to the root logger, whose level is left alone (at INFO, httpx would log every request, including
    the ServerApp's own log uploads, endlessly), and are printed once even when Flower configures root later."""
    logger = logging.getLogger("fed_dp")
    if logger.level == logging.NOTSET and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def model_arrays(model: nn.Module) -> ArrayRecord:
    """The initial arrays of a model for :meth:`UserLevelDP.start`: its trainable named parameters (what users
    train, ``fed_dp.clients.task.trainable_parameters``). Frozen parameters are not among them: they are never
    sent; give the model to the strategy as ``frozen=model`` so that nodes are checked to hold the same ones."""
    return ArrayRecord(torch_state_dict=OrderedDict((k, v.detach().cpu()) for k, v in trainable_parameters(model).items()))


def centralized_evaluation(task: Task, model: nn.Module | None = None) -> Callable[[int, ArrayRecord], MetricRecord | None]:
    """Flower's ``evaluate_fn`` for a task: the global model evaluated with ``task.evaluate`` on the server
    (None when the task has no evaluation). ``model``: the run's initial model, whose frozen parameters the
    evaluation keeps (a copy of it is used; pass it when the model has frozen parameters that are not loaded
    from files, e.g. initialized from ``run.seed``); None: the task's model is built once here."""
    if task.evaluate is None:
        return lambda server_round, arrays: None
    model = task.build_model() if model is None else copy.deepcopy(model)
    layout, _ = trainable_layout(model)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        params = layout.flatten(dict(arrays.to_torch_state_dict()))
        return MetricRecord(evaluate_params(model, layout, params, task.evaluate))

    return evaluate


class RunStopped(RuntimeError):
    """A run's failure whose own exception could not carry the resume advice in its message (one that is not a
    single string); the original is its ``__cause__``."""


def resume_advice(checkpoint_dir: str | None, released: int = 0, delta: float | None = None,
                  epsilon: float | None = None) -> str:
    """Whether and how a run that stopped can be resumed, for its failure message (the status ``flwr ls`` shows
    and ``fed-dp submit`` prints): from what ``checkpoint_dir`` holds (``fed_dp.checkpoint.committed_round``);
    without one, from ``released``, the rounds this process released (``epsilon``, ``delta``: what they spent)."""
    again = ("submit the run again with the same run config (fed-dp submit <federation> --run-config "
             f"\"... server.checkpoint-dir='{checkpoint_dir}'\", or flwr run . <federation> with the same overrides)")
    if checkpoint_dir:
        try:
            committed = committed_round(checkpoint_dir)
        except (ValueError, OSError) as error:
            return (f"Whether the run can be resumed depends on its checkpoint folder {checkpoint_dir}, which cannot "
                    f"be read ({error})")
        if committed:
            return (f"The run can be resumed: round(s) 1-{committed} are committed in {checkpoint_dir}. Fix the cause, "
                    f"then {again}: it continues after round {committed} with its ledger, noise stream and sampler "
                    "where they stopped, and no round is released twice")
        return f"No round is committed in {checkpoint_dir}: fix the cause, then {again}; it starts at round 1"
    keep = "set server.checkpoint-dir (an absolute path) so that a failure can be resumed"
    if released:
        spent = (f" (user-level epsilon {epsilon:.4f} at delta {delta:g})" if epsilon is not None and delta is not None
                 else "")
        return (f"The run cannot be resumed: server.checkpoint-dir is not set, so its {released} released round(s)"
                f"{spent} are not kept. Their privacy spending stands: a new run starts at round 1 and spends its "
                f"budget on top of theirs for the same users; {keep}")
    return f"No round was released: fix the cause and submit the run again; {keep}"


def with_advice(error: Exception, advice: str) -> Exception:
    """``error`` with ``advice`` appended to its message, keeping its type (a message of one string), or a
    :class:`RunStopped` saying both, caused by ``error``. Flower reports a ServerApp's failure as ``str(error)``."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0].rstrip('. ')}. {advice}",)
        return error
    stopped = RunStopped(f"{type(error).__name__}: {error}. {advice}")
    stopped.__cause__ = error
    return stopped


@dataclass
class DPResult(Result):
    """Flower's Result plus the privacy of the run: ε spent at δ (``"not private"`` for simulation-only
    baselines), the resolved privacy config (σ after calibration), every round's record, and why the run
    stopped early (the ε budget), if it did."""

    epsilon: float | str = 0.0
    delta: float = 0.0
    privacy: PrivacyConfig | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None


def _numeric(metrics: dict[str, Any]) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in metrics.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})


@dataclass
class _Pending:
    """A round between configure_train and aggregate_train: its plan, the messages sent, users asked per node,
    sampled users on no node; under start, the round loop's core round and the exchange's duration."""

    plan: RoundPlan
    messages: list[Message]
    asked: dict[int, int]
    unreachable: int
    aggregate: Aggregate | None = None
    seconds: float | None = None


class _Recorded:
    """The round loop's :data:`~fed_dp.round_loop.Aggregate`, remembering what it aggregated (start checks that
    aggregate_train ran it)."""

    def __init__(self, aggregate: Aggregate) -> None:
        self.aggregate, self.replies, self.state = aggregate, None, None

    def __call__(self, replies: RoundReplies) -> tuple[ServerState, dict[str, Any]]:
        self.state, metrics = self.aggregate(replies)
        self.replies = replies
        return self.state, metrics


class UserLevelDP(Strategy):
    """User-level DP federated training as a Flower Strategy (see the module docstring).

    privacy: the mechanism; ``num_users`` (the population the nodes host, user indices 0..N−1) must be set;
        ``target_epsilon`` instead of ``noise_multiplier`` calibrates σ when the run starts.
    optimizer: a server optimizer or its name (``fed_dp.optimizers.OPTIMIZERS``).
    adaptive_clipping: optional adaptive clipping (independent noise only).
    seed: None (real runs: sampler, noise and local-training seeds from OS entropy) or an int for a
        reproducible research run (logged as such). It stays in the server: clients get only a seed derived
        from it for their local training.
    training_seed: seeds the clients' local training instead of ``seed`` (the ServerApp passes ``run.seed``,
        which every client can read in the run config, so that it never seeds the sampler or the noise).
    checkpoint_dir: folder for the checkpoints (every round; ``fed_dp.checkpoint``: a publishable part and a
        secret part) and ``results.json``; resumes from it.
    eval_every: centralized evaluation every k rounds and after the last (0: never), as ``run.eval-every``.
    max_empty_rounds: stop with an error after this many rounds in a row without any counted user.
    min_nodes, node_wait: before every round at least ``min_nodes`` hosting nodes must be connected; the server
        waits at most ``node_wait`` seconds for them, then stops with ``NotEnoughNodesError`` (resumable).
    on_round: called with each round's record.
    noise_source: where the Gaussian noise comes from (``fed_dp.randomness``): ``"secure"`` (AES-CTR keyed from OS
        entropy, whatever the seed), ``"torch"`` (a seeded generator: reproducible, for research), or ``"auto"``
        (``server.noise-source``'s default): secure unless a seed is given.
    frozen: the run's model (or its ``protocol.frozen_fingerprint``) when it has frozen parameters
        (``requires_grad=False``): they are never sent, so every node builds its own, and a node whose frozen
        parameters differ from these (other names, shapes or values) is refused before round 1. None: the model
        has none; a node that reports frozen parameters is then refused.
    local: the local training the ClientApps run (the run config's ``[local]``, which the ServerApp passes): with a
        checkpoint folder it is recorded, so that a resume that changes it is refused; None: not recorded.

    With ``checkpoint_dir``, the run owns the folder while it runs (a second run on it is refused, naming this one)
    and records its optimizer, ``training_seed``, model, noise source, adaptive clipping and ``local`` there: a
    resume that changes any of them, or the privacy configuration, is refused before round 1
    (``fed_dp.run_setup``).
    allow_unreported_model: a node whose ClientApp does not report its model (``query_reply`` without ``model=``)
        is refused before round 1 (``fed_dp.server.membership.ModelNotReportedError``): the server could not check
        that it trains the server's model. True: such nodes are used unchecked, with a warning
        (``server.allow-unreported-model``).

    plan: instead of ``privacy`` … ``local`` above, a ``fed_dp.plan.RunPlan`` that holds them, built and validated
        once (the run's privacy, optimizer, local training, adaptive clipping, seeds, noise source, checkpoint folder,
        ``eval_every`` and ``max_empty_rounds``); giving both a plan and one of its parts is refused. The other
        keywords (``min_nodes``, ``node_wait``, ``on_round``, ``frozen``, ``allow_unreported_model``) are the Flower
        run's own.

    :meth:`from_run_config` builds the strategy of a run configuration, as fed-dp's own ServerApp does (through its
    plan).
    """

    def __init__(self, privacy: PrivacyConfig | None = None, optimizer: ServerOptimizer | str = OPTIMIZER_DEFAULTS.name,
                 *, plan: RunPlan | None = None, adaptive_clipping: AdaptiveClipConfig | None = None,
                 seed: int | None = None, training_seed: int | None = None,
                 checkpoint_dir: str | None = SERVER_DEFAULTS.checkpoint_dir, eval_every: int = RUN_DEFAULTS.eval_every,
                 max_empty_rounds: int = SERVER_DEFAULTS.max_empty_rounds, min_nodes: int = SERVER_DEFAULTS.min_nodes,
                 node_wait: float = SERVER_DEFAULTS.node_wait, on_round: Callable[[dict[str, Any]], None] | None = None,
                 noise_source: str = SERVER_DEFAULTS.noise_source, frozen: nn.Module | list[str] | None = None,
                 local: LocalTraining | None = None,
                 allow_unreported_model: bool = SERVER_DEFAULTS.allow_unreported_model) -> None:
        super().__init__()
        parts = {"privacy": (privacy, None), "optimizer": (optimizer, OPTIMIZER_DEFAULTS.name),
                 "adaptive_clipping": (adaptive_clipping, None), "seed": (seed, None),
                 "training_seed": (training_seed, None), "checkpoint_dir": (checkpoint_dir, SERVER_DEFAULTS.checkpoint_dir),
                 "eval_every": (eval_every, RUN_DEFAULTS.eval_every),
                 "max_empty_rounds": (max_empty_rounds, SERVER_DEFAULTS.max_empty_rounds),
                 "noise_source": (noise_source, SERVER_DEFAULTS.noise_source), "local": (local, None)}
        if plan is None:  # the keywords, validated once into the plan
            plan = RunPlan(privacy=privacy, optimizer=make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer,
                           local=local, adaptive_clipping=adaptive_clipping, seed=seed, training_seed=training_seed,
                           noise_source=resolve_noise_source(noise_source, flower_run=True, seeded=seed is not None),
                           checkpoint_dir=checkpoint_dir, eval_every=eval_every, max_empty_rounds=max_empty_rounds)
        elif not isinstance(plan, RunPlan):
            raise ValueError(f"plan must be a fed_dp.plan.RunPlan, got {type(plan).__name__}")
        else:
            given = [name for name, (value, default) in parts.items() if value is not default and value != default]
            if given:
                raise ValueError(f"give a plan or its parts, not both: {', '.join(given)} "
                                 f"{'is' if len(given) == 1 else 'are'} in the plan already")
        if plan.privacy.num_users is None:
            raise ValueError("PrivacyConfig.num_users must be set for a Flower run: the size N of the population "
                             "the nodes host (user indices 0..N-1); the sampler and the accounting need it")
        if not plan.optimizer.private and not in_simulation():
            raise ValueError("this optimizer is not private (a noiseless baseline); it exists only in simulations")
        check_int("min_nodes", min_nodes, minimum=1)
        self.plan = plan
        self.privacy, self.optimizer, self.adaptive_clipping = plan.privacy, plan.optimizer, plan.adaptive_clipping
        self.seed, self.training_seed, self.local = plan.seed, plan.training_seed, plan.local
        self.checkpoint_dir, self.eval_every, self.max_empty_rounds = (plan.checkpoint_dir, plan.eval_every,
                                                                       plan.max_empty_rounds)
        self.noise_source = plan.noise_source
        self.min_nodes, self.node_wait, self.on_round = min_nodes, node_wait, on_round
        if frozen is not None and not isinstance(frozen, (nn.Module, list)):
            raise ValueError(f"frozen must be the run's torch.nn.Module (or its protocol.frozen_fingerprint), got "
                             f"{type(frozen).__name__}")
        self.frozen = protocol.frozen_fingerprint(frozen) if isinstance(frozen, nn.Module) else list(frozen or [])
        if not isinstance(allow_unreported_model, bool):
            raise ValueError(f"allow_unreported_model must be True or False, got {allow_unreported_model!r}")
        self.allow_unreported_model = allow_unreported_model
        self.state: ServerState | None = None
        self.layout: ParamLayout | None = None
        self.membership: Membership | None = None
        self.reply_timeout = SERVER_DEFAULTS.reply_timeout
        self.slowest_full_round = 0.0  # seconds of the slowest exchange in which every asked node replied
        self._grid: Grid | None = None
        # the clients' seed for their local shuffles: independent of the sampler's and the noise's
        shared = plan.training_seed if plan.training_seed is not None else plan.seed
        self.client_seed = derive_seed(shared, "local-training") if shared is not None else entropy_seed()
        self._pending: _Pending | None = None
        self._driven: tuple[RoundPlan, Aggregate] | None = None  # set by start around its configure_train call

    @classmethod
    def from_run_config(cls, run: RunConfig, num_users: int, *, frozen: nn.Module | None = None,
                        environ: Mapping[str, str] | None = None) -> "UserLevelDP":
        """The strategy of a run configuration (``fed_dp.RunConfig``: ``[privacy]``, ``[optimizer]``, ``[adaptive]``,
        ``[local]``, ``[server]``, ``run.seed``, ``run.eval-every``) for a task of ``num_users`` users, as fed-dp's own
        ServerApp builds it: its plan (``fed_dp.plan.RunPlan.from_run_config``) and ``[server]``'s node settings;
        called on a subclass, an instance of that subclass.

        Seeds: ``run.seed`` reaches every ClientApp (it is in the run config), so it seeds only the clients' local
        training; the sampler and the noise take :func:`server_seed` of ``environ`` (default ``os.environ``):
        ``FED_DP_SERVER_SEED`` on the server's machine for a reproducible research run, else OS entropy.
        ``frozen``: the run's model, when it has frozen parameters (see the class)."""
        if not isinstance(run, RunConfig):
            raise ValueError(f"run must be a fed_dp.RunConfig (RunConfig.from_flat(context.run_config)), got "
                             f"{type(run).__name__}")
        privacy = run.privacy if run.privacy.num_users is not None else run.privacy.replace(num_users=num_users)
        if privacy.num_users != num_users:
            raise ValueError(f"privacy.num-users = {privacy.num_users} but the task has {num_users} users")
        plan = RunPlan.from_run_config(run, privacy=privacy, seed=server_seed(os.environ if environ is None else environ),
                                       training_seed=run.run.seed, checkpoint_dir=run.server.checkpoint_dir,
                                       flower_run=True)
        return cls(plan=plan, min_nodes=run.server.min_nodes, node_wait=run.server.node_wait, frozen=frozen,
                   allow_unreported_model=run.server.allow_unreported_model)

    # --- set-up ------------------------------------------------------------------------------------------------
    def _initialize(self, arrays: ArrayRecord) -> None:
        """Layout and θ_0 from the initial arrays, σ calibrated if asked, the fed_dp server state built."""
        named = arrays.to_torch_state_dict()
        bad = [k for k, v in named.items() if not v.dtype.is_floating_point]
        if bad:
            raise ValueError(f"initial arrays {bad} are not floating point: pass the model's named parameters "
                             "(fed_dp.model_arrays(model)), not its state_dict with integer buffers")
        self.layout = ParamLayout.from_state_dict(named)
        privacy = resolve_privacy(self.privacy)
        if privacy is not self.privacy and self.privacy.target_epsilon is not None:
            log.info("sigma = %.6f calibrated for user-level epsilon %g at delta %g (%s)", privacy.noise_multiplier,
                     self.privacy.target_epsilon, privacy.delta, privacy.accountant)
        self.state = init_server(privacy, self.optimizer, self.layout.flatten(named), seed=self.seed,
                                 adaptive_clipping=self.adaptive_clipping, noise_source=self.noise_source)

    def _ensure_users(self, grid: Grid, timeout: float) -> None:
        """Discover the nodes and their users once (``fed_dp.server.membership``)."""
        if self.membership is None:
            membership = Membership(self.state.config.num_users, query_timeout=timeout, model=self._fingerprint(),
                                    allow_unreported=self.allow_unreported_model)
            membership.start(grid, self.min_nodes, self.node_wait, probe=probe_size(grid))
            self.membership = membership

    def _fingerprint(self) -> list[str]:
        """The server's model as nodes report theirs (``protocol.model_fingerprint``): the trained parameters' names
        and shapes, in order, then the frozen ones with their digests."""
        return protocol.model_fingerprint({spec.name: spec.shape for spec in self.layout.specs}) + self.frozen

    def _await_nodes(self, grid: Grid, released: int) -> None:
        """Before a round (``released`` rounds so far): follow nodes that left or came back; wait up to
        ``node_wait`` s while fewer than ``min_nodes`` hosting nodes are connected, then stop with
        :class:`NotEnoughNodesError`."""
        self.membership.refresh(grid)
        if len(self.membership.connected()) >= self.min_nodes:
            return
        log.warning("only %d of the %d node(s) needed (server.min-nodes) are connected; waiting up to %.0f s "
                    "(server.node-wait) before the next round", len(self.membership.connected()), self.min_nodes,
                    self.node_wait)
        deadline = time.monotonic() + self.node_wait
        while time.monotonic() < deadline:
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            self.membership.refresh(grid)
            if len(self.membership.connected()) >= self.min_nodes:
                return
        down = sorted(node.name for node in self.membership.nodes.values() if node.node_id is None)
        raise NotEnoughNodesError(
            f"only {len(self.membership.connected())} node(s) hosting users stayed connected for {self.node_wait:.0f} s "
            f"(server.node-wait); {self.min_nodes} are needed (server.min-nodes). Nodes down: "
            f"{', '.join(repr(n) for n in down) or 'none of the known ones'}. No round was released for this wait "
            f"(rounds released so far: {released}). Restart the SuperNodes, then submit the run again "
            "with the same server.checkpoint-dir to resume")

    def _same_model(self, arrays: ArrayRecord, params: torch.Tensor) -> bool:
        """Whether ``arrays`` hold exactly the model ``params`` (both read through the same ArrayRecord path, so
        that a device or dtype of the server's state does not matter)."""
        def flat(record: ArrayRecord) -> torch.Tensor:
            return self.layout.flatten(dict(record.to_torch_state_dict()))

        try:
            return torch.equal(flat(arrays), flat(self.arrays(params)))
        except (ValueError, RuntimeError):  # other names or shapes
            return False

    def arrays(self, params: torch.Tensor) -> ArrayRecord:
        """A flat θ as the ArrayRecord of named tensors the nodes receive."""
        return ArrayRecord(torch_state_dict=OrderedDict((k, v.cpu()) for k, v in self.layout.unflatten(params).items()))

    # --- one round: messages out, replies in ---------------------------------------------------------------
    def _named(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        """The named tensors of ``arrays``, checked against the model's layout (names and shapes)."""
        try:
            return self.layout.unflatten(self.layout.flatten(dict(arrays.to_torch_state_dict())))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"configure_train got arrays that are not this run's model ({error}): pass the arrays "
                             "of the current global model (start passes them; after a round, the ones "
                             "aggregate_train returned)") from error

    def _messages(self, plan: RoundPlan, named: dict[str, torch.Tensor],
                  config: ConfigRecord | None) -> tuple[list[Message], dict[int, int], int]:
        """TRAIN messages to the nodes hosting sampled users; also users asked per node and unreachable users
        (sampled users whose node is down or who are on no node)."""
        by_node: dict[int, list[int]] = defaultdict(list)
        unreachable = 0
        for user in plan.cohort.tolist():
            node = self.membership.node_of(user)
            if node is not None:
                by_node[node].append(user)
            else:
                unreachable += 1
        messages = [protocol.train_message(plan, node, users, named, self.client_seed, dict(config or {}))
                    for node, users in sorted(by_node.items())]
        return messages, {node: len(users) for node, users in by_node.items()}, unreachable

    def _label(self, node_id: int) -> str:
        return f"node '{self.membership.name_of(node_id)}' (id {node_id})"

    def _replies(self, plan: RoundPlan, messages: list[Message], replies: Iterable[Message], asked: dict[int, int],
                 unreachable: int, seconds: float | None = None) -> RoundReplies:
        """Replies → contributions. Which nodes' users were not counted, why and how many, is operator-only
        information (``nonprivate``): a node is asked only when one of its users was sampled. A node that sent
        nothing is told apart as late (still connected: the warning says to raise server.reply-timeout) or gone.

        A reply belongs to the node its message went to (``protocol.replying_node``)."""
        sent_to = protocol.destinations(messages)
        contributions, answered = [], set()
        failures: list[tuple[str, int]] = [("sampled users on no connected node", unreachable)] if unreachable else []
        for reply in replies:
            node = protocol.replying_node(reply, sent_to)
            if node not in asked or node in answered:
                if reply.has_error() and not reply.metadata.reply_to_message_id:  # Flower's, for no message of ours
                    failures.append((f"SuperLink: error reply ({reply.error.code}) not tied to a node: "
                                     f"{protocol.last_line(reply.error.reason)}", 0))
                else:
                    failures.append((f"{self._label(node)}: an unexpected reply (not asked this round, or a second "
                                     "one)", 0))
                continue
            answered.add(node)
            try:
                contributions.append(protocol.parse_train_reply(reply, plan, asked[node], self.layout.size,
                                                                self.state.params.dtype))
            except protocol.ReplyError as error:
                failures.append((f"{self._label(node)}: {error}", asked[node]))
                continue
            failed = protocol.failed_users(reply)
            if failed:
                failures.append((f"{self._label(node)}: {failed} sampled user(s) failed to load or train and were sent "
                                 "as zero updates (that node's log says which and why)", 0))
        missing = sorted(set(asked) - answered)
        online = set(self._grid.get_node_ids()) if missing and self._grid is not None else set()
        for node in missing:
            if node in online:
                failures.append((f"{self._label(node)}: connected, but its reply missed the deadline "
                                 f"(server.reply-timeout = {self.reply_timeout:g} s). If it is slow rather than "
                                 "stuck, raise server.reply-timeout" + (
                                     f" (the slowest round in which every asked node replied took "
                                     f"{self.slowest_full_round:.1f} s)" if self.slowest_full_round else ""),
                                 asked[node]))
            else:
                failures.append((f"{self._label(node)}: no reply, and it is no longer connected", asked[node]))
        if seconds is not None and not missing:
            self.slowest_full_round = max(self.slowest_full_round, seconds)
        return RoundReplies(contributions, nonprivate={
            "dropped": [f"{what} ({users} sampled user(s) dropped)" if users else what for what, users in failures],
            "failures": sorted({what for what, _ in failures}),
            "dropped_users": sum(users for _, users in failures)})

    # --- Flower's Strategy interface ---------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Round ``server_round`` (1-based): one TRAIN message per node hosting users of the round's sample, with
        ``arrays`` and ``config``. Under :meth:`start` the round was begun (budget checked, users sampled) by the
        round loop; called directly, this refuses a round over the budget and samples its users."""
        if self.state is None:
            self._initialize(arrays)
        grid = retrying(grid)  # the SuperLink's transient errors are retried (fed_dp.server.messaging)
        self._grid = grid
        self._ensure_users(grid, timeout=self.reply_timeout)
        if server_round != self.state.round + 1:
            raise ValueError(f"configure_train for round {server_round}, but the server is at round {self.state.round + 1}")
        self._await_nodes(grid, self.state.round)  # the sample does not depend on this: nothing private is revealed
        plan, aggregate = self._driven if self._driven is not None else (begin_round(self.state), None)
        messages, asked, unreachable = self._messages(plan, self._named(arrays), config)
        self._pending = _Pending(plan, messages, asked, unreachable, aggregate)
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The core round on the replies (``fed_dp.round.finish_round``): validate them, re-clip to ζ per user,
        sum, add the Gaussian noise, divide by the fixed B, step the server optimizer, record ε in the ledger.
        Returns the new model and the round's public metrics (ε, δ, update norm, optimizer diagnostics)."""
        pending = self._pending
        if pending is None or pending.plan.round + 1 != server_round:
            raise ValueError(f"aggregate_train for round {server_round} without configure_train for it")
        self._pending = None
        received = self._replies(pending.plan, pending.messages, replies, pending.asked, pending.unreachable,
                                 pending.seconds)
        if pending.aggregate is not None:  # start: the round loop's own step, which it runs once
            self.state, metrics = pending.aggregate(received)
        else:
            self.state, metrics = finish_round(self.state, pending.plan, received.contributions)
            metrics.pop("nonprivate")  # counts computed from users' data: never in a Flower metric record
        return self.arrays(self.state.params), _numeric(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No federated evaluation: it would read users' data outside the privacy guarantee."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        config = self.state.config if self.state is not None else self.privacy
        sigma = f"{config.noise_multiplier:.4f}" if config.noise_multiplier else f"for target epsilon {config.target_epsilon}"
        log.info("UserLevelDP: N = %s, B = %d, T = %d, sigma %s, clip %g, sampler %s, noise %s, accountant %s, "
                 "optimizer %s; %s", config.num_users, config.expected_cohort, config.rounds, sigma, config.clip_norm,
                 config.sampler, config.noise, config.accountant, self.optimizer.describe(),
                 f"sampler and noise from the server's seed (reproducible research run), {self.noise_source} noise"
                 if self.seed is not None else f"seeds from OS entropy, {self.noise_source} noise")

    def _refuse_federated_evaluation(self, evaluate_config: ConfigRecord | None) -> None:
        """A ValueError when ``start`` is given an ``evaluate_config`` or a subclass overrides Flower's federated
        evaluation methods: UserLevelDP evaluates centrally only (``evaluate_fn``)."""
        overridden = [name for name in ("configure_evaluate", "aggregate_evaluate")
                      if getattr(type(self), name) is not getattr(UserLevelDP, name)]
        if evaluate_config or overridden:
            ignored = f": {type(self).__name__}'s {' and '.join(overridden)} would never run" if overridden else ""
            raise ValueError("UserLevelDP does not run federated evaluation (it would read users' data outside the "
                             f"privacy guarantee){ignored}; evaluate centrally with evaluate_fn")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float = SERVER_DEFAULTS.reply_timeout,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> DPResult:
        """Run the rounds (default: all T of the privacy plan) and return the final model and the privacy spent.

        Each round: ``configure_train`` → send and receive → ``aggregate_train`` → checkpoint → empty-round
        check → ``evaluate_fn``, in the one round loop (``fed_dp.round_loop.run_rounds``); overrides of the two
        methods take effect (module docstring). ``result.train_metrics_clientapp[t]`` is what ``aggregate_train``
        returned for round t.

        ``timeout``: seconds to wait for one round's replies. ``train_config`` reaches every node in the
        message's ``"config"`` record (the same record every round, as in Flower). ``evaluate_fn(round, arrays)``:
        centralized evaluation (Flower's convention), before the first round and every ``eval_every`` rounds.
        Raises
        ``fed_dp.server.membership.NoUsersError`` when no node hosts a user,
        ``fed_dp.server.membership.ModelMismatchError`` when a node reports another model than the initial
        arrays' (before round 1), ``fed_dp.server.membership.NotEnoughNodesError`` when fewer than ``min_nodes``
        stay connected and
        ``fed_dp.round_loop.NoRepliesError`` when replies stop and ``fed_dp.server.messaging.SuperLinkError``
        when the SuperLink keeps failing a request (its transient errors are retried first: ``grid`` is wrapped
        in a ``RetryingGrid``); all before more budget is spent, with the checkpoint resumable. Every failure's
        message ends with whether and how the run can be resumed (:func:`resume_advice`; an error whose message
        is not one string becomes a :class:`RunStopped` caused by it), since Flower shows a ServerApp's failure
        as that message.
        """
        self._refuse_federated_evaluation(evaluate_config)
        configure_logging()  # a ServerApp's output shows every round's ε, as Flower's strategies show theirs
        if self.state is None:
            self._initialize(initial_arrays)
        self.summary()
        grid = retrying(grid)  # the SuperLink's transient errors are retried (fed_dp.server.messaging)
        self._grid, self.reply_timeout = grid, timeout
        if self.checkpoint_dir is None and not in_simulation():
            log.warning("server.checkpoint-dir is not set: a crash cannot be resumed, and the operator's diagnostics "
                        "(which nodes failed or were late) are not kept")
        try:
            return self._start(grid, num_rounds, timeout, train_config, evaluate_fn)
        except FolderInUseError:  # another run owns the folder: its message says what to do
            raise
        except Exception as error:
            raise with_advice(error, resume_advice(self.checkpoint_dir, self.state.round if self.state else 0,
                                                   self.state.config.delta if self.state else self.privacy.delta,
                                                   self._epsilon_so_far()))

    def _epsilon_so_far(self) -> float | None:
        """ε spent by the rounds this strategy released (None before any)."""
        if self.state is None or self.state.ledger.rounds == 0 or self.state.config.non_private:
            return None
        return float(self.state.ledger.epsilon)

    def _start(self, grid: Grid, num_rounds: int | None, timeout: float, train_config: ConfigRecord | None,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None) -> DPResult:
        """The body of :meth:`start`, whose failures it annotates with whether and how to resume."""
        self._ensure_users(grid, timeout)
        result, aggregated = DPResult(), {}
        config = ConfigRecord() if train_config is None else train_config  # one record for all rounds, as Flower's

        def exchange(plan: RoundPlan, aggregate: Aggregate) -> RoundReplies:
            """configure_train → send and receive → aggregate_train, as Flower's Strategy.start; ``aggregate`` is
            the loop's core round, which the base aggregate_train runs (module docstring: what an override may
            change)."""
            server_round, core = plan.round + 1, _Recorded(aggregate)
            self._driven = (plan, core)
            try:
                messages = list(self.configure_train(server_round, self.arrays(plan.params), config, grid))
            finally:
                self._driven = None
            pending = self._pending
            if pending is None or pending.plan is not plan:
                raise RuntimeError(f"{type(self).__name__}.configure_train returned the messages of round "
                                   f"{server_round} without calling UserLevelDP.configure_train, which builds them "
                                   "for the users fed-dp's sampler drew: call super().configure_train(...) in the "
                                   "override and change its config or messages. No noise was drawn for this round")
            pending.messages, started = messages, time.perf_counter()
            replies = send_and_receive(grid, messages, timeout)
            pending.seconds = time.perf_counter() - started
            arrays, metrics = self.aggregate_train(server_round, replies)
            if core.replies is None:
                self._pending = None
                raise RuntimeError(f"{type(self).__name__}.aggregate_train returned round {server_round} without "
                                   "calling UserLevelDP.aggregate_train, which re-clips, noises and accounts the "
                                   "round: call super().aggregate_train(server_round, replies) in the override. "
                                   "No noise was drawn and nothing was saved for this round")
            if arrays is not None and not self._same_model(arrays, core.state.params):
                raise ValueError(f"{type(self).__name__}.aggregate_train returned arrays for round {server_round} "
                                 "that are not the noised aggregate UserLevelDP.aggregate_train computed: the model "
                                 "must stay the output of the private mechanism; return the arrays of "
                                 "super().aggregate_train (change the metrics only)")
            if metrics is not None:
                aggregated[server_round] = metrics
            return core.replies

        def evaluate(server_round: int, params: torch.Tensor) -> dict[str, float]:
            metrics = evaluate_fn(server_round, self.arrays(params))
            if metrics is not None:
                result.evaluate_metrics_serverapp[server_round] = metrics
            return {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}

        # recorded with the checkpoint; the seed the run config gives the clients, never the server's own seed
        clipper = self.state.clipper
        setup = describe_run(optimizer=self.optimizer, adaptive=None if clipper is None else clipper.config,
                             noise_source=self.noise_source, seed=self.training_seed, model=self._fingerprint(),
                             local=self.local) if self.checkpoint_dir else None
        loop = run_rounds(self.state, exchange, rounds=num_rounds, evaluate=evaluate if evaluate_fn else None,
                          eval_every=self.eval_every, checkpoint_dir=self.checkpoint_dir,
                          max_empty_rounds=self.max_empty_rounds, on_round=self.on_round, exchange_aggregates=True,
                          setup=setup)
        self.state = loop.state
        final = loop.records[-1] if loop.records else {}
        result.arrays = self.arrays(self.state.params)
        # rounds aggregated by this call: what aggregate_train returned (Flower's convention); resumed ones: their record
        result.train_metrics_clientapp = {**{int(r["round"]): _numeric(r) for r in loop.records if r["round"] > 0},
                                          **aggregated}
        result.epsilon = final.get("epsilon", 0.0)
        result.delta, result.privacy = self.state.config.delta, self.state.config
        result.records, result.stopped = loop.records, loop.stopped
        log.info("fed-dp finished: %d rounds, user-level epsilon %s at delta %g%s", self.state.round,
                 result.epsilon if isinstance(result.epsilon, str) else f"{result.epsilon:.4f}", result.delta,
                 f", eval accuracy {final['eval_accuracy']:.4f}" if "eval_accuracy" in final else "")
        return result
