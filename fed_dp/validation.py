"""Argument checks shared across the project: each raises ValueError with a message naming the argument."""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` as an int, if it is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_int_range(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int, if it is an integer (not a bool; numpy's too) with ``low ≤ value ≤ high`` (``high``
    None: no upper bound). The strategy matrices' sizes (``fed_dp.factorization``, ``fed_dp.blt``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        allowed = f"{low} ≤ {name}" + (f" ≤ {high}" if high is not None else "")
        raise ValueError(f"{name} must satisfy {allowed}, got {value}")
    return value


def check_momentum(momentum: object) -> float:
    """``momentum`` as a float, if it is a real number (not a bool; numpy's too) with 0 ≤ momentum < 1: the
    momentum β of a workload matrix (``fed_dp.factorization``, ``fed_dp.blt``)."""
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise ValueError(f"momentum must be a real number with 0 ≤ momentum < 1, got {momentum!r}")
    momentum = float(momentum)
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must satisfy 0 ≤ momentum < 1, got {momentum}")
    return momentum


def check_positive(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite real number (not a bool) > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_nonnegative(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite real number (not a bool) >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


#: The largest seed: seeds reach torch's generators, which take a signed 64-bit integer (OS-entropy seeds and
#: ``fed_dp.randomness.derive_seed``'s are 63-bit).
MAX_SEED = 2**63 - 1


def check_seed(name: str, value: object) -> int | None:
    """``value`` if it is None (no seed: OS entropy) or an integer (not a bool) in 0 … :data:`MAX_SEED`; a seed of
    10²⁰ would otherwise fail deep in torch with "Overflow when unpacking long long"."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                              or not 0 <= value <= MAX_SEED):
        raise ValueError(f"{name} must be an integer >= 0 and <= 2^63 − 1 = {MAX_SEED} (or unset: OS entropy), got {value!r}")
    return None if value is None else int(value)


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)


def is_int(value: object) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
