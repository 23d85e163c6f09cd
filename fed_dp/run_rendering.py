"""What is generated from the run configuration's schema (``fed_dp.run_schema.KEYS``): the Flower run-config table
that pyproject.toml lists (:func:`flower_table`, :func:`flower_defaults`) and the configuration reference
(:func:`reference_markdown`), printed by ``python -m fed_dp.run_config`` (:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fed_dp.run_schema import KEYS, TABLES
from fed_dp.schema import UNSET, Key


def flower_defaults(task_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every key with its default as a Flower run config holds it (unset values for unset defaults), plus
    ``task.<option>`` entries: what ``[tool.flwr.app.config]`` of an app using fed-dp's apps lists."""
    defaults = {key.dotted: key.flower_default for key in KEYS}
    defaults.update({f"task.{name}": value for name, value in (task_options or {}).items()})
    return defaults


def _toml_value(value: Any) -> str:
    """A scalar as a TOML literal (``"text"``, ``true``, ``1e-05``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    return repr(value)


def flower_table(task_options: Sequence[str] = ()) -> str:
    """The body of ``[tool.flwr.app.config]`` (:func:`flower_defaults` as TOML lines), with ``task.<option> = ""``
    for each of ``task_options``: what fed-dp's pyproject.toml lists (``python -m fed_dp.run_config --flower``)."""
    values = flower_defaults({name: UNSET for name in task_options})
    return "".join(f"{name} = {_toml_value(value)}\n" for name, value in values.items())


def _shown_default(key: Key) -> str:
    return "unset" if key.optional else _toml_value(key.default)


def reference_markdown() -> str:
    """The configuration reference (``docs/reference/configuration.md``), generated from :data:`KEYS`: one table
    per section with each key's type, default and meaning, so that it is never written by hand."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from fed_dp/run_schema.py by `python -m fed_dp.run_config > docs/reference/configuration.md`;"
        " do not edit by hand. -->",
        "",
        "Every key of a run, read by `fed-dp simulate` / `compare` TOML files (tables `[task]`, `[privacy]`, ...),"
        " `--set table.key=value`, Flower run configs (`[tool.flwr.app.config]`, `flwr run --run-config`, keys"
        " flattened to `table.key`) and `fed_dp.RunConfig` in Python, where each table is a frozen dataclass and each"
        " key a field (hyphens become underscores).",
        "",
        "A key whose default is *unset* is optional. A Flower run config cannot leave a key out, so there an unset"
        ' key holds the empty string `""`, which is never a valid value; any other value is checked as a value'
        " (`privacy.noise-multiplier = -1` is refused, not read as unset). Give `privacy.noise-multiplier` or"
        " `privacy.target-epsilon`, not both; σ = 1.0 applies when neither is given. `[task]` is open: besides"
        ' `ref` and `root`, every key is a keyword argument of the task function (`""`: not given, the function\'s'
        " own default applies).",
    ]
    for table in TABLES:
        lines += ["", f"## `[{table}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in (k for k in KEYS if k.table == table):
            choices = f" (one of {', '.join(f'`{c}`' for c in key.choices)})" if key.choices else ""
            doc = (key.doc + choices).replace("|", "\\|")
            lines.append(f"| `{key.dotted}` | {key.kind.__name__} | `{_shown_default(key)}` | {doc} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fed_dp.run_config``: print the configuration reference (Markdown); with ``--flower``, the body
    of the Flower run-config table, ``[tool.flwr.app.config]``, listing the given ``task.`` options."""
    parser = argparse.ArgumentParser(prog="python -m fed_dp.run_config", description=main.__doc__.split(";")[0])
    parser.add_argument("--flower", nargs="*", metavar="TASK_OPTION",
                        help="print the Flower run-config table instead, with task.OPTION = \"\" for each option")
    args = parser.parse_args(argv)
    sys.stdout.write(reference_markdown() if args.flower is None else flower_table(args.flower))
    return 0
