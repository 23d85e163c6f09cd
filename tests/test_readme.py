"""The README's contract: its two set-up commands (the first runs the main job and reproduces the table the
docs show for it; `.ci/run` runs the second verbatim), the example script it shows is the tested file, and
its links into docs/ lead to pages that exist. The docs' own examples are tests/test_docs.py's."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from docs_examples import DOCS, README, ROOT, blocks, run_fed_dp

TEXT = README.read_text(encoding="utf-8")
SIMULATIONS = DOCS / "tutorials" / "simulations.md"


def _bash_commands() -> list[str]:
    return [c.strip() for c in blocks(TEXT, "bash")]


def _main_job_table() -> dict[str, list[str]]:
    """The table of the main job in the Simulations tutorial: optimizer -> its cells."""
    page = SIMULATIONS.read_text(encoding="utf-8")
    block = re.search(r"```\n(optimizer .*?)```", page, flags=re.S).group(1)
    lines = block.strip().split("\n")
    return {line.split()[0]: line.split() for line in lines[2:]}


def test_main_job_command_runs_and_reproduces_the_readme_table(tmp_path, capsys, caplog):
    """The README's first set-up command ends with `fed-dp simulate`; run it (into tmp_path) and compare with
    the table in docs/tutorials/simulations.md.

    ε must match exactly (accounting is deterministic); accuracy to 0.02, allowing for floating-point
    differences between machines in 200 rounds of training. It warns about nothing (issue 40 item 6: it logged
    four clip-norm warnings about itself).
    """
    main_job = _bash_commands()[0]
    assert main_job.startswith("python3 -m venv .venv")
    command = main_job.split("&&")[-1].strip()
    assert command == "fed-dp simulate"
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="fed_dp"):
        warnings.simplefilter("always")
        status, output = run_fed_dp(f"{command} --out {tmp_path} --quiet --no-plot", capsys)
    assert status == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [str(w.message) for w in caught if w.filename.startswith(str(ROOT))]  # none of fed-dp's own
    printed = {line.split()[0]: line.split() for line in output.split("\n") if line.startswith("dp-")}
    expected = _main_job_table()
    assert sorted(printed) == sorted(expected)
    for name, cells in expected.items():
        assert printed[name][1] == cells[1]  # epsilon
        for column in range(2, len(cells) - 1):  # accuracy, loss, per-group accuracy
            assert abs(float(printed[name][column]) - float(cells[column])) < 0.02, (name, column)


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _bash_commands()[1]
    assert test_command.startswith("python3 -m venv .venv") and test_command.endswith("pytest")
    ci_script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci_script.splitlines()


@pytest.mark.parametrize("page, example", [
    ("README.md", "examples/digits.py"),
    ("docs/tutorials/bring-your-own-model.md", "examples/digits.py"),
    ("docs/how-to/flower-app.md", "examples/flower_app/server_app.py"),
    ("docs/how-to/flower-app.md", "examples/flower_app/client_app.py"),
])
def test_the_docs_show_the_tested_examples_verbatim(page, example):
    """What a user copies is the file tests/test_examples.py runs."""
    shown = blocks((ROOT / page).read_text(encoding="utf-8"), "python")
    assert (ROOT / example).read_text(encoding="utf-8") in shown


def test_the_readme_links_to_docs_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", TEXT)
    assert len(links) >= 10
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, missing


def test_the_readme_is_a_front_page():
    """About 200-300 lines: what fed-dp is, the two commands, one script, the Flower app, where to go next."""
    assert len(TEXT.splitlines()) <= 300
    for heading in ("## Quick start", "## Bring your own model and data", "## Your own Flower app",
                    "## Where to go next"):
        assert heading in TEXT
