"""flatshard's bench figures by formula, for the scaling table (``flatshard bench --scaling``).

Between steps a rank keeps its FlatParameter shards, Adam's two moments for its rows of
each trainable parameter, and the buffers (Adam's step counters are made by
``torch.tensor()``, outside the dispatcher the memory pass tracks: not counted either side).
Per steady-state step (FULL_SHARD, default prefetch), with u the unsharded bytes of a
FlatParameter: every one is gathered in forward; in backward all but the root's and the
last block's (kept gathered from forward) again; each trainable one is reduced once (the
bytes counted are each collective's output: u for an all-gather and for gloo's all-to-all
reduction, the shard for a reduce-scatter); the step check gathers 8 bytes per rank. At
one rank nothing is sent.
"""

from __future__ import annotations

from typing import cast

import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.comm import ReduceScatter, reduce_scatter_impl

STEP_CHECK_BYTES = 8


def flatshard_formulas(model: nn.Module, layers: int, world: int) -> dict[str, int]:
    """Expected "at rest" bytes and collective output bytes per step for this rank."""
    summary = flatshard.sharding_summary(model)
    item = next(model.parameters()).element_size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    buffers = {
        b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()
    }
    rest = sum(buffers.values()) + item * sum(f.shard_numel for f in summary.flat_params)
    rest += 2 * sum(p.numel() * p.element_size() for p in trainable)
    kept = ("<root>", f"blocks.{layers - 1}")
    gathered = 0
    reduced = 0
    group = cast(dist.ProcessGroup, dist.group.WORLD)  # the bench shards over the world
    full_output = reduce_scatter_impl(group) == ReduceScatter.ALL_TO_ALL
    for flat in summary.flat_params:
        unsharded = item * flat.shard_numel * world
        gathered += unsharded * (1 if flat.unit in kept else 2)
        if flat.requires_grad:
            reduced += unsharded if full_output else item * flat.shard_numel
    if world == 1:  # one rank: nothing to send, no collective at all
        return {"rest": rest, "collective": 0}
    return {"rest": rest, "collective": gathered + reduced + STEP_CHECK_BYTES * world}
