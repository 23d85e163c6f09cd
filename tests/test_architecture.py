"""The import graph points down only: fed_dp (core) ← clients ← server, with simulations on top.

Every import statement of every module, subpackages included, is read with ``ast`` (also imports inside
functions, and relative imports resolved), so a cycle cannot hide in a lazy import. So is every string that is a
module reference — ``"fed_dp.simulations.tasks.builtin:w1_task"``, ``importlib.import_module("fed_dp.server.app")``
— so an upward link cannot hide in a string either (docstrings and logger names are prose and names, not
references). The core is DP math on tensors: it imports neither torch.nn nor Flower. The package's ``__init__``
is the public facade that loads the layers lazily on first use; it is the one module allowed to name all of them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder → (layer name, rank); a module may import layers of lower or equal rank only.
LAYERS = {"fed_dp": ("core", 0), "clients": ("clients", 1), "server": ("server", 2), "simulations": ("simulations", 3)}
RANK = {"fed_dp": 0, "fed_dp.clients": 1, "fed_dp.server": 2, "fed_dp.simulations": 3}
#: folder → the package it installs as (pyproject.toml's package-dir).
PACKAGE = {"fed_dp": "fed_dp", "clients": "fed_dp.clients", "server": "fed_dp.server", "simulations": "fed_dp.simulations"}
#: A whole string that names a module of the package, optionally with ``:attribute`` (an entry-point value).
MODULE_REFERENCE = re.compile(r"fed_dp(\.\w+)*(:[\w.]+)?")


def _modules() -> list[Path]:
    """Every module of every layer, subpackages included (the core's links to the other folders, fed_dp/clients
    etc., which let editors follow the imports, are not followed: those modules belong to their own folder)."""
    return sorted(p for folder in LAYERS for p in (ROOT / folder).rglob("*.py")
                  if p != ROOT / "fed_dp" / "__init__.py" and not _through_link(p))


def _through_link(path: Path) -> bool:
    return any(parent.is_symlink() for parent in path.relative_to(ROOT).parents if parent != Path("."))


def _folder(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _module_name(path: Path) -> str:
    """The dotted name ``path`` installs as, e.g. simulations/tasks/builtin.py → fed_dp.simulations.tasks.builtin."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((PACKAGE[parts[0]], *parts[1:]))


def _imports(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names, relative imports resolved to absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = None  # tests and examples: relative imports stay within them
    if _folder(path) in PACKAGE:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and package is None:
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module:
                names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def _not_references(tree: ast.AST) -> set[int]:
    """ids of the string constants that are prose or names, not module references: docstrings, logger names."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            if (function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)) == "getLogger":
                skip.add(id(node.args[0]))
    return skip


def _string_references(path: Path) -> list[str]:
    """The modules that strings of ``path`` name (a whole string ``fed_dp.x.y`` or ``fed_dp.x.y:attribute``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _not_references(tree)
    return [node.value.partition(":")[0] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and MODULE_REFERENCE.fullmatch(node.value.strip())]


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


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_string_names_a_module_of_a_layer_above(path):
    """A task table, an entry point or ``importlib.import_module`` that names an upper layer in a string is an
    upward link too (a lower layer finds an upper one through a mechanism such as entry points instead)."""
    layer, rank = LAYERS[_folder(path)]
    upward = sorted({name for name in _string_references(path) if (_layer_of_import(name) or 0) > rank})
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) names {upward} of a layer above it in a string"


def test_the_reference_reader_sees_strings_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The readers above on a core module that hides upward links in each way they look for."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    path = tmp_path / "fed_dp" / "hidden.py"
    path.parent.mkdir()
    path.write_text('''"""A docstring naming fed_dp.server.app is prose."""
import importlib
import logging

TASKS = {"w1": "fed_dp.simulations.tasks.builtin:w1_task"}
log = logging.getLogger("fed_dp.server")


def lazy():
    from .clients import task
    return importlib.import_module("fed_dp.server.app"), task
''')
    assert _string_references(path) == ["fed_dp.simulations.tasks.builtin", "fed_dp.server.app"]
    assert "fed_dp.clients.task" in _imports(path)


#: The loaders of layers 0–2 that import a module whose name is computed at run time, each the way a lower layer
#: reaches code it cannot name: the user's own task (``package.module:factory``, built-in names resolved from the
#: ``fed_dp.tasks`` entry points). Another one is an upward link the string reader cannot see.
DYNAMIC_LOADERS = {("clients/task.py", "load_task")}


def _dynamic_imports(path: Path) -> set[tuple[str, str]]:
    """(file, enclosing function or ``<module>``) of each call in ``path`` that imports a module named at run time:
    ``import_module``/``__import__`` of anything but a string constant, or an entry point's ``.load()``."""
    found = set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            computed = name in ("import_module", "__import__") and not (
                node.args and isinstance(node.args[0], ast.Constant))
            if computed or (name == "load" and not node.args):
                found.add((str(path.relative_to(ROOT)), function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return found


def test_no_lower_layer_imports_a_module_named_at_run_time_but_the_task_loader():
    """What the string reader cannot see: ``import_module(name)`` with a computed name (or an entry point's
    ``load()``) in the core, clients or server. Only the task loader does it, and it is listed with why."""
    found = set()
    for path in _modules():
        if LAYERS[_folder(path)][1] < RANK["fed_dp.simulations"]:
            found |= _dynamic_imports(path)
    assert found == DYNAMIC_LOADERS


def test_the_dynamic_import_reader_sees_computed_names_and_entry_point_loads(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    path = tmp_path / "fed_dp" / "sneaky.py"
    path.parent.mkdir()
    path.write_text("""import importlib
from importlib.metadata import entry_points


def up(layer):
    return importlib.import_module("fed_dp." + layer)


def plugins():
    return [entry.load() for entry in entry_points(group="x")]


def fine():
    return importlib.import_module("json")
""")
    assert _dynamic_imports(path) == {("fed_dp/sneaky.py", "up"), ("fed_dp/sneaky.py", "plugins")}


def _module_graph() -> dict[str, set[str]]:
    """Module → the modules of the package it imports (lazily or not), each name cut to the module it is in."""
    modules = {_module_name(path): path for path in _modules()}
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def test_no_module_cycle():
    """No module reaches itself through imports, lazy ones included (e.g. a ClientApp and its node service
    importing each other): each module can be read, tested and loaded on its own."""
    graph = _module_graph()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise AssertionError("module cycle: " + " → ".join(path[path.index(name):] + (name,)))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, path + (name,))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


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


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_each_top_level_folder_says_first_which_import_name_it_is(folder):
    """The folders are not the import paths (clients/ is fed_dp.clients): each layer's ``__init__`` says so first."""
    first = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text(encoding="utf-8"))).splitlines()[0]
    assert first.startswith(f"{PACKAGE[folder]} — the folder {folder}/, layer {LAYERS[folder][1]} of 4"), first


def test_every_module_is_named_on_the_architecture_page_and_the_core_ones_in_the_facade():
    """A newcomer finds each file's concept from the architecture page's module list (docs/explanation/
    architecture.md) and the core's from ``fed_dp/__init__``'s: a module added without a line there fails here."""
    page = (ROOT / "docs" / "explanation" / "architecture.md").read_text(encoding="utf-8")
    listing = page[page.index("Module by module:"):].split("```")[1]
    facade = ast.get_docstring(ast.parse((ROOT / "fed_dp" / "__init__.py").read_text(encoding="utf-8")))
    core = facade[facade.index("Core modules"):]
    named = set(re.findall(r"\w+", listing))
    for path in _modules():
        if path.name != "__init__.py":
            assert path.stem in named, f"{path.relative_to(ROOT)} is not named in the architecture page's module list"
    for path in sorted((ROOT / "fed_dp").glob("*.py")):
        if path.name != "__init__.py":
            assert path.stem in set(re.findall(r"\w+", core)), f"fed_dp/{path.name} is not in fed_dp/__init__'s list"


def test_every_package_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists: every folder with an ``__init__``
    (subpackages included) is listed, each where package-dir says."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = {_module_name(path) for path in _modules() + [ROOT / "fed_dp" / "__init__.py"] if path.name == "__init__.py"}
    assert set(setuptools["packages"]) == found
    assert setuptools["package-dir"] == {package: folder for folder, package in PACKAGE.items()}


def test_the_public_api_resolves():
    import fed_dp

    for name in fed_dp.__all__:
        assert getattr(fed_dp, name) is not None, name


def test_following_the_run_config_to_the_first_round_never_climbs_a_layer():
    """At run time (``tests/follow_config.py``): from ``fed-dp simulate`` to the first private round, no function
    that receives a configuration object is called from a layer below its own — a climb the import test cannot see
    (an object or callback handed down). The trip itself is printed for the record."""
    import follow_config

    stops = follow_config.follow(["heavy-tail-quick", "--set", "privacy.rounds=1", "--set",
                                  'run.optimizers=["dp-adam"]', "--set", "run.eval-every=0"])
    named = follow_config.functions(stops)
    assert ("fed_dp.accounting", "calibrate_noise_multiplier") in named and ("fed_dp.round", "init_server") in named
    assert [s for s in stops if s.climbs] == []
    print(f"{len(named)} functions in {len({m for m, _ in named})} files receive the config on the way")


def test_the_follow_counts_a_call_from_a_lower_layer_as_a_climb():
    import follow_config

    assert follow_config.Stop("fed_dp.simulations.cli", "main", "fed_dp.round_loop").climbs
    assert not follow_config.Stop("fed_dp.accounting", "epsilon", "fed_dp.simulations.cli").climbs
    assert not follow_config.Stop("fed_dp.clients.task", "build_task", "fed_dp.clients.node").climbs
    assert follow_config.layer("flwr.app") is None and follow_config.layer("fed_dp.server.app") == 2


def test_the_in_process_simulator_imports_no_flower():
    """``fed_dp.train`` trains in this process with the same LocalTrainer a ClientApp uses; the Flower messages are
    ``fed_dp.clients.replies``'s, so importing the engine (in a fresh interpreter) loads no ``flwr``."""
    import subprocess
    import sys

    script = ("import sys\nimport fed_dp.simulations.engine.inprocess, fed_dp.simulations.engine.distributed\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'ray', 'grpc'}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


#: The longest a function may be, in lines from its ``def`` to its last line (docstring included): a longer one does
#: several things that each deserve a name (issue 41).
MAX_FUNCTION_LINES = 100
#: Every Python file of ours: the layers, the tests, the examples and the docs' hooks.
CHECKED_FOLDERS = (*LAYERS, "tests", "examples", "docs")


def _our_files() -> list[Path]:
    return sorted(p for folder in CHECKED_FOLDERS for p in (ROOT / folder).rglob("*.py") if not _through_link(p))


def _long_functions(path: Path) -> list[str]:
    """``file:line name (n lines)`` of each function or method of ``path`` longer than :data:`MAX_FUNCTION_LINES`,
    nested ones included; n = end_lineno − lineno + 1 of the ``def`` (decorators not counted, the docstring counted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_100_lines():
    long = [entry for path in _our_files() for entry in _long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_length_reader_counts_from_the_def_to_the_last_line(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(98))
    path = tmp_path / "long.py"
    path.write_text(f'@decorator\ndef fits():\n    """doc"""\n{body}\n\n\nclass C:\n    def over(self):\n'
                    f'        """doc"""\n        y = 0\n{body.replace("    ", "        ")}\n')
    assert _long_functions(path) == ["long.py:105 over (101 lines)"]  # fits: 100 lines, its decorator not counted


def _argparse_internals() -> set[str]:
    """The private names of argparse's module and of the objects it hands out (a parser, what ``add_subparsers``,
    ``add_argument_group``, ``add_mutually_exclusive_group`` and ``add_argument`` return, a HelpFormatter)."""
    import argparse

    parser = argparse.ArgumentParser()
    objects = (argparse, parser, parser.add_subparsers(), parser.add_argument_group("group"),
               parser.add_mutually_exclusive_group(), parser.add_argument("--option"), argparse.HelpFormatter("prog"))
    return {name for thing in objects for name in dir(thing) if name.startswith("_") and not name.startswith("__")}


def _argparse_private_uses(path: Path, internals: set[str]) -> list[str]:
    """``file:line name`` of each attribute of ``path`` named like one of argparse's internals (``parser._actions``,
    ``argparse._SubParsersAction``, a formatter's ``_split_lines``), and each method of a class derived from an
    argparse class that overrides one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in internals]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("argparse" in ast.unparse(base) for base in node.bases):
            found += [f"{path.relative_to(ROOT)}:{item.lineno} {item.name}" for item in node.body
                      if isinstance(item, ast.FunctionDef) and item.name in internals]
    return found


def test_the_commands_use_only_public_argparse():
    """argparse's private attributes (a parser's ``_actions``, ``_SubParsersAction``, HelpFormatter's methods) change
    between Python versions without notice: the command lines are built with its documented API only."""
    internals = _argparse_internals()
    assert {"_actions", "_SubParsersAction", "_option_string_actions", "_split_lines"} <= internals
    uses = [use for path in _modules() + [ROOT / "fed_dp" / "__init__.py"]
            for use in _argparse_private_uses(path, internals)]
    assert not uses, f"argparse internals used: {uses}"


def test_the_argparse_reader_sees_private_attributes_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    path = tmp_path / "cli.py"
    path.write_text("""import argparse

parser = argparse.ArgumentParser()
commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


class Wide(argparse.HelpFormatter):
    def _split_lines(self, text, width):
        return [text]
""")
    assert _argparse_private_uses(path, _argparse_internals()) == [
        "cli.py:4 _actions", "cli.py:4 _SubParsersAction", "cli.py:8 _split_lines"]
