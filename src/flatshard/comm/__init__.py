"""Communication and diagnosis: every collective flatshard issues, the groups it issues them
on, and what happens when ranks stop agreeing.

Collectives as free functions taking a ``Tag`` (``_collectives``), shard/replicate groups and
strategies (``_mesh``), the watchdog with its timed waits, store agreement and hang
diagnosis (``_watchdog``, ``_diagnosis``, ``_record``), the per-step collective digest
(``_ledger``), the lines-agree protocol (``_agreement``), rank helpers and the rank-0
check-then-broadcast protocol (``_ranks``), the errors (``_errors``), and local processes
that start fast (``_processes``).

Layer 1: imports only ``flatshard.measure``-level code and torch. The names below are what
the layers above the library (the facade and the CLI) may use.
"""

from flatshard.comm._checks import Checks, set_checks
from flatshard.comm._collectives import (
    ReduceScatter,
    WaitClock,
    describe,
    reduce_scatter_impl,
    split_division,
    sum_reduce,
)
from flatshard.comm._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    SlowCollectiveWarning,
)
from flatshard.comm._mesh import (
    ShardGroups,
    ShardingStrategy,
    not_a_strategy,
    strategy_names,
    strategy_table,
)
from flatshard.comm._processes import exit_without_teardown, fast_context
from flatshard.comm._ranks import global_rank

__all__ = [
    "Checks",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "ReduceScatter",
    "ShardGroups",
    "ShardingStrategy",
    "SlowCollectiveWarning",
    "WaitClock",
    "describe",
    "exit_without_teardown",
    "fast_context",
    "global_rank",
    "not_a_strategy",
    "reduce_scatter_impl",
    "set_checks",
    "split_division",
    "strategy_names",
    "strategy_table",
    "sum_reduce",
]
