"""The configs of ``fed-dp simulate``, ``compare`` and ``audit``: a built-in one (``simulations/configs/NAME.toml``)
or a TOML file, and its names checked before anything heavy is loaded.

A config is a run configuration (``fed_dp.run_config``) plus two experiment keys: ``run.optimizers = [names]`` and
``[optimizers.NAME]`` tables of each optimizer's hyper-parameters (``fed_dp.simulations.experiments.runner``).
:func:`check_config_names` checks every table, key and optimizer name of such a config without importing torch, so
that a mistyped ``--set`` key is reported at once, before PyTorch loads (which took 13–29 s on a cold machine).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from fed_dp.run_config import KEYS, OPTIMIZER_NAMES, check_names, unknown_names

__all__ = ["DEFAULT_CONFIG", "check_config_names", "load_config"]

#: The config of ``fed-dp simulate`` without one: the main job.
DEFAULT_CONFIG = "main-job"

#: The keys of an ``[optimizers.NAME]`` table: those of ``[optimizer]`` but its name.
OPTIMIZER_TABLE_KEYS = tuple(key.name for key in KEYS if key.table == "optimizer" and key.name != "name")


def load_config(path: str | Path | None) -> dict[str, Any]:
    """Read a TOML config; ``None`` is the built-in default, a bare name one of ``simulations/configs``."""
    if path is None:
        path = DEFAULT_CONFIG
    path_str = str(path)
    if not path_str.endswith(".toml") and "/" not in path_str:
        resource = resources.files("fed_dp.simulations") / "configs" / f"{path_str}.toml"
        if not resource.is_file():
            names = sorted(p.name[:-5] for p in (resources.files("fed_dp.simulations") / "configs").iterdir()
                           if p.name.endswith(".toml"))
            raise ValueError(f"no built-in config {path_str!r}; built-in configs: {', '.join(names)}")
        return tomllib.loads(resource.read_text(encoding="utf-8"))
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {file} does not exist")
    return tomllib.loads(file.read_text(encoding="utf-8"))


def check_config_names(config: Mapping[str, Any]) -> None:
    """The names of an experiment config, without loading torch: its run configuration's tables and keys
    (:func:`fed_dp.run_config.check_names`), the optimizers of ``run.optimizers`` and of the ``[optimizers.NAME]``
    tables, and those tables' keys. A ValueError names each unknown one with the closest known name."""
    tables = dict(config)
    hyper = tables.pop("optimizers", {})
    run = tables.get("run", {})
    if isinstance(run, Mapping) and "optimizers" in run:
        names = run["optimizers"]
        tables["run"] = {key: value for key, value in run.items() if key != "optimizers"}
        if isinstance(names, list):
            unknown_names([str(n) for n in names], OPTIMIZER_NAMES, "optimizer(s) in run.optimizers",
                          f"choose from {', '.join(OPTIMIZER_NAMES)}")
    check_names(tables)
    if not isinstance(hyper, Mapping):
        raise ValueError(f"[optimizers] must hold one table per optimizer ([optimizers.NAME]), got {hyper!r}")
    unknown_names([f"optimizers.{name}" for name in hyper], [f"optimizers.{name}" for name in OPTIMIZER_NAMES],
                  "optimizer table(s)", f"choose from {', '.join(OPTIMIZER_NAMES)}")
    for name, table in hyper.items():
        if not isinstance(table, Mapping):
            raise ValueError(f"[optimizers.{name}] must be a table of keys, got {table!r}")
        unknown_names([f"optimizers.{name}.{key}" for key in table],
                      [f"optimizers.{name}.{key}" for key in OPTIMIZER_TABLE_KEYS], "key(s)",
                      f"[optimizers.{name}] has {', '.join(OPTIMIZER_TABLE_KEYS)}")
