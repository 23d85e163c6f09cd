"""The ``fed-dp`` command: user-level ε of a planned run, and σ for a target ε.

    fed-dp epsilon   --num-users N --expected-cohort B --rounds T --noise-multiplier S --delta D [...]
    fed-dp epsilon   ... --per-round [--json]      # ε after every round 1 … T (the ledger's schedule)
    fed-dp calibrate --epsilon E --num-users N --expected-cohort B --rounds T --delta D [...]

Both build one PrivacyConfig, the same object that drives the sampler and the noise of a training run,
and ask dp_accounting (``fed_dp.accounting``) for the answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from fed_dp.atomic import WriteError
from fed_dp.config import ACCOUNTANTS, NOISES, SAMPLERS, WORKLOADS, PrivacyConfig
from fed_dp.schema import keys_of

# The accounting (torch, dp_accounting) is imported by the commands that use it, so that ``fed-dp --help`` and a
# mistyped argument answer at once.

#: The privacy table's defaults, read from the schema as the run configuration's are.
PRIVACY_DEFAULTS = {key.dotted: key.default for key in keys_of("privacy", PrivacyConfig)}

_SAMPLER_HELP = (
    "user sampler: poisson (each user with q = B/N; default), without-replacement (exactly B of N; "
    "needs --accountant rdp), all (every user every round; B = N), cyclic-poisson (users hashed into "
    "--bands groups, one group per round at q = B*b/N), min-sep (fixed groups of B users in turn)"
)


def _add_mechanism_arguments(parser: argparse.ArgumentParser, *, with_noise_multiplier: bool) -> None:
    group = parser.add_argument_group("mechanism")
    group.add_argument("--num-users", type=int, required=True, metavar="N", help="users in the population")
    group.add_argument(
        "--expected-cohort", type=int, required=True, metavar="B",
        help="expected users per round (the fixed denominator)",
    )
    group.add_argument("--rounds", type=int, required=True, metavar="T", help="server rounds")
    if with_noise_multiplier:
        group.add_argument(
            "--noise-multiplier", type=float, required=True, metavar="S",
            help="sigma: noise std on the sum of clipped updates divided by the clip norm",
        )
    group.add_argument("--delta", type=float, required=True, metavar="D", help="delta of (epsilon, delta), below 1/N")
    group.add_argument("--allow-large-delta", action="store_true",
                       help="accept a delta of at least 1/N (refused otherwise: it lets a mechanism publish a whole "
                       "user's data)")
    group.add_argument("--sampler", choices=SAMPLERS, default=PRIVACY_DEFAULTS["privacy.sampler"], help=_SAMPLER_HELP)
    group.add_argument(
        "--noise", choices=NOISES, default=PRIVACY_DEFAULTS["privacy.noise"],
        help="independent Gaussian (default), bandmf (banded matrix factorization) or blt (buffered linear "
        "Toeplitz; needs --buffers); the correlated ones need --sampler cyclic-poisson or min-sep",
    )
    group.add_argument(
        "--bands", type=int, default=PRIVACY_DEFAULTS["privacy.bands"], metavar="b",
        help="bands of the BandMF strategy = groups of cyclic-poisson = required min-separation (default 1)",
    )
    group.add_argument(
        "--buffers", type=int, default=None, metavar="l",
        help="buffers of the BLT strategy (--noise blt; its sensitivity, hence epsilon, depends on them)",
    )
    group.add_argument(
        "--workload", choices=WORKLOADS, default=PRIVACY_DEFAULTS["privacy.workload"],
        help="workload the BLT is optimized for (prefix-sum, or momentum with --momentum); BLT only changes epsilon",
    )
    group.add_argument("--momentum", type=float, default=PRIVACY_DEFAULTS["privacy.momentum"], metavar="mu",
                       help="momentum of the momentum workload")
    group.add_argument(
        "--max-participations", type=int, default=None, metavar="k",
        help="min-sep only: participations per user to account for (default: ceil(T / (N // B)))",
    )
    group.add_argument("--accountant", choices=ACCOUNTANTS, default=PRIVACY_DEFAULTS["privacy.accountant"],
                       help="pld (default, tighter) or rdp")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _config(args: argparse.Namespace, noise_multiplier: float) -> PrivacyConfig:
    return PrivacyConfig(
        num_users=args.num_users,
        expected_cohort=args.expected_cohort,
        rounds=args.rounds,
        noise_multiplier=noise_multiplier,
        delta=args.delta,
        allow_large_delta=args.allow_large_delta,
        sampler=args.sampler,
        noise=args.noise,
        bands=args.bands,
        buffers=args.buffers,
        max_participations=args.max_participations,
        accountant=args.accountant,
        workload=args.workload,
        momentum=args.momentum,
    )


def _blt_sensitivity(config: PrivacyConfig) -> float | None:
    """sens_T of the config's BLT (its event is Gaussian(σ/sens_T)); None for the other noises."""
    from fed_dp.blt import config_sensitivity_squared

    return math.sqrt(config_sensitivity_squared(config)[-1]) if config.noise == "blt" else None


def _summary(config: PrivacyConfig) -> dict[str, Any]:
    from fed_dp.sampling import dp_event, guarantee, neighboring_relation

    return {
        "accountant": config.accountant,
        "sampler": config.sampler,
        "noise": config.noise,
        "noise_multiplier": config.noise_multiplier,
        "num_users": config.num_users,
        "expected_cohort": config.expected_cohort,
        "rounds": config.rounds,
        "bands": config.bands,
        "buffers": config.buffers,
        "sampling_rate": config.sampling_rate,
        "max_participations": config.participations(),
        "neighboring_relation": neighboring_relation(config).name.lower(),
        "guarantee": guarantee(config),
        "blt_sensitivity": _blt_sensitivity(config),
        "dp_event": repr(dp_event(config)),
    }


def _print_text(config: PrivacyConfig, headline: str) -> None:
    from fed_dp.sampling import guarantee

    print(headline)
    print(f"  sampler     {config.sampler}, rate {config.sampling_rate:.6g}, "
          f"adjacency: {guarantee(config)}")
    shape = f"buffers {config.buffers}" if config.noise == "blt" else f"bands {config.bands}"
    print(f"  noise       {config.noise} ({shape}), sigma = {config.noise_multiplier:.6g}")
    print(f"  population  N = {config.num_users}, expected cohort B = {config.expected_cohort}, "
          f"rounds T = {config.rounds}, participations per user <= {config.participations()}")
    if config.noise == "blt":
        print(f"  strategy    BLT optimized for min-separation {config.min_separation}: sensitivity of "
              f"{math.ceil(config.rounds / config.min_separation)} participations {_blt_sensitivity(config):.4f} "
              f"(BandMF's would be sqrt(k) = {math.sqrt(math.ceil(config.rounds / config.min_separation)):.4f})")
    print(f"  accountant  {config.accountant} (dp_accounting)")


def _schedule_note(exact_rounds: Sequence[int], rounds: int) -> str:
    if len(exact_rounds) == rounds:
        return "exact at every round"
    return (f"exact at {len(exact_rounds)} of {rounds} rounds; in between, the next exact round's value "
            "(an upper bound)")


#: Long accounting prints a line on stderr at most this often (seconds), the first one after this long.
PROGRESS_SECONDS = 10.0


class _Progress:
    """``progress(t, T)`` for ``compute_epsilon_schedule``: a plain line on stderr (readable in a log file or a
    pipe, no carriage returns) at most every PROGRESS_SECONDS. RDP costs the same per round, so its line has the
    share done and a linear estimate of the time left; PLD computes its exact rounds (about 10 + 4.5·log10(T/10)
    of them), each costlier than the one before, so its line has the round reached and the time so far."""

    def __init__(self, accountant: str) -> None:
        self.accountant = accountant
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS or done <= 0:
            return
        self.last = now
        elapsed = now - self.start
        if self.accountant == "rdp":
            state = f"({done / total:.0%}), {elapsed:.0f} s so far, about {elapsed * (total - done) / done:.0f} s left"
        else:
            state = f"(the exact rounds get costlier as they grow), {elapsed:.0f} s so far"
        print(f"fed-dp epsilon: {self.accountant} accounted {done:,} of {total:,} rounds {state}",
              file=sys.stderr, flush=True)


def _warn_unamplified_blt(command: str, config: PrivacyConfig) -> None:
    """On stderr, before the answer: what fits better than BLT planned for min-separation 1 (one line)."""
    from fed_dp.accounting import unamplified_blt_advice

    advice = unamplified_blt_advice(config)
    if advice is not None:
        print(f"fed-dp {command}: warning: {advice}", file=sys.stderr, flush=True)


def _run_epsilon(args: argparse.Namespace) -> None:
    from fed_dp.accounting import accounting_note, checked_epsilon, compute_epsilon_schedule

    if args.noise_multiplier == 0:
        raise ValueError("noise_multiplier (--noise-multiplier) = 0 adds no noise: its ε is infinite and there is "
                         "nothing to account. Give the σ of a private run (σ = 0 is for a non-private baseline in "
                         "fed-dp simulate)")
    config = _config(args, args.noise_multiplier)
    _warn_unamplified_blt("epsilon", config)
    note = accounting_note(config.rounds, config.accountant)
    if note is not None:
        print(f"fed-dp epsilon: {note}" + (" (progress on stderr)" if args.per_round else ""), file=sys.stderr,
              flush=True)
    if args.per_round:
        schedule = compute_epsilon_schedule(config, progress=_Progress(config.accountant))
        if args.json:
            print(json.dumps({"epsilon": list(schedule.epsilons), "exact_rounds": list(schedule.exact_rounds),
                              "delta": config.delta, **_summary(config)}))
            return
        _print_text(config, f"user-level epsilon = {schedule.epsilons[-1]:.4f} at delta = {config.delta:g} "
                            f"after {config.rounds} rounds")
        print(f"  per round   {_schedule_note(schedule.exact_rounds, config.rounds)}")
        exact = set(schedule.exact_rounds)
        for t, eps in enumerate(schedule.epsilons, start=1):
            print(f"{t:>8}  {eps:.4f}{'' if t in exact else '  (upper bound)'}")
        return
    eps = checked_epsilon(config)
    if args.json:
        print(json.dumps({"epsilon": eps, "delta": config.delta, **_summary(config)}))
        return
    _print_text(config, f"user-level epsilon = {eps:.4f} at delta = {config.delta:g}")


def _run_calibrate(args: argparse.Namespace) -> None:
    from fed_dp.accounting import calibrate_noise_multiplier, epsilon

    config = _config(args, 1.0)
    _warn_unamplified_blt("calibrate", config.replace(noise_multiplier=None, target_epsilon=args.epsilon))
    sigma = calibrate_noise_multiplier(config, args.epsilon)
    calibrated = config.replace(noise_multiplier=sigma)
    achieved = epsilon(calibrated)
    if args.json:
        print(json.dumps({
            "noise_multiplier": sigma, "target_epsilon": args.epsilon, "epsilon": achieved,
            "delta": config.delta, **_summary(calibrated),
        }))
        return
    _print_text(
        calibrated,
        f"noise multiplier sigma = {sigma:.6f} gives user-level epsilon = {achieved:.4f} "
        f"<= {args.epsilon:g} at delta = {config.delta:g}",
    )


def build_parser(more_commands: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """The ``fed-dp`` parser with the accounting commands; ``more_commands(commands)`` adds further commands after
    them (the installed ``fed-dp``: ``fed_dp.simulations.cli``), where ``commands`` is the object that
    ``ArgumentParser.add_subparsers`` returned (its ``add_parser`` adds one command)."""
    parser = argparse.ArgumentParser(
        prog="fed-dp",
        description="User-level differentially private federated training: accounting tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    eps = commands.add_parser(
        "epsilon", help="user-level epsilon of a planned run",
        description="Print the user-level epsilon of a planned run (dp_accounting).",
    )
    _add_mechanism_arguments(eps, with_noise_multiplier=True)
    eps.add_argument("--per-round", action="store_true",
                     help="epsilon after every round 1..T (with --json: a list under \"epsilon\")")
    eps.set_defaults(run=_run_epsilon)
    cal = commands.add_parser(
        "calibrate", help="noise multiplier for a target epsilon",
        description="Print the smallest noise multiplier whose user-level epsilon is at most --epsilon.",
    )
    cal.add_argument("--epsilon", type=float, required=True, metavar="E", help="target user-level epsilon")
    _add_mechanism_arguments(cal, with_noise_multiplier=False)
    cal.set_defaults(run=_run_calibrate)
    if more_commands is not None:
        more_commands(commands)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; a ValueError becomes exit status 2 with its message on one line
    (no traceback: it is a bad argument or config, and the message says what to do), a failed write
    (``fed_dp.atomic.WriteError``: a full disk) exit status 1 with its message on one line. A command that returns
    an integer exits with it (``fed-dp submit``: 1 when the run failed)."""
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
    except ValueError as error:
        parser.exit(2, f"fed-dp {args.command}: error: {' '.join(str(error).split())}\n")
    except WriteError as error:  # a full disk, a folder made read-only: the message says what became of the run
        parser.exit(1, f"fed-dp {args.command}: error: {' '.join(str(error).split())}\n")
    return code if isinstance(code, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The accounting commands alone (the installed ``fed-dp`` adds the simulation commands)."""
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
