"""How ``loongforge list`` prints a model's size, shared by every family's one-line description (torch-free).

One format for all of them, so sizes read alike whichever plugin registered the model: billions with two decimals
from 1e9 parameters up, millions with two decimals below (tiny test models sit at a few million, where one decimal
would hide the difference between flavors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def size_label(count: int) -> str:
    """``count`` parameters as ``"7.62B"`` or ``"3.07M"``."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def count_of_shapes(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The parameters in a table of parameter shapes: families that state their shapes torch-free (for state-dict
    checks) count from the same table, so a listing never builds a model."""
    return sum(math.prod(shape) for shape in shapes.values())
