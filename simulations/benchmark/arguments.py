"""The command line of ``fed-dp benchmark``: its sections and options, read without importing any section (so that
``fed-dp --help`` and a mistyped option answer at once, before torch or Flower load). ``command.py`` runs them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from fed_dp.validation import check_int, check_positive

#: The sections, in the order they run (docstring of ``fed_dp.simulations.benchmark.command``).
SECTIONS = ("w1", "scaling", "noise", "secure-noise", "accounting", "gpu", "deployment", "small-users", "paths",
            "finetune")
#: The engine's training paths (``LocalTrainer``'s ``training``) in the small-users section: its own choice, or one
#: forced.
TRAINING = ("auto", "sequential", "vectorized")
#: Where the small-users section's engine and direct implementation run.
DEVICES = ("cpu", "cuda")


def _count_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return check_int("the number of rounds", int(text), minimum=minimum)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{error}: {text!r}") from None

    return parse


def _seconds_cap(text: str) -> float:
    try:
        return check_positive("the wall-time cap in seconds", float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _small_users_arguments(parser: argparse.ArgumentParser) -> None:
    """The small-users section's options (checked when the command line is read)."""
    parser.add_argument("--small-users-rounds", type=_count_at_least(1), default=5, metavar="R",
                        help="small-users: rounds of workloads A (heavy-tail G = 6, L = 256) and C (StackOverflow-"
                             "shaped) (default 5)")
    parser.add_argument("--small-users-paper-rounds", type=_count_at_least(0), default=1, metavar="R",
                        help="small-users: rounds of workload B, seed 003's size G = 8, L = 1,024 (seconds per round on "
                             "the one-step path, minutes on the sequential one; default 1; 0 skips it)")
    parser.add_argument("--small-users-max-seconds", type=_seconds_cap, default=None, metavar="S",
                        help="small-users: end a workload after the round that passes S seconds (at least one "
                             "round runs; default: no cap)")
    parser.add_argument("--small-users-training", choices=TRAINING, default="auto",
                        help="small-users: the engine's training path (default auto: the engine's own choice; "
                             "sequential or vectorized force one, to compare)")
    parser.add_argument("--small-users-device", choices=DEVICES, default="cpu",
                        help="small-users: where the engine and the direct implementation run (default cpu; "
                             "cuda: on the GPU, timed with the device synchronized)")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``fed-dp benchmark``'s options, added to ``parser`` (a new one when None)."""
    parser = parser or argparse.ArgumentParser(prog="fed-dp benchmark")
    parser.add_argument("--runs", type=int, default=3, help="runs of every W1 system and scaling point (default 3)")
    parser.add_argument("--only", default=",".join(SECTIONS), metavar="A,B",
                        help=f"sections to run, from {','.join(SECTIONS)} (default: all; gpu only with CUDA)")
    parser.add_argument("--no-flower", action="store_true", help="skip the Flower systems of W1 (no Ray, no flwr run)")
    parser.add_argument("--out", metavar="DIR", help="where to save benchmark.json and benchmark.png "
                        "(default: results/benchmark-<time>)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one run: checks that every section works (seconds, not a measurement)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one Flower run (default 600)")
    _small_users_arguments(parser)
    parser.add_argument("--paths-rounds", type=int, default=4, metavar="R",
                        help="paths: rounds per workload and path, the first left out as warm-up (default 4)")
    parser.add_argument("--finetune-rounds", type=_count_at_least(2), default=4, metavar="R",
                        help="finetune: rounds of each private and non-private run (two of each, alternating), the "
                             "first of every run left out as warm-up (default 4)")
    return parser
