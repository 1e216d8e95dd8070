"""keep_gathered: a model's last units sharded in the strategy's ZeRO-2 form.

Backward reaches the last units of forward first; kept gathered from forward to backward
(SHARD_GRAD_OP for FULL_SHARD, HYBRID_SHARD_ZERO2 for HYBRID_SHARD), they need no
all-gather there, for their memory. ``flatshard train --keep-gathered``, ``flatshard.plan``
and the parity tests shard this way.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flatshard.comm._mesh import ShardingStrategy
from flatshard.flat._partition import last_units
from flatshard.sharding._fully_shard import fully_shard


def shard_keeping_last(model: nn.Module, kept: int, **options: Any) -> nn.Module:
    """``fully_shard(model, **options)``, its last ``kept`` units sharded first in the
    strategy's form that keeps them gathered from forward to backward."""
    strategy: ShardingStrategy = options["strategy"]
    if kept and strategy.kept_gathered is None:
        raise ValueError(
            f"keep_gathered applies to FULL_SHARD and HYBRID_SHARD, not {strategy.name}"
        )
    for unit in last_units(model, options["auto_wrap_policy"], kept):
        unit_options = {**options, "auto_wrap_policy": None, "strategy": strategy.kept_gathered}
        fully_shard(unit, **unit_options)
    return fully_shard(model, **options)
