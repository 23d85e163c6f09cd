"""The one run configuration: every key once, with its type, default and meaning, parsed into frozen sections.

Three front ends read this schema and nothing else:

* ``fed-dp simulate`` / ``compare`` TOML files (tables ``[task]``, ``[privacy]``, ...) and ``--set table.key=value``;
* Flower's run config (``[tool.flwr.app.config]`` in a pyproject.toml, ``flwr run --run-config``): the same
  keys flattened to ``table.key`` (:meth:`RunConfig.from_flat`);
* Python: :class:`RunConfig` and its sections directly, or :meth:`RunConfig.from_tables`.

The schema is written once, on the section dataclasses (:data:`SECTIONS`; :func:`fed_dp.schema.setting`): each
field's default, meaning and choices. :data:`KEYS` reads them back; the Flower run-config table
(:func:`flower_table`, checked against pyproject.toml by the tests) and the configuration reference
(:func:`reference_markdown`, ``python -m fed_dp.run_config > docs/reference/configuration.md``) are generated
from it, and the public signatures take their defaults from :data:`SERVER_DEFAULTS` and its siblings.

Keys are hyphenated (``privacy.noise-multiplier``); Python fields use underscores. An optional key (default
None) is unset when it is absent or when it holds "" (:data:`fed_dp.schema.UNSET`), which no valid value of any
key is: a Flower run config cannot leave a key out, so this is how it says "not set"; any other value is
checked as a value (``privacy.noise-multiplier = -1`` is refused). ``[task]`` is open: besides ``ref`` and
``root``, every key is a keyword argument of the task factory (a value of "" means "not given": the factory's
own default applies).

``privacy.noise-multiplier`` and ``privacy.target-epsilon``: give one. σ = 1.0 applies when neither is given.

This module is the public entry: it defines :class:`RunConfig` and re-exports the names of the four modules that
hold the rest, one concern each: ``fed_dp.run_schema`` (the sections, :data:`KEYS`, the defaults),
``fed_dp.run_parsing`` (tables, overrides and flat run configs read into the sections), ``fed_dp.run_rendering``
(the Flower table and the reference; :func:`main`) and ``fed_dp.task_registry`` (tasks by short name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.run_parsing import _adaptive, _built, _privacy, _table_values, _task_settings
from fed_dp.run_parsing import apply_overrides, check_names, unflatten, unknown_names
from fed_dp.run_rendering import flower_defaults, flower_table, main, reference_markdown
from fed_dp.run_schema import (CLIENT_DEFAULTS, DEFAULTS, KEYS, NOISE_SOURCES, OPTIMIZER_DEFAULTS, OPTIMIZER_NAMES,
                               RUN_DEFAULTS, SECTIONS, SERVER_DEFAULTS, TABLES, TRAINING_PATHS, AdaptiveSettings,
                               ClientSettings, OptimizerSettings, RunSettings, ServerSettings, TaskSettings,
                               resolve_noise_source)
from fed_dp.task_registry import TASK_GROUP, registered_tasks

__all__ = [
    "CLIENT_DEFAULTS", "DEFAULTS", "KEYS", "NOISE_SOURCES", "OPTIMIZER_DEFAULTS", "OPTIMIZER_NAMES", "RUN_DEFAULTS",
    "SECTIONS", "SERVER_DEFAULTS", "TABLES", "TASK_GROUP", "TRAINING_PATHS", "AdaptiveSettings", "ClientSettings",
    "OptimizerSettings", "RunConfig", "RunSettings", "ServerSettings", "TaskSettings", "apply_overrides",
    "check_names", "flower_defaults", "flower_table", "main", "reference_markdown", "registered_tasks",
    "resolve_noise_source", "unflatten", "unknown_names",
]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run, validated: what every engine and app reads (see the module docstring for the keys)."""

    task: TaskSettings = field(default_factory=TaskSettings)
    privacy: PrivacyConfig
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    local: LocalTraining = field(default_factory=LocalTraining)
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    client: ClientSettings = field(default_factory=ClientSettings)
    run: RunSettings = field(default_factory=RunSettings)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any]) -> "RunConfig":
        """Parse nested tables (a TOML document): unknown tables or keys, wrong types and bad values are errors
        that name the key; absent keys take their defaults."""
        tables = {name: dict(value) if isinstance(value, Mapping) else value for name, value in tables.items()}
        check_names(tables)
        values = {table: _table_values(table, tables.get(table, {})) for table in TABLES if table != "task"}
        privacy = _privacy(values["privacy"])
        return cls(
            task=_task_settings(tables.get("task", {})),
            privacy=privacy,
            optimizer=_built("optimizer", OptimizerSettings, values["optimizer"]),
            local=_built("local", LocalTraining, values["local"]),
            adaptive=_adaptive(values["adaptive"], privacy),
            server=_built("server", ServerSettings, values["server"]),
            client=_built("client", ClientSettings, values["client"]),
            run=_built("run", RunSettings, values["run"]),
        )

    @classmethod
    def from_flat(cls, run_config: Mapping[str, Any]) -> "RunConfig":
        """Parse a Flower run config (flat ``table.key`` names, as ``context.run_config`` holds them)."""
        return cls.from_tables(unflatten(run_config))


if __name__ == "__main__":
    raise SystemExit(main())
