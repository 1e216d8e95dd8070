"""Exact accounting on CPU, below flatshard: collectives counted and storage tracked at the
dispatcher. ``flatshard bench``, ``flatshard train --predict``, the planner and the tests
measure memory and communication with these. (The profiler ranges the runtime's work runs
in, ``flatshard::<phase> <unit>``, are entered from here too.)

Layer 0: imports nothing of flatshard.
"""

from flatshard.measure._accounting import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    RECV,
    REDUCE_SCATTER,
    SEND,
    STEP_CHECK,
    STEP_CHECK_BYTES,
    CollectiveTracker,
    PeakStorage,
    distinct_storage_bytes,
)

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "RECV",
    "REDUCE_SCATTER",
    "SEND",
    "STEP_CHECK",
    "STEP_CHECK_BYTES",
    "CollectiveTracker",
    "PeakStorage",
    "distinct_storage_bytes",
]
