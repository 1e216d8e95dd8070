"""Communication and diagnosis: every collective flatshard issues, the groups it issues them
on, and what happens when ranks stop agreeing.

Collectives as free functions taking a ``Tag`` (``_collectives``), shard/replicate groups and
strategies (``_mesh``), the watchdog with its settings (``Checks``), timed waits, store
agreement and hang diagnosis (``_watchdog``, ``_diagnosis``), how ranks agree: rank
helpers, the lines-agree protocol, rank 0 checks then broadcasts, and the per-step
collective digest (``_agreement``), the errors (``_errors``), and local processes that
start fast (``_processes``).

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
