"""A gathered buffer never outlives a write to its shards (see [Note: stale gathers]).

Forward prefetch (on by default) gathers the unit it predicts will run next. A forward with
no backward (one unit called alone under ``no_grad``, an eval call) could leave such a
gather unused; a forward with grad but no backward leaves the root and the last unit
gathered. ``optimizer.step()`` then writes the shards, and the next forward used to compute
on the gathered pre-step copy: silently wrong. Each case is compared with an unsharded
model that takes the same steps; fused optimizers (which write the parameters without
bumping their version counters) too, and an update written by hand (no optimizer at all).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn

from flatshard.measure import CollectiveTracker
from flatshard.testing.jobs import shard_units
from flatshard.testing.models import build
from flatshard.testing.parity import make_optimizer, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool


def _sequence(model: nn.Module, case: str, rank: int, parts: int) -> list[float]:
    """Train two steps with a side call between them; every rank its slice of the batch."""
    m: Any = model
    optim = make_optimizer(model, 1e-2)
    if case.endswith("fused"):  # one kernel writes the parameters and bumps no counter
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]} for g in optim.param_groups
        ]
        optim = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(3)
    batches = [m.make_batch(gen, 8) for _ in range(3)]
    losses = []
    for step, batch in enumerate(batches):
        loss = m.loss(slice_batch(batch, rank, parts))
        loss.backward()
        losses.append(loss.item())
        if step == 1:  # after an order to prefetch from; before the step writes the shards
            _side_call(m, batches[2], case)
        if case.endswith("by hand"):  # no torch optimizer: nothing flatshard sees writes
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-0.5)
                        param.grad = None
            continue
        optim.step()
        optim.zero_grad()
    return losses


def _side_call(m: Any, batch: Any, case: str) -> None:
    if case == "unit alone":  # gathers block 0 and prefetches block 1, which never runs
        x = torch.randn(2, m.seq_len, m.tok.embedding_dim, generator=torch.Generator())
        with torch.no_grad():
            m.blocks[0](x)
    elif case == "no_grad forward":
        with torch.no_grad():
            m(batch[0])
    elif case.startswith("forward without backward"):  # keeps the root and last block gathered
        m.loss(batch)


def stale_job(ctx: WorkerContext, case: str) -> list[float] | None:
    group = ctx.group(2)
    if group is None:
        return None
    sharded = _sequence(shard_units(build("gpt"), group, "FULL_SHARD"), case, ctx.rank, 2)
    mean = torch.tensor(sharded)
    torch.distributed.all_reduce(mean, group=group)
    return cast(list[float], (mean / 2).tolist())


@pytest.mark.parametrize(
    "case",
    [
        "unit alone",
        "no_grad forward",
        "forward without backward",
        "forward without backward, fused",  # the Hugging Face Trainer's default optimizer
        "forward without backward, update by hand",
    ],
)
def test_no_gather_survives_a_step(pool: WorkerPool, case: str) -> None:
    reference = _sequence(build("gpt"), case, 0, 1)
    for losses in pool.run(stale_job, case)[:2]:
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)


def unit_alone_memory_job(ctx: WorkerContext) -> int | None:
    group = ctx.group(2)
    if group is None:
        return None
    m: Any = shard_units(build("gpt"), group, "FULL_SHARD")
    for _ in range(2):  # the second forward prefetches from the first one's order
        m.loss(m.make_batch(torch.Generator().manual_seed(0), 4)).backward()
    tracker = CollectiveTracker()
    x = torch.randn(2, m.seq_len, m.tok.embedding_dim, generator=torch.Generator())
    with torch.no_grad(), tracker:
        m.blocks[0](x)  # gathers block 0 and prefetches block 1
    return tracker.gathered_bytes()


def test_unused_prefetch_is_freed_when_a_forward_ends(pool: WorkerPool) -> None:
    # No backward follows a no_grad call, so nothing it gathered may stay alive after it.
    assert pool.run(unit_alone_memory_job)[:2] == [0, 0]
