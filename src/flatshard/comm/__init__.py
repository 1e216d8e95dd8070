"""Communication and diagnosis: every collective flatshard issues, the groups it issues them
on, and what happens when ranks stop agreeing.

Collectives as free functions taking a ``Tag`` (``_collectives``), shard/replicate groups and
strategies (``_mesh``), the watchdog with its timed waits, store agreement and hang
diagnosis (``_watchdog``, ``_diagnosis``, ``_record``), the per-step collective digest
(``_ledger``), the lines-agree protocol (``_agreement``), rank helpers and the rank-0
check-then-broadcast protocol (``_ranks``), the errors (``_errors``), and local processes
that start fast (``_processes``).

Layer 1: imports only ``flatshard.measure``-level code and torch. The names below are the
documented API; the CLI's plumbing comes through ``flatshard.cli.internals``.
"""

from flatshard.comm._collectives import split_division
from flatshard.comm._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    SlowCollectiveWarning,
)
from flatshard.comm._mesh import ShardGroups, ShardingStrategy
from flatshard.comm._watchdog import Checks, set_checks

__all__ = [
    "Checks",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "ShardGroups",
    "ShardingStrategy",
    "SlowCollectiveWarning",
    "set_checks",
    "split_division",
]
