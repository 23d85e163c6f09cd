"""The ``fed-dp`` command: the accounting commands of ``fed_dp.cli`` plus the simulation commands.

    fed-dp simulate [CONFIG | --config CONFIG] [--task MODULE:FACTORY] [--set table.key=value ...] [--out DIR] [--no-plot]
    fed-dp compare  [CONFIG] --optimizers a,b,c [--set ...] [--out DIR]
    fed-dp plot     DIR [DIR ...] [--out DIR]
    fed-dp audit    [CONFIG] [--task MODULE:FUNCTION] [--set ...] [--canaries 1000] [--json] [--out DIR] [--with-training]
                    [--canary-kind trained|injected]
    fed-dp new      FOLDER    (a Flower app using UserLevelDP, ready for `flwr run FOLDER`)
    fed-dp benchmark [--runs 3] [--only w1,scaling,noise,accounting,gpu,small-users] [--no-flower] [--out DIR] [--smoke]

Under ``torchrun`` (``torchrun --nproc_per_node 2 $(which fed-dp) simulate ...``) ``simulate`` and ``compare``
spread every round's cohort over the processes (``fed_dp.simulations.engine.distributed``); rank 0 reports and writes.

``fed-dp simulate`` with no arguments runs the built-in default, the main job (``configs/main-job.toml``):
DP-FedAvg, DP-SGDM, DP-Adam, DP-AdamBC and scale-then-privatize on 14,336 users of a heavy-tailed synthetic
task at user-level ε = 4.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from fed_dp import cli as accounting_cli


#: What a bad argument or config raises while a run is set up (before anything trains): the command prints its
#: message on one line and exits 2. Later, while training, only ValueError is reported so; anything else is a bug
#: and keeps its traceback.
SETUP_ERRORS = (ValueError, TypeError, OSError, ImportError, SyntaxError, KeyError)


def _out_dir(args: argparse.Namespace, config_name: str) -> Path:
    """The results folder: ``--out`` (which must not be an existing file), else results/<config>-<time>."""
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {args.out!r} is an existing file; name a folder (it is created if missing)")
        return out
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{Path(config_name).stem}-{stamp}"


def _setting_up(what: str, step: Callable[[], Any]) -> Any:
    """``step()``, with any of :data:`SETUP_ERRORS` turned into a ValueError saying ``what`` failed (the CLI prints
    it as one line and exits 2, no traceback)."""
    try:
        return step()
    except SETUP_ERRORS as error:
        if type(error) is ValueError:
            raise
        raise ValueError(f"{what}: {type(error).__name__}: {error}") from error


def _run_simulation(args: argparse.Namespace) -> None:
    from fed_dp.simulations.experiments.config_files import DEFAULT_CONFIG

    # A task of the user's own starts from the run configuration's defaults unless a config is named too: the
    # built-in default config is for its own task. Its names are checked before torch loads (_simulation_config).
    config = _setting_up("reading the config", lambda: _simulation_config(args))
    out = _out_dir(args, args.config or (args.task.rpartition(":")[2] if args.task else DEFAULT_CONFIG))
    if not args.quiet and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
        print(_starting_line(args, config), flush=True)  # before PyTorch loads: seconds on a cold machine

    from fed_dp.atomic import reporting_writes
    from fed_dp.clients.task import build_task
    from fed_dp.round_loop import TrainingStopped
    from fed_dp.simulations.experiments.plots import plot_all
    from fed_dp.simulations.experiments.runner import format_table, parse_experiment, read_results, run_experiment

    experiment = _setting_up("checking the config", lambda: parse_experiment(config))
    task = _setting_up("building the task", lambda: build_task(experiment.base.task))
    workers = _join_torchrun(experiment.base.client.device)
    leader = workers is None or workers.leader  # under torchrun only rank 0 reports and writes
    try:
        quiet = args.quiet or not leader
        rows = run_experiment(config, out, progress=not quiet, log=print if not quiet else (lambda *_: None),
                              write=leader, task=task)
    except TrainingStopped as stop:  # a user's data or the task failed: say so, and where the model so far is
        if leader:
            print(_stopped_line(args.command, stop, out), file=sys.stderr)
        sys.exit(1)
    finally:
        if workers is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    if leader:
        print()
        print(format_table(rows))
        print(f"\nresults: {out}/ (config.json, summary.json, rounds-<optimizer>.jsonl)")
        if not args.no_plot:
            with reporting_writes(f"the figures are incomplete; the results are written: draw them again with "
                                  f"fed-dp plot {out} once the cause is fixed", out):
                figures = plot_all(read_results(out), out)
            print("figures: " + ", ".join(str(f) for f in figures))
    if workers is not None:
        from fed_dp.simulations.engine.distributed import leave_torchrun

        leave_torchrun()


def _starting_line(args: argparse.Namespace, config: dict) -> str:
    """The first line a run prints, from the config alone (nothing heavy loaded yet): what runs, and what comes next."""
    from fed_dp.run_config import DEFAULTS

    names = (config.get("run") or {}).get("optimizers") or [(config.get("optimizer") or {}).get(
        "name", DEFAULTS["optimizer.name"])]
    rounds = (config.get("privacy") or {}).get("rounds", DEFAULTS["privacy.rounds"])
    what = args.config or (f"task {args.task}" if args.task else "the main job (simulations/configs/main-job.toml)")
    return (f"fed-dp {args.command}: {what}: {', '.join(map(str, names))}, {rounds} rounds each. Loading PyTorch and "
            "building the task ...")


def _stopped_line(command: str, stop: Any, out: Path) -> str:
    """One line for a run that a user's failure stopped (``fed_dp.round_loop.TrainingStopped``): the round and the
    user, what was released, and where the model after the last released round and the records are."""
    where = [f"{stop.saved} (its state_dict)"] if getattr(stop, "saved", None) else []
    if stop.checkpoint_dir is not None:
        where.append(f"the checkpoint folder {stop.checkpoint_dir} (run again with it to resume)")
    spent = stop.records[-1]["epsilon"] if stop.records else 0
    return (f"fed-dp {command}: stopped: {' '.join(str(stop.failure).split())}. Nothing of round "
            f"{stop.failure.round_number} was released; {stop.state.round} round(s) were released before it (epsilon so far "
            f"{spent if isinstance(spent, str) else f'{spent:.4f}'}). The model after round {stop.state.round}: "
            f"{' and '.join(where) or 'not saved'}; the records so far: {out}/rounds-<optimizer>.jsonl")


def _join_torchrun(device: str):
    """Under ``torchrun``, this process's place in a new process group (``fed_dp.simulations.engine.distributed``) on
    ``device`` (``client.device`` of the config): every rank trains a share of each cohort, rank 0 runs the round
    loop. None when run as one process."""
    from fed_dp.clients.training import resolve_device
    from fed_dp.simulations.engine.distributed import join_from_environment

    return join_from_environment(resolve_device(device))


def _simulation_config(args: argparse.Namespace) -> dict:
    """The config of ``simulate``/``compare``/``audit``: a named or built-in config, or with ``--task`` the run
    configuration's defaults and the user's task (importable from the current folder); then ``--set`` (and
    ``compare``'s ``--optimizers``). Its names are checked here, without loading torch: a mistyped key is reported
    at once (``fed_dp.simulations.experiments.config_files.check_config_names``)."""
    from fed_dp.run_config import apply_overrides
    from fed_dp.simulations.experiments.config_files import check_config_names, load_config

    if args.config_option:
        if args.config and args.config != args.config_option:
            raise ValueError(f"two configs given: {args.config!r} and --config {args.config_option!r}; give one")
        args.config = args.config_option
    config = load_config(args.config) if args.config or not args.task else {}
    if args.task:
        sys.path.insert(0, str(Path.cwd()))
        config["task"] = {"ref": args.task}
    config = apply_overrides(config, args.set or [])
    if getattr(args, "optimizers", None):
        config.setdefault("run", {})["optimizers"] = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    check_config_names(config)
    return config


def _run_audit(args: argparse.Namespace) -> None:
    import json

    from fed_dp.simulations.audit import audit_config, format_audit, plot_audit

    if args.with_training and args.mechanism_only:
        raise ValueError("--with-training and --mechanism-only exclude each other; give one (the default: mechanism only)")
    config = _setting_up("reading the config", lambda: _simulation_config(args))
    try:
        result = audit_config(config, canaries=args.canaries, confidence=args.confidence, optimizer=args.optimizer,
                              mechanism_only=not args.with_training, noise_scale=args.noise_scale,
                              canary_kind=args.canary_kind)
    except FileNotFoundError as error:  # a task's data missing: say where to put it, as `fed-dp simulate` does
        raise ValueError(f"building the task: {type(error).__name__}: {error}") from error
    rows = [row for row in result.rows() if args.threat_model in ("both", row["threat_model"])]
    result.results = {row["threat_model"]: result.results[row["threat_model"]] for row in rows}
    result.scores = {name: result.scores[name] for name in result.results}
    if args.json:
        for row in rows:
            print(json.dumps(row, allow_nan=False))
    else:
        print(format_audit(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "audit.json").write_text(json.dumps(rows, indent=2, allow_nan=False))
        figure = None if args.no_plot else plot_audit(result, out / "audit.png")
        if not args.json:
            print(f"\nresults: {out / 'audit.json'}" + (f", figure: {figure}" if figure else ""))


def _run_plot(args: argparse.Namespace) -> None:
    from fed_dp.simulations.experiments.plots import plot_all
    from fed_dp.simulations.experiments.runner import read_results

    results = {}
    for folder in args.folders:
        for name, records in read_results(folder).items():
            key = name if len(args.folders) == 1 else f"{Path(folder).name}/{name}"
            results[key] = records
    out = Path(args.out) if args.out else Path(args.folders[0])
    for figure in plot_all(results, out):
        print(figure)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="a TOML config file, or the name of a built-in config in simulations/configs "
                        "(default: main-job; with --task: the run configuration's defaults)")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG",
                        help="the same as the positional CONFIG (a TOML file or a built-in config name)")
    parser.add_argument("--task", metavar="MODULE:FACTORY",
                        help="train your own task: a function returning a fed_dp.Task, e.g. my_task:make_task "
                        "(importable from the current folder); replaces the config's [task] table, whose keys "
                        "--set task.KEY=VALUE then passes to the function")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override one config value, e.g. --set privacy.rounds=50 (repeatable)")
    parser.add_argument("--out", metavar="DIR", help="results folder (default: results/<config>-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not write PNG figures")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or logs, only the table")


def build_parser() -> argparse.ArgumentParser:
    """The ``fed-dp`` parser: the accounting commands of ``fed_dp.cli``, then the simulation commands."""
    return accounting_cli.build_parser(_add_commands)


def _add_commands(commands: Any) -> None:
    """The commands of this layer, in the order ``fed-dp --help`` lists them (``commands``: what
    ``ArgumentParser.add_subparsers`` returned)."""
    _add_simulate(commands)
    _add_compare(commands)
    _add_plot(commands)
    _add_audit(commands)
    _add_submit(commands)
    _add_node_service(commands)
    _add_new(commands)
    _add_benchmark(commands)


def _add_simulate(commands: Any) -> None:
    """``fed-dp simulate``."""
    simulate = commands.add_parser(
        "simulate", help="run a simulation (default: the built-in main job)",
        description="Train the optimizers of a config on a task partitioned by user, with user-level DP, "
        "and print a table with the user-level epsilon of each run.",
    )
    _add_run_arguments(simulate)
    simulate.set_defaults(run=_run_simulation)


def _add_compare(commands: Any) -> None:
    """``fed-dp compare``."""
    compare = commands.add_parser(
        "compare", help="compare several optimizers on one config with the same seeds",
        description="Run several optimizers on one config with the same seeds and print a table.",
    )
    _add_run_arguments(compare)
    compare.add_argument("--optimizers", required=True, metavar="A,B,C",
                         help="comma-separated optimizer names (fed_dp.optimizers.OPTIMIZERS)")
    compare.set_defaults(run=_run_simulation)


def _add_plot(commands: Any) -> None:
    """``fed-dp plot``."""
    plot = commands.add_parser("plot", help="write PNG figures of results folders",
                               description="Write metrics, per-group and second-moment figures as PNG.")
    plot.add_argument("folders", nargs="+", metavar="DIR", help="results folders written by simulate/compare")
    plot.add_argument("--out", metavar="DIR", help="where to write the figures (default: the first folder)")
    plot.set_defaults(run=_run_plot)


def _add_audit(commands: Any) -> None:
    """``fed-dp audit``."""
    audit = commands.add_parser(
        "audit", help="empirical privacy of a config: one run with canary users, a test of the mechanism against "
        "its accounting, an epsilon estimate and a lower bound",
        description="Run the config's mechanism once with canary users (orthonormal random directions, each "
        "inserted with probability 1/2; by default users trained and clipped by the run's own client code, their "
        "updates far above the clip norm; the real users send zero updates unless --with-training) and report, for "
        "the final-model and all-iterates threat models, the accounted epsilon, an epsilon estimate (Gaussian "
        "fit), a lower bound (Steinke, Nasr & Jagielski 2023) with its cap and verdict; a one-sided test of the "
        "canaries' separation on the noisy sums against its law under the accounted noise (p-value, power, "
        "verdict) and a test of the largest canary coefficient in any one round (a canary released unclipped); all "
        "verdicts corrected together (Bonferroni) to hold at --confidence.",
    )
    _add_run_arguments(audit)
    audit.add_argument("--canaries", type=int, default=1000, metavar="M",
                       help="canary candidates (default 1000; injected canaries need a model of at least 2M "
                       "parameters)")
    audit.add_argument("--optimizer", metavar="NAME", help="the optimizer to audit (default: the config's first)")
    audit.add_argument("--confidence", type=float, default=0.95,
                       help="confidence of all verdicts together: lower bounds and tests, Bonferroni-corrected "
                       "(default 0.95)")
    audit.add_argument("--threat-model", choices=("final-model", "all-iterates", "both"), default="both")
    audit.add_argument("--with-training", action="store_true",
                       help="the real users train too (their updates are 0 on trained canaries' coordinates, so the "
                       "tests still run; with injected canaries lower bound and estimate only)")
    audit.add_argument("--canary-kind", choices=("trained", "injected"), default="trained",
                       help="trained: canaries are users trained and clipped by the clients, updates far above the "
                       "clip norm, so a skipped clip is flagged (default); injected: updates of norm zeta added "
                       "after the clients in the model's own parameters (no client clip; needs 2M parameters)")
    audit.add_argument("--mechanism-only", action="store_true",
                       help="real users send zero updates: the mechanism without the training's drift (the default)")
    audit.add_argument("--noise-scale", type=float, default=1.0, metavar="S",
                       help="SELF-TEST: add S times the accounted noise while accounting for the full noise, a "
                       "deliberately broken mechanism that the audit must flag (0.25: four times too little "
                       "noise); never for training (default 1)")
    audit.add_argument("--json", action="store_true", help="one JSON object per threat model, one per line")
    audit.set_defaults(run=_run_audit)


def _add_submit(commands: Any) -> None:
    """``fed-dp submit``."""
    submit = commands.add_parser(
        "submit", help="submit a Flower run to a SuperLink and exit 1 unless it completed",
        description="Run `flwr run APP FEDERATION --stream` (the log is printed as it comes), then read the run's "
        "status with `flwr ls`: exit 0 when it is finished:completed, 1 when it failed, was stopped or cannot be "
        "read, with what to do (flwr run itself exits 0 even when the ServerApp failed).",
    )
    submit.add_argument("federation", nargs="?", default=None,
                        help="the SuperLink connection in the flwr CLI's config (default: its default)")
    submit.add_argument("--app", default=".", help="the Flower app folder (default: the current folder)")
    submit.add_argument("--run-config", metavar='"KEY=VALUE ..."', help="run-config overrides, as for flwr run")
    submit.set_defaults(run=_run_submit)


def _add_node_service(commands: Any) -> None:
    """``fed-dp node-service``."""
    service = commands.add_parser(
        "node-service", help="keep a SuperNode's task, data and model loaded across messages (Unix socket)",
        description="Serve the project's ClientApp handlers on a Unix socket (mode 0600) until SIGTERM, so that a "
        "SuperNode whose node config has node-service='PATH' does not import torch and rebuild its task for every "
        "message (flwr starts a process per message). Start it beside the SuperNode, as the same user "
        "(see fed_dp.clients.node_service).",
    )
    service.add_argument("--socket", required=True, metavar="PATH", help="the socket file to create")
    service.set_defaults(run=_run_node_service)


def _add_new(commands: Any) -> None:
    """``fed-dp new``."""
    new = commands.add_parser(
        "new", help="write a Flower app that trains with UserLevelDP, ready for `flwr run FOLDER`",
        description="Write a runnable Flower app into FOLDER (which must not exist or be empty; its name is the "
        "app's): pyproject.toml with every fed-dp run-config key, a ServerApp running UserLevelDP, fed-dp's "
        "ClientApp and a small task.py (model, users' data, loss, evaluation) to edit. Then: flwr run FOLDER --stream",
    )
    new.add_argument("folder", metavar="FOLDER", help="the app's folder, e.g. my-app")
    new.add_argument("--model", choices=("torch", "hf"), default="torch",
                     help="task.py's model: a small torch model (default), or hf: a Hugging Face GPT-2 fine-tuned "
                          "with a LoRA adapter (needs transformers and peft: pip install -e \".[hf]\")")
    new.set_defaults(run=_run_new)


def _add_benchmark(commands: Any) -> None:
    """``fed-dp benchmark``."""
    benchmark = commands.add_parser(
        "benchmark", help="measure W1 against Flower's DP simulation, cohort scaling, noise and accounting costs",
        description="Run the benchmark workloads (docs/explanation/benchmarks.md) side by side in one invocation and print medians, "
        "min-max and ratios (see simulations/benchmark/command.py).",
    )
    _benchmark_arguments(benchmark)
    benchmark.set_defaults(run=_run_benchmark)


def _run_new(args: argparse.Namespace) -> None:
    from fed_dp.simulations.new_app import write_app

    folder = write_app(args.folder, args.model)
    print(f"wrote a Flower app using fed-dp to {folder}/ (pyproject.toml, server_app.py, client_app.py, task.py, "
          f"README.md); run it with: flwr run {folder} --stream")


def _run_submit(args: argparse.Namespace) -> int:
    from fed_dp.simulations.launch.submit import main as submit

    return submit(args.app, args.federation, args.run_config)


def _run_node_service(args: argparse.Namespace) -> int:
    import logging

    from fed_dp.clients.node_service import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args.socket)
    return 0


def _benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    from fed_dp.simulations.benchmark.arguments import build_parser as benchmark_parser

    benchmark_parser(parser)


def _run_benchmark(args: argparse.Namespace) -> None:
    from fed_dp.simulations.benchmark.command import run

    run(args)


def main(argv: Sequence[str] | None = None) -> int:
    return accounting_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
