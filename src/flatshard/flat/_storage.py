"""The states of a flat parameter group's storage, and the moves between them.

A group's unsharded buffer is in one ``Storage`` state, and its originals' module entries
hold one ``Holding``: together what the group holds right now. Only ``FlatParamGroup``
changes them; a move outside ``_STORAGE_MOVES`` is a flatshard bug and raises, naming the
group and both states. docs/design.md ("Unit state") has the table with the unit's own.
"""

from __future__ import annotations

from enum import Enum, auto

from flatshard.comm._ranks import global_rank


class Storage(Enum):
    """What a group's unsharded buffer holds. Only the group's own methods change it, along
    ``_STORAGE_MOVES``; an F = 1 group in the master dtype (``aliases_shard``) is always
    GATHERED: its shard is the buffer."""

    SHARDED = auto()  # no memory: this rank's shard is all there is
    GATHERING = auto()  # an all-gather into the buffer is in flight (prefetch)
    GATHERED = auto()  # every rank's rows, as of the shard generation it was gathered at


class Holding(Enum):
    """What the modules' parameter entries of a group's originals hold."""

    ORIGINALS = auto()  # the original parameters: this rank's rows (between steps)
    VIEWS = auto()  # views of the gathered buffer (while the unit runs, or is summoned)
    PROXY = auto()  # a row-sparse table's lookup proxy ([Note: row-sparse embedding tables])


_STORAGE_MOVES = {
    Storage.SHARDED: {Storage.GATHERING, Storage.GATHERED},
    Storage.GATHERING: {Storage.GATHERED},
    Storage.GATHERED: {Storage.SHARDED},
}


def storage_move(now: Storage, to: Storage, name: str) -> Storage:
    """``to``, if a group may go there from ``now``; else an error naming the group by its
    first parameter ``name``."""
    if to not in _STORAGE_MOVES[now]:
        raise RuntimeError(
            f"flatshard: internal error: the flat parameter group of '{name}' (rank "
            f"{global_rank()}) cannot go from {now.name} to {to.name}; please report it "
            "with the traceback"
        )
    return to
