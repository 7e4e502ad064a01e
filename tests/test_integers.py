"""The shared integer check (:mod:`ninfer_kv.schema.integers`) and the one bucket ladder (:func:`ladder_rungs`)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.schema.integers import check_int, int_range, is_int
from ninfer_kv.schema.buckets import ladder_rungs
from ninfer_kv.schema.buckets import ladder


def test_check_int_accepts_python_and_numpy_integers_in_range():
    assert check_int("n", 3, 1) == 3 and type(check_int("n", np.int64(3), 1, 3)) is int
    assert check_int("n", 0, 0, 0) == 0
    assert is_int(np.uint8(1)) and not is_int(True) and not is_int(1.0) and not is_int("1")


@pytest.mark.parametrize(
    "value, maximum, message",
    [
        (0, None, "n=0 is invalid; it must be an integer >= 1"),
        (9, 8, r"n=9 is invalid; it must be an integer in \[1, 8\]"),
        (np.int32(-2), 8, r"n=-2 is invalid; it must be an integer in \[1, 8\]"),
        (True, None, "n=True is invalid; it must be an integer >= 1"),
        (2.0, None, "n=2.0 is invalid; it must be an integer >= 1"),
        ("2", 8, r"n='2' is invalid; it must be an integer in \[1, 8\]"),
    ],
)
def test_check_int_names_the_value_and_the_range(value, maximum, message):
    with pytest.raises(ValueError, match=message):
        check_int("n", value, 1, maximum)


def test_check_int_raises_the_callers_error():
    class Mine(LookupError):
        pass

    with pytest.raises(Mine, match=r"^n 5 an integer in \[1, 4\]$"):
        check_int("n", 5, 1, 4, error=lambda name, value, allowed: Mine(f"{name} {value} {allowed}"))
    assert int_range(0) == "an integer >= 0" and int_range(1, 2) == "an integer in [1, 2]"


def test_one_ladder():
    assert ladder_rungs(1, 2, 9) == [1, 2, 4, 8, 9] and ladder_rungs(8, 8, 8) == [8] and ladder_rungs(8, 8, 4) == [4]
    assert ladder(8, 8, 100) == (0, 8, 64, 100) and ladder(1, 2, 0) == (0,) and ladder(1, 2, -3) == (0,)
