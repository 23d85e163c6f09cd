"""Follow the run config from ``fed-dp simulate`` to the first private round: which of the package's functions
receive a configuration object on the way, in which files, and whether any of them is called from a lower layer
(core ← clients ← server ← simulations) — a "climb", which the import test cannot see because it happens through
an object or callback handed down.

A stop is a call of a function of the package one of whose arguments is a configuration object (a ``RunConfig``,
one of its sections, a ``PrivacyConfig``, ``LocalTraining``, the ``RunPlan`` built from them, the TOML tables of a
config), traced with
``sys.setprofile`` from the command's entry until ``fed_dp.round.begin_round`` of the first round; dunder methods
and ``dataclasses.replace`` are not counted as functions of their own. Run it to print the stops::

    python tests/follow_config.py [simulate arguments]     # default: the main job, one round

(the legibility measure of the layers' refactor; ``test_architecture.py`` checks that nothing climbs).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass

#: Module prefix → layer rank (the most specific prefix first).
LAYERS = (("fed_dp.simulations", 3), ("fed_dp.server", 2), ("fed_dp.clients", 1), ("fed_dp", 0))


def layer(module: str) -> int | None:
    """The layer rank of ``module``, or None outside the package."""
    return next((rank for prefix, rank in LAYERS if module == prefix or module.startswith(prefix + ".")), None)


def _is_config(value: object) -> bool:
    name = type(value).__name__
    return name.endswith(("Config", "Settings", "Training", "Plan")) or (isinstance(value, dict) and "privacy" in value)


@dataclass(frozen=True)
class Stop:
    module: str
    function: str
    caller: str

    @property
    def climbs(self) -> bool:
        """Called from a lower layer than its own."""
        caller = layer(self.caller)
        return caller is not None and layer(self.module) > caller


def follow(arguments: list[str]) -> list[Stop]:
    """The stops of ``fed-dp simulate <arguments>`` up to the first round, in call order, consecutive repeats of
    one function (a loop over keys) counted once."""
    from fed_dp.simulations.cli import main

    stops: list[Stop] = []
    done = False

    def profile(frame, event, _arg):
        nonlocal done
        if done or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if layer(module) is None:
            return
        code = frame.f_code
        if module == "fed_dp.round" and code.co_name == "begin_round":
            done = True
            sys.setprofile(None)  # the rest of the run untraced
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(_is_config(frame.f_locals.get(name)) for name in names):
            stop = Stop(module, code.co_name, frame.f_back.f_globals.get("__name__", ""))
            if not stops or (stops[-1].module, stops[-1].function) != (stop.module, stop.function):
                stops.append(stop)

    out = tempfile.mkdtemp(prefix="follow-config-")
    sys.setprofile(profile)
    try:
        main(["simulate", *arguments, "--out", out, "--no-plot", "--quiet"])
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        shutil.rmtree(out, ignore_errors=True)
    return stops


def functions(stops: list[Stop]) -> list[tuple[str, str]]:
    """The distinct functions among ``stops`` in first-visit order, without dunders and ``replace``."""
    seen: list[tuple[str, str]] = []
    for stop in stops:
        key = (stop.module, stop.function)
        if not stop.function.startswith("__") and stop.function != "replace" and key not in seen:
            seen.append(key)
    return seen


if __name__ == "__main__":
    found = follow(sys.argv[1:] or ["--set", "privacy.rounds=1"])
    named = functions(found)
    for module, function in named:
        print(f"    {module}.{function}")
    print(f"{len(named)} functions in {len({m for m, _ in named})} files receive the config; "
          f"{sum(s.climbs for s in found)} calls climb a layer")
