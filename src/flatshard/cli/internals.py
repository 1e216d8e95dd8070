"""The one place the CLI reaches into the library's private modules.

The library's subpackages export what docs/guide.md documents, nothing more. What the
commands need beyond that is plumbing, not API: how processes start and end without a
teardown race, the strategy listing of ``--help``, which reduce-scatter form a backend
gets and the clock of exposed waits (``bench``), the checkpoint directory's format
(``ckpt``), the planner's wording and allocator slack, the last units kept gathered
(``--keep-gathered``), the placement rule of ``--optimizer`` and ``--row-sparse-tables``.
It is imported from here, so that ``tests/test_layers.py`` can hold every other CLI
module to the public surfaces (as ``flatshard.testing.internals`` is for tests).
"""

from flatshard.comm._collectives import ReduceScatter, WaitClock, reduce_scatter_impl
from flatshard.comm._mesh import not_a_strategy, strategy_names
from flatshard.comm._processes import (
    CallerOutput,
    adopt_environment,
    exit_without_teardown,
    fast_context,
)
from flatshard.flat._partition import AutoWrapPolicy
from flatshard.flat._placement import PlacementRule, WholeChoice, placement_rule
from flatshard.placements._experts import TokenBytes
from flatshard.planner._plan import ALLOCATOR_SLACK
from flatshard.planner._recommend import kept_phrase
from flatshard.runtime._optimizer_steps import muon_matrices
from flatshard.sharding._keep_gathered import shard_keeping_last
from flatshard.state._checkpoint import (
    EXTRA,
    GROUPS,
    MODEL,
    OPTIM,
    checkpoint_metadata,
    is_tensor_entry,
    load_raw,
    verify_files,
)
from flatshard.state._directory import read_manifest
from flatshard.state._export import DEFAULT_SHARD_BYTES

__all__ = [
    "ALLOCATOR_SLACK",
    "DEFAULT_SHARD_BYTES",
    "EXTRA",
    "GROUPS",
    "MODEL",
    "OPTIM",
    "AutoWrapPolicy",
    "CallerOutput",
    "PlacementRule",
    "ReduceScatter",
    "TokenBytes",
    "WaitClock",
    "WholeChoice",
    "adopt_environment",
    "checkpoint_metadata",
    "exit_without_teardown",
    "fast_context",
    "is_tensor_entry",
    "kept_phrase",
    "load_raw",
    "muon_matrices",
    "not_a_strategy",
    "placement_rule",
    "read_manifest",
    "reduce_scatter_impl",
    "shard_keeping_last",
    "strategy_names",
    "verify_files",
]
