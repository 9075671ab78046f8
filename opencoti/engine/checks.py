"""Type checks shared by the validated settings dataclasses (config, tps windows, admission policy)."""

from __future__ import annotations

import math


def is_number(x) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)
