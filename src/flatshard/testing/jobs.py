"""Small helpers shared by the jobs that tests run on the worker pool."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.testing.models import build
from flatshard.testing.parity import slice_batch
from flatshard.testing.workers import WorkerContext


def sharded(name: str, ctx: WorkerContext, world_size: int, **options: Any) -> nn.Module | None:
    """Test model ``name`` sharded over the first ``world_size`` ranks, its unit classes
    as units (None on ranks outside the group)."""
    group = ctx.group(world_size)
    if group is None:
        return None
    model = build(name)
    return flatshard.fully_shard(
        model, auto_wrap_policy=set(cast(Any, model).UNIT_CLASSES), process_group=group, **options
    )


def loss_backward(model: Any, batch: Any, rank: int, world_size: int) -> torch.Tensor:
    """Forward and backward on this rank's slice of ``batch``; returns the loss."""
    loss: torch.Tensor = model.loss(slice_batch(batch, rank, world_size))
    torch.autograd.backward(loss)
    return loss


def shard_units(model: nn.Module, group: dist.ProcessGroup, strategy: str) -> nn.Module:
    """``model`` sharded over ``group`` with ``strategy`` (a ShardingStrategy name; hybrid
    ones with F = 2), its unit classes as units."""
    options: dict[str, Any] = {"strategy": flatshard.ShardingStrategy[strategy]}
    if options["strategy"].is_hybrid:
        options["sharding_factor"] = 2
    return flatshard.fully_shard(
        model, auto_wrap_policy=set(cast(Any, model).UNIT_CLASSES), process_group=group, **options
    )
