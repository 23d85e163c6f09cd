"""Reading the README's and the docs' examples for the tests, and comparing printed output with a tolerance.

The tolerance (used by tests/test_docs.py for every `$ fed-dp ...` example): the expected and the actual text
are split into numbers and the text between them; the text must be equal, and each number must agree within a
relative 1e-3 or an absolute 1e-6, so that a floating-point drift in the last printed digit (1e-6 on ε or σ)
does not fail the documentation, while a different number does.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

REL_TOL, ABS_TOL = 1e-3, 1e-6
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def blocks(text: str, language: str) -> list[str]:
    """The contents of the fenced code blocks of one language (``""`` for unlabelled blocks)."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def console_examples(text: str) -> list[tuple[str, str]]:
    """(command, expected output) for each `$ ` line in the ```console blocks of a page."""
    examples = []
    for block in blocks(text, "console"):
        lines = block.rstrip("\n").split("\n")
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")] + [len(lines)]
        for start, stop in zip(starts, starts[1:]):
            examples.append((lines[start][2:], "\n".join(lines[start + 1 : stop])))
    return examples


def _split(text: str) -> tuple[list[str], list[str]]:
    return _NUMBER.split(text), _NUMBER.findall(text)


def numbers_differ(expected: str, actual: str) -> str | None:
    """None when `actual` is `expected` up to the tolerance of the module docstring, else what differs."""
    (expected_text, expected_numbers), (actual_text, actual_numbers) = _split(expected), _split(actual)
    if expected_text != actual_text:
        return f"the text differs:\n--- expected\n{expected}\n--- actual\n{actual}"
    for shown, printed in zip(expected_numbers, actual_numbers):
        if not math.isclose(float(shown), float(printed), rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return f"{printed} printed where the docs show {shown} (rel {REL_TOL:g}, abs {ABS_TOL:g})"
    return None


def run_fed_dp(command: str, capsys) -> tuple[int, str]:
    """Run one `fed-dp ...` command line in this process: (exit status, stdout + stderr)."""
    from fed_dp.simulations.cli import main

    argv = shlex.split(command)
    assert argv[0] == "fed-dp"
    try:
        status = main(argv[1:])
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).rstrip("\n")
