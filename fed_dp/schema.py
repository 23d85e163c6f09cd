"""The run configuration's schema, written on the section dataclasses themselves.

A field of a section (``PrivacyConfig``, ``LocalTraining`` and the ``*Settings`` of :mod:`fed_dp.run_schema`) is a
run-configuration key when it is declared with :func:`setting`: its Python default is the key's default, and its
metadata holds the key's meaning and, for text keys, its choices. :func:`keys_of` reads a section back as
:class:`Key` rows (``fed_dp.run_schema.KEYS``), from which the Flower run-config table and the configuration
reference are generated, so each default, meaning and choice list is written once.

A key whose default is None is *optional*: unset unless given. A Flower run config cannot leave a key out, so
there it holds :data:`UNSET`, the empty string, which no number, flag or valid text of any key is.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

#: What an optional key holds in a Flower run config (or a TOML file) to say "not set": no valid value is "".
UNSET = ""

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, *, help: str, choices: tuple[str, ...] = (),
            config_default: Any = _MISSING) -> Any:
    """A dataclass field that is a run-configuration key.

    default: the key's default (None: optional, unset unless given); a field without one is required in Python.
    help: the key's meaning, as the configuration reference shows it.
    choices: the allowed values of a text key.
    config_default: the default of a text config for a field that Python requires (``privacy.rounds``: 5).
    """
    metadata = {"help": help, "choices": tuple(choices)}
    if config_default is not _MISSING:
        metadata["config_default"] = config_default
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Key:
    """One run-configuration key: ``table.name``, its Python type, default (None: optional, unset unless given),
    meaning and, for text keys, its choices."""

    table: str
    name: str
    kind: type
    default: Any
    doc: str
    choices: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.table}.{self.name}"

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    @property
    def optional(self) -> bool:
        return self.default is None

    @property
    def unset(self) -> str | None:
        """The value that says "not set" in a text config (:data:`UNSET`), or None for a key that is always set."""
        return UNSET if self.optional else None

    @property
    def flower_default(self) -> Any:
        """The value a Flower run config holds for the default (:data:`UNSET` for an optional key)."""
        return UNSET if self.optional else self.default


def _kind(hint: Any) -> type:
    """``int`` of ``int | None``: the one non-None type of a field's annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def keys_of(table: str, section: type) -> tuple[Key, ...]:
    """The keys of ``[table]``: the fields of the dataclass ``section`` declared with :func:`setting`, in order."""
    hints = typing.get_type_hints(section)
    return tuple(
        Key(table, f.name.replace("_", "-"), _kind(hints[f.name]), f.metadata.get("config_default", f.default),
            f.metadata["help"], f.metadata["choices"])
        for f in dataclasses.fields(section) if "help" in f.metadata
    )
