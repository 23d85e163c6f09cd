"""MkDocs hook: let mkdocstrings read the upper layers' files under their import names.

clients/, server/ and simulations/ become fed_dp.clients, fed_dp.server and fed_dp.simulations only through
pyproject.toml's package-dir, which the documentation generator (griffe) does not follow: it finds a module
by its folder. Before the build, this builds a folder `fed_dp/` in a temporary directory whose entries link to
the repository's fed_dp/* and to the three upper folders, and hands that directory to mkdocstrings.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
UPPER_LAYERS = ("clients", "server", "simulations")
_TMP: list[tempfile.TemporaryDirectory] = []


def _import_tree() -> Path:
    """A temporary folder holding `fed_dp/` laid out as Python imports it (links, no copies)."""
    tmp = tempfile.TemporaryDirectory(prefix="fed-dp-docs-")
    _TMP.append(tmp)  # kept until the process ends: the build reads the files
    package = Path(tmp.name) / "fed_dp"
    package.mkdir()
    for entry in (ROOT / "fed_dp").iterdir():
        if entry.name not in UPPER_LAYERS and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for layer in UPPER_LAYERS:
        (package / layer).symlink_to(ROOT / layer, target_is_directory=True)
    return Path(tmp.name)


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config):
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [str(_import_tree())]
    return config
