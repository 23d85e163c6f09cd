"""The shared argument checks (fed_dp.validation): what each accepts, what it returns, and the message of a refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fed_dp.validation import check_int, check_int_range, check_momentum, check_nonnegative, check_positive


def test_check_int_takes_python_and_numpy_integers_and_returns_an_int():
    assert check_int("rounds", 3, minimum=1) == 3
    value = check_int("rounds", np.int64(7), minimum=1)
    assert value == 7 and type(value) is int


@pytest.mark.parametrize("value, message", [
    (True, "rounds must be an integer >= 1, got True"),     # a bool is not a count
    (2.0, "rounds must be an integer >= 1, got 2.0"),
    ("3", "rounds must be an integer >= 1, got '3'"),
    (0, "rounds must be an integer >= 1, got 0"),
])
def test_check_int_refuses_what_is_not_an_integer_at_least_the_minimum(value, message):
    with pytest.raises(ValueError, match=f"^{message.replace('(', '[(]')}$"):
        check_int("rounds", value, minimum=1)


def test_check_positive_and_check_nonnegative_differ_only_at_zero():
    assert check_positive("alpha", 0.5) == 0.5 and check_nonnegative("exponent", 0) == 0.0
    assert type(check_nonnegative("exponent", 2)) is float
    with pytest.raises(ValueError, match="^alpha must be a finite number > 0, got 0$"):
        check_positive("alpha", 0)
    for bad in (-1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="^exponent must be a finite number >= 0, got "):
            check_nonnegative("exponent", bad)


def test_the_strategy_size_and_momentum_checks():
    assert check_int_range("bands", np.int32(4), 1, 8) == 4
    with pytest.raises(ValueError, match="bands must satisfy 1 ≤ bands ≤ 8, got 9"):
        check_int_range("bands", 9, 1, 8)
    assert check_momentum(0) == 0.0
    with pytest.raises(ValueError, match="momentum must satisfy 0 ≤ momentum < 1, got 1.0"):
        check_momentum(1)
