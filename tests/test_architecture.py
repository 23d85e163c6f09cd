"""The import graph points down only: fed_dp (core) ← clients ← server, with simulations on top.

Every import statement of every module is read with ``ast`` (also imports inside functions), so a cycle cannot
hide in a lazy import. The core is DP math on tensors: it imports neither torch.nn nor Flower. The package's
``__init__`` is the public facade that loads the layers lazily on first use; it is the one module allowed to
name all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder → (layer name, rank); a module may import layers of lower or equal rank only.
LAYERS = {"fed_dp": ("core", 0), "clients": ("clients", 1), "server": ("server", 2), "simulations": ("simulations", 3)}
RANK = {"fed_dp": 0, "fed_dp.clients": 1, "fed_dp.server": 2, "fed_dp.simulations": 3}


def _modules() -> list[Path]:
    """Every module of every layer, subpackages included (the core's symlinks to the other folders, which a
    worktree may have, are not followed: those modules belong to their own folder)."""
    return sorted(p for folder in LAYERS for p in (ROOT / folder).rglob("*.py")
                  if p != ROOT / "fed_dp" / "__init__.py" and not _through_link(p))


def _through_link(path: Path) -> bool:
    return any(parent.is_symlink() for parent in path.relative_to(ROOT).parents if parent != Path("."))


def _folder(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _layer_of_import(name: str) -> int | None:
    if name != "fed_dp" and not name.startswith("fed_dp."):
        return None
    for prefix in ("fed_dp.simulations", "fed_dp.server", "fed_dp.clients"):
        if name == prefix or name.startswith(prefix + "."):
            return RANK[prefix]
    return 0


def test_there_are_modules_in_every_layer():
    assert {_folder(path) for path in _modules()} == set(LAYERS)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_only(path):
    layer, rank = LAYERS[_folder(path)]
    upward = [name for name in _imports(path) if (_layer_of_import(name) or 0) > rank]
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) imports {upward} from a layer above it"


@pytest.mark.parametrize("path", [p for p in _modules() if _folder(p) == "fed_dp"], ids=lambda p: p.name)
def test_the_core_needs_neither_torch_nn_nor_flower(path):
    bad = [n for n in _imports(path) if n.split(".")[0] == "flwr" or n.startswith("torch.nn") or n == "torch.nn"]
    assert not bad, f"fed_dp/{path.name} imports {bad}"


def test_no_module_imports_the_old_top_level_names():
    """Installed, the folders are fed_dp.clients / fed_dp.server / fed_dp.simulations: nothing may import
    ``server``, ``clients`` or ``simulations`` as top-level packages."""
    for path in _modules() + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py")):
        bad = [n for n in _imports(path) if n.split(".")[0] in ("server", "clients", "simulations")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_public_api_resolves():
    import fed_dp

    for name in fed_dp.__all__:
        assert getattr(fed_dp, name) is not None, name
