"""Editors and type checkers resolve every import from the repository root (issue 41 item 3).

The folders clients/, server/ and simulations/ install as fed_dp.clients, fed_dp.server and fed_dp.simulations
(pyproject.toml's package-dir), which Python follows through the editable install's import hook but static tools
do not: they look for ``fed_dp/clients/``. The repository therefore carries the links ``fed_dp/clients →
../clients`` (and the two others), so that the folder ``fed_dp/`` at the root is the package as Python imports it.
The files stay in their top-level folders; the wheel and the sdist are built from package-dir as before.

The check is a real type checker (basedpyright, the ``test`` extra; it bundles its own Node.js) over every file
pyproject.toml's ``[tool.pyright]`` includes, with type checking off and library code unread, since only import
resolution is asked (docs/explanation/architecture.md, Editors and type checkers). One probe file with two broken
imports runs in the same check, so a reader that saw nothing would fail here. transformers is read through a stub
that has every name (binding its own 3,000-file package took a third of the check's time): our imports of it are
checked to resolve, the names we take from it are not (tests/clients/test_hf.py imports them for real).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UPPER_LAYERS = ("clients", "server", "simulations")
PYRIGHT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pyright"]

#: What the probe imports that does not exist, and the diagnostic each must give.
PROBE = """import fed_dp.clients.no_such_module
from fed_dp.server.flower_strategy import NoSuchName
from fed_dp.clients.task import Task
"""


def _unresolved(diagnostic: dict) -> bool:
    """An import that does not resolve: a module not found, a name a module does not have (``from m import x``) or
    a module attribute that does not exist (``fed_dp.x``). Other attribute errors are types, not imports."""
    message = diagnostic["message"]
    return diagnostic.get("rule") in ("reportMissingImports", "reportMissingModuleSource") or (
        diagnostic.get("rule") == "reportAttributeAccessIssue"
        and ("is unknown import symbol" in message or "is not a known attribute of module" in message))


@pytest.mark.parametrize("layer", UPPER_LAYERS)
def test_the_core_folder_links_each_upper_layer_under_its_import_name(layer):
    link = ROOT / "fed_dp" / layer
    assert link.is_symlink(), f"fed_dp/{layer} must be the link ../{layer} (git keeps it; see this module's docstring)"
    assert Path(link.readlink()) == Path("..") / layer  # relative, so it holds in every checkout
    assert link.resolve() == (ROOT / layer).resolve()


def test_jedi_follows_an_upper_layer_import_from_the_repository_root():
    """The issue's example: jump from ``from fed_dp.clients.task import Task`` to the class, without an install."""
    import jedi

    script = jedi.Script("from fed_dp.clients.task import Task\nTask\n", path=str(ROOT / "scratch.py"),
                         project=jedi.Project(str(ROOT)))
    found = script.goto(2, 1, follow_imports=True)
    assert [(Path(d.module_path).resolve(), d.type, d.name) for d in found] == [
        ((ROOT / "clients" / "task.py").resolve(), "class", "Task")]


def test_a_type_checker_resolves_every_import_of_the_repository(tmp_path):
    pytest.importorskip("basedpyright", reason="the checker of the test extra: pip install -e '.[test]'")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE, encoding="utf-8")
    stub = tmp_path / "typings" / "transformers" / "__init__.pyi"
    stub.parent.mkdir(parents=True)
    stub.write_text("from typing import Any\n\ndef __getattr__(name: str) -> Any: ...\n", encoding="utf-8")
    config = {
        "include": [str(ROOT / path) for path in PYRIGHT["include"]] + [str(probe)],
        "exclude": [str(ROOT / path) if not path.startswith("**") else path for path in PYRIGHT["exclude"]],
        # the repository's files resolve from its root (as an editor opened there does), the probe outside it too
        "executionEnvironments": [{"root": str(ROOT)}], "extraPaths": [str(ROOT)],
        "stubPath": str(stub.parents[1]), "typeCheckingMode": "off", "useLibraryCodeForTypes": False,
        "reportMissingImports": "error", "reportMissingModuleSource": "error", "reportAttributeAccessIssue": "error",
    }
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config), encoding="utf-8")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "basedpyright", "-p", str(tmp_path), "--outputjson"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    report = json.loads(done.stdout)
    unresolved = [(Path(d["file"]), d["range"]["start"]["line"] + 1, d["message"].splitlines()[0])
                  for d in report["generalDiagnostics"] if _unresolved(d)]
    print(f"basedpyright: {report['summary']['filesAnalyzed']} files, {time.perf_counter() - start:.1f} s")
    assert sorted((line, message.split('"')[1]) for path, line, message in unresolved if path == probe) == [
        (1, "fed_dp.clients.no_such_module"), (2, "NoSuchName")]
    assert [u for u in unresolved if u[0] != probe] == []
    assert report["summary"]["filesAnalyzed"] > 150  # the whole repository, not only the probe
