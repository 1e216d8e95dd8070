"""Which rank this is, names joined the same way everywhere, and the rank-0 protocol.

[Note: check on rank 0, then broadcast]
Loading a dict that only rank 0 holds (``from_rank0=True``) must fail on every rank alike,
or the others would wait in the broadcasts that follow. Rank 0 checks and describes what it
will send; that verdict (an error message, or the description) is broadcast first, and
every rank raises the same error or goes on with the same description.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch.distributed as dist

from flatshard.comm._collectives import broadcast_object_list

T = TypeVar("T")


def global_rank() -> int:
    """This process's rank in the world (0 without torch.distributed), for messages."""
    return dist.get_rank() if dist.is_initialized() else 0


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 for None: no group, one rank)."""
    return dist.get_rank(group) if group is not None else 0


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or either alone when the other is empty (module names)."""
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def checked_on_rank0(group: dist.ProcessGroup, check: Callable[[], T]) -> T:
    """Run ``check`` on rank 0 of ``group`` and give its result to every rank.

    A ``ValueError`` raised by ``check`` is raised on every rank (see the note above).
    """
    verdict: list[object] = [None, None]  # (error message, result)
    if dist.get_rank(group) == 0:
        try:
            verdict = [None, check()]
        except ValueError as error:
            verdict = [str(error), None]
    broadcast_object_list(verdict, group_src=0, group=group)
    if verdict[0] is not None:
        raise ValueError(f"{verdict[0]} (checked on rank 0)")
    return cast(T, verdict[1])
