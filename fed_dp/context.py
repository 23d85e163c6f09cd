"""Where code runs: a simulation, or a real deployment. Non-private baselines exist only in simulations.

Engines that simulate federated training enter ``simulation()``; anything not private (the noiseless
preconditioner baseline of docs/explanation/server-optimizers.md) calls ``require_simulation`` when it is built, so it cannot be
constructed in a deployment.
"""

from __future__ import annotations

import contextlib
import math
import contextvars
from collections.abc import Iterator

_IN_SIMULATION: contextvars.ContextVar[bool] = contextvars.ContextVar("fed_dp_in_simulation", default=False)


@contextlib.contextmanager
def simulation() -> Iterator[None]:
    """Mark the enclosed code as a simulation (research runs on data the researcher already holds)."""
    token = _IN_SIMULATION.set(True)
    try:
        yield
    finally:
        _IN_SIMULATION.reset(token)


def in_simulation() -> bool:
    return _IN_SIMULATION.get()


def require_simulation(what: str) -> None:
    """Raise unless inside ``simulation()``: ``what`` is not private and must never run in a deployment."""
    if not in_simulation():
        raise RuntimeError(
            f"{what} is NOT differentially private and exists only as a research baseline in "
            "simulations; build it inside fed_dp.context.simulation()"
        )


NOT_PRIVATE = "not private"


def reported_epsilon(epsilon: float, private: bool) -> float | str:
    """ε as results should show it: the number for private runs, ``"not private"`` for the noiseless optimizers
    and for an infinite ε (``noise_multiplier = 0``): never a number, and never JSON's non-standard Infinity."""
    return epsilon if private and math.isfinite(epsilon) else NOT_PRIVATE
