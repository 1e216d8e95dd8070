"""flatshard's bench figures by formula, for the scaling table (``flatshard bench --scaling``).

Between steps a rank keeps its FlatParameter shards, the optimizer's state for its rows of
each trainable parameter (AdamW: two moments; Muon: one momentum buffer; Adafactor: the
row and column statistics of each matrix, or one variance per element of a vector; with
whole parameters a rank's rows are all or none of each), and the buffers (the optimizers'
step counters are made by ``torch.tensor()``, outside the dispatcher the memory pass tracks:
not counted either side).
Per steady-state step (FULL_SHARD, default prefetch), with u the unsharded bytes of a
FlatParameter (its shard times the ranks F it is cut across: W, or W / ep for experts):
every one is gathered in forward; in backward all but the root's and the last block's
(kept gathered from forward) again; each trainable one is reduced once (the bytes counted
are each collective's output: u for an all-gather and for gloo's all-to-all reduction,
the shard for a reduce-scatter); the step check gathers 8 bytes per rank. At one rank
nothing is sent. Experts' token all-to-alls depend on the routing: not here.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.cli.internals import ReduceScatter, reduce_scatter_impl

STEP_CHECK_BYTES = 8


def flatshard_formulas(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], layers: int, world: int
) -> dict[str, int]:
    """Expected "at rest" bytes and collective output bytes per step for this rank."""
    summary = flatshard.sharding_summary(model)
    item = next(model.parameters()).element_size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    buffers = {
        b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()
    }
    rest = sum(buffers.values()) + item * sum(f.shard_numel for f in summary.flat_params)
    kinds = {id(p): type(o) for o in optimizers for g in o.param_groups for p in g["params"]}
    rest += sum(_state_numel(p, kinds[id(p)]) * p.element_size() for p in trainable)
    kept = ("<root>", f"blocks.{layers - 1}")
    gathered = 0
    reduced = 0
    group = cast(dist.ProcessGroup, dist.group.WORLD)  # the bench shards over the world
    full_output = reduce_scatter_impl(group) == ReduceScatter.ALL_TO_ALL
    for flat in summary.flat_params:
        if flat.factor == 1:
            continue  # a group of one rank (experts split across all of them): not sent
        unsharded = item * flat.shard_numel * flat.factor
        gathered += unsharded * (1 if flat.unit in kept else 2)
        if flat.requires_grad:
            reduced += unsharded if full_output else item * flat.shard_numel
    parts = {"gathered": gathered, "reduced": reduced, "check": STEP_CHECK_BYTES * world}
    if world == 1:  # one rank: nothing to send, no collective at all
        return {"rest": rest, "collective": 0, **dict.fromkeys(parts, 0)}
    if flatshard.embedding_traffic(model):  # row-sparse tables: bytes depend on the tokens
        return {"rest": rest, "collective": -1, **parts}
    return {"rest": rest, "collective": sum(parts.values()), **parts}


def _state_numel(param: torch.Tensor, kind: type[torch.optim.Optimizer]) -> int:
    """Elements of optimizer state ``kind`` keeps for this rank's rows of ``param``."""
    if kind is torch.optim.Muon:
        return param.numel()
    if kind is torch.optim.Adafactor:
        if param.dim() < 2 or param.numel() == 0:
            return param.numel()
        rows, cols = param.shape[-2], param.shape[-1]
        return param.numel() // cols + param.numel() // rows
    return 2 * param.numel()
