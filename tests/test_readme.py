"""The README's contract: every `$ fed-dp ...` example prints exactly what the README shows, the
main-job command runs, and .ci/run runs the README's test command verbatim."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fed_dp.simulations.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _console_examples() -> list[tuple[str, str]]:
    """(command, expected output) for each `$ fed-dp` line in ```console blocks."""
    examples = []
    for block in re.findall(r"```console\n(.*?)```", README, flags=re.S):
        lines = block.rstrip("\n").split("\n")
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")] + [len(lines)]
        for start, stop in zip(starts, starts[1:]):
            examples.append((lines[start][2:], "\n".join(lines[start + 1 : stop])))
    return examples


def _bash_commands() -> list[str]:
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", README, flags=re.S)]


def _run(command: str, capsys) -> tuple[int, str]:
    argv = shlex.split(command)
    assert argv[0] == "fed-dp"
    try:
        status = main(argv[1:])
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).rstrip("\n")


EXAMPLES = _console_examples()


def test_readme_has_worked_examples_for_both_commands():
    commands = {shlex.split(c)[1] for c, _ in EXAMPLES}
    assert {"epsilon", "calibrate"} <= commands


@pytest.mark.parametrize("command, expected", EXAMPLES, ids=[c[7:60] for c, _ in EXAMPLES])
def test_readme_example_output_is_reproduced(command, expected, capsys):
    status, output = _run(command, capsys)
    assert output == expected
    assert status == (2 if "error:" in expected else 0)


def _readme_table() -> dict[str, list[str]]:
    """The table printed under the Simulations section: optimizer -> its cells."""
    section = README[README.index("## Simulations"):]
    block = re.search(r"```\n(optimizer .*?)```", section, flags=re.S).group(1)
    lines = block.strip().split("\n")
    return {line.split()[0]: line.split() for line in lines[2:]}


def test_main_job_command_runs_and_reproduces_the_readme_table(tmp_path, capsys):
    """The first set-up command ends with `fed-dp simulate`; run it (into tmp_path) and compare.

    ε must match exactly (accounting is deterministic); accuracy to 0.02, allowing for floating-point
    differences between machines in 200 rounds of training.
    """
    main_job = _bash_commands()[0]
    assert main_job.startswith("python3 -m venv .venv")
    command = main_job.split("&&")[-1].strip()
    assert command == "fed-dp simulate"
    status, output = _run(f"{command} --out {tmp_path} --quiet --no-plot", capsys)
    assert status == 0
    printed = {line.split()[0]: line.split() for line in output.split("\n") if line.startswith("dp-")}
    expected = _readme_table()
    assert sorted(printed) == sorted(expected)
    for name, cells in expected.items():
        assert printed[name][1] == cells[1]  # epsilon
        for column in range(2, len(cells) - 1):  # accuracy, loss, per-group accuracy
            assert abs(float(printed[name][column]) - float(cells[column])) < 0.02, (name, column)


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _bash_commands()[1]
    assert test_command.endswith("pytest")
    ci_script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci_script.splitlines()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("example", ["examples/digits.py", "examples/flower_app/server_app.py",
                                     "examples/flower_app/client_app.py"])
def test_the_readme_shows_the_tested_examples_verbatim(example):
    """What a user copies from "Bring your own model and data" is the file tests/test_examples.py runs."""
    assert (ROOT / example).read_text(encoding="utf-8") in [block for block in _python_blocks()]


def test_the_configuration_reference_lists_every_key_with_its_default():
    from fed_dp.run_config import KEYS

    section = README[README.index("### Configuration reference"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9-]+\.[a-z0-9-]+)` \| `([^`]*)` \|", section, flags=re.M)}
    assert set(rows) == {key.dotted for key in KEYS}
    for key in KEYS:
        shown = "unset" if key.default is None else str(key.default).lower() if isinstance(key.default, bool) \
            else f'"{key.default}"' if isinstance(key.default, str) else repr(key.default)
        assert rows[key.dotted] == shown, key.dotted
