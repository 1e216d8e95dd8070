"""Prefetch: issue the next unit's all-gather before it is needed (paper mechanisms 5, 6).

Backward runs units in about the reverse of forward order, so the next unit to gather in
backward is predicted from the order recorded in this iteration's forward; forward
prefetch uses the previous iteration's order (static graphs). A wrong prediction only keeps
a unit gathered longer: it costs memory, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TypeVar

T = TypeVar("T")


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued in backward."""

    # In the current unit's pre-backward, before its reduce-scatter: most overlap; two
    # units' parameters are gathered at once.
    BACKWARD_PRE = "backward_pre"
    # After the current unit's gradient reduction is issued: less memory, less overlap.
    BACKWARD_POST = "backward_post"


def following(order: Sequence[T], current: T, step: int) -> T | None:
    """The item ``step`` places after ``current`` in ``order`` (None at either end)."""
    for i, item in enumerate(order):
        if item is current:
            j = i + step
            return order[j] if 0 <= j < len(order) else None
    return None
