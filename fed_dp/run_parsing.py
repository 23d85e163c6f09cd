"""Parsing a run configuration: nested tables (a TOML document, ``--set table.key=value``) or a flat Flower run
config into the sections of ``fed_dp.run_schema``, each value checked against its key and every error naming the
key. :class:`fed_dp.run_config.RunConfig` (``from_tables``, ``from_flat``) is built with these functions; nothing here
loads torch, so a command checks its config's names (:func:`check_names`) at once.
"""

from __future__ import annotations

import copy
import difflib
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fed_dp.config import DEFAULT_NOISE_MULTIPLIER, PrivacyConfig
from fed_dp.run_schema import KEYS, TABLES, AdaptiveSettings, TaskSettings
from fed_dp.schema import UNSET, Key
from fed_dp.validation import is_int as _integer
from fed_dp.validation import is_real as _real
from fed_dp.validation import require as _check


def _typed(key: Key, value: Any) -> Any:
    """``value`` checked against the key's type (an int is a float too); ValueError naming the key."""
    ok = {int: _integer, float: _real, bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}
    if not ok[key.kind](value):
        raise ValueError(f"{key.dotted} must be {key.kind.__name__}, got {value!r} ({type(value).__name__})")
    if key.choices and value not in key.choices:
        raise ValueError(f"{key.dotted} must be one of {', '.join(key.choices)}; got {value!r}")
    return float(value) if key.kind is float else value


def _closest(name: str, known: Sequence[str]) -> str:
    """" (did you mean X?)" for the known name closest to a mistyped one, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_names(given: Sequence[str], known: Sequence[str], what: str, listing: str) -> None:
    """A ValueError naming each of ``given`` that is not ``known`` (with the closest known name) and ``listing``."""
    unknown = [name for name in given if name not in known]
    _check(not unknown, f"unknown {what} {', '.join(name + _closest(name, known) for name in unknown)}; {listing}")


def check_names(tables: Mapping[str, Any]) -> None:
    """Every table and key of a config (nested tables, as TOML reads them) is one of the schema, else a ValueError
    naming the unknown ones, each with the closest known name. ``[task]`` is open (its other keys are the task's
    arguments). Names only, no values; nothing here loads torch, so a command checks its config's names first and
    a mistyped key is reported at once (``fed-dp simulate --set``)."""
    unknown_names(list(tables), TABLES, "config table(s)", f"tables are {', '.join(TABLES)}")
    for table, given in tables.items():
        _check(isinstance(given, Mapping), f"[{table}] must be a table of keys, got {given!r}")
        if table != "task":
            known = [key.name for key in KEYS if key.table == table]
            unknown_names([f"{table}.{name}" for name in given], [f"{table}.{name}" for name in known], "key(s)",
                          f"[{table}] has {', '.join(known)} (docs/reference/configuration.md)")


def _table_values(table: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of one table as Python fields: given values typed, absent keys at their defaults, and optional
    keys holding :data:`~fed_dp.schema.UNSET` ("") unset (None)."""
    keys = {key.name: key for key in KEYS if key.table == table}
    values: dict[str, Any] = {}
    for name, key in keys.items():
        if name not in given or (key.optional and given[name] == UNSET):
            values[key.field] = key.default
        else:
            values[key.field] = _typed(key, given[name])
    return values


def _task_settings(given: Mapping[str, Any]) -> TaskSettings:
    values = _table_values("task", {k: v for k, v in given.items() if k in ("ref", "root")})
    options = {k.replace("-", "_"): v for k, v in given.items() if k not in ("ref", "root") and v != ""}
    return TaskSettings(ref=values["ref"], root=values["root"], options=options)


def _privacy(values: dict[str, Any]) -> PrivacyConfig:
    if values["noise_multiplier"] is None and values["target_epsilon"] is None:
        values["noise_multiplier"] = DEFAULT_NOISE_MULTIPLIER
    if values["noise_multiplier"] is not None and values["target_epsilon"] is not None:
        raise ValueError(
            f"privacy.noise-multiplier = {values['noise_multiplier']} and privacy.target-epsilon = "
            f"{values['target_epsilon']} are both set: give one (in a Flower run config, set "
            "privacy.noise-multiplier=\"\" to calibrate σ for the target ε)"
        )
    return _built("privacy", PrivacyConfig, values)


def _built(table: str, section: Callable[..., Any], values: dict[str, Any]) -> Any:
    """``section(**values)``, where a ValueError that names a field by its Python name (``noise_multiplier``)
    names the config key instead (``privacy.noise-multiplier``): the reader of a config error edits keys. A name
    without an underscore is rewritten only after its table's name (``local steps``): ``rounds`` or ``delta`` are
    also plain words of a message."""
    try:
        return section(**values)
    except ValueError as error:
        message = str(error)
        for name in sorted(values, key=len, reverse=True):
            prefix = f"(?:{table} )?" if "_" in name else f"{table} "  # "local steps" is a field too
            message = re.sub(rf"(?<![\w.-]){prefix}{name}(?![\w-])", f"{table}.{name.replace('_', '-')}", message)
        if message == str(error):
            raise
        raise ValueError(message) from error


def _adaptive(values: dict[str, Any], privacy: PrivacyConfig) -> AdaptiveSettings:
    settings = AdaptiveSettings(**values)
    settings.build(privacy)  # validates the enabled settings now, before anything runs
    if not settings.enabled:
        changed = [k for k, v in values.items() if v != getattr(AdaptiveSettings(), k)]
        _check(not changed, f"adaptive.{changed[0].replace('_', '-') if changed else ''} is set but "
               "adaptive.enabled is false; enable adaptive clipping or leave its keys out")
    return settings


def unflatten(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"privacy.rounds": 5}`` → ``{"privacy": {"rounds": 5}}`` (one level: tables and their keys)."""
    tables: dict[str, dict[str, Any]] = {}
    for dotted, value in flat.items():
        table, _, name = str(dotted).partition(".")
        _check(bool(name), f"run-config key {dotted!r} is not 'table.key'; tables are {', '.join(TABLES)}")
        tables.setdefault(table, {})[name] = value
    return tables


def apply_overrides(tables: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``--set table.key=value`` on nested tables (the value parsed as a TOML literal, else kept as text).

    Keys of the experiment tables of ``fed-dp simulate`` (``optimizers.NAME.key``) are allowed too."""
    tables = copy.deepcopy(dict(tables))
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        _check(bool(sep) and "." in dotted, f"--set expects table.key=value (e.g. privacy.rounds=50), got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *path, name = dotted.split(".")
        _check(path[0] in TABLES + ("optimizers",),
               f"--set {dotted}: unknown table {path[0]!r}{_closest(path[0], TABLES)}; tables are {', '.join(TABLES)}")
        target = tables
        for table in path:
            target = target.setdefault(table, {})
        target[name] = value
    return tables
