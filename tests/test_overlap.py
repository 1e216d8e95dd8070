"""Asynchronous all-gathers, the rate limiter, and collectives that finish late.

``flatshard.testing.delays.delayed_collectives`` makes every collective's result land only
when it is waited for: a run that reads a buffer before waiting sees stale data. Every
prefetch mode, forward prefetch and rate limiter setting must then still give exactly the
same losses and parameters as the undelayed run.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn

import flatshard
from flatshard.report import describe_collectives
from flatshard.testing import internals
from flatshard.testing.delays import delayed_collectives
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    assert_same,
    make_optimizer,
    run_on_time_and_late,
    run_reference,
)
from flatshard.testing.workers import WorkerContext, WorkerPool


def delay_job(ctx: WorkerContext, config: ParityConfig) -> None:
    group = ctx.group(config.world_size)
    if group is None:
        return
    late = run_on_time_and_late(config, group)
    if ctx.rank == 0:
        assert_same(run_reference(config), late)


SWEEP = [
    ParityConfig("gpt", 2, backward_prefetch=prefetch, forward_prefetch=forward, steps=3)
    for prefetch in ("BACKWARD_PRE", "BACKWARD_POST", None)
    for forward in (False, True)
] + [
    ParityConfig("nested", 3, steps=3, forward_prefetch=True),
    ParityConfig("gpt", 2, steps=3, forward_prefetch=True, limit_all_gathers=False),
    ParityConfig("gpt", 4, strategy="HYBRID_SHARD", sharding_factor=2, steps=3),
    ParityConfig("gpt", 2, strategy="SHARD_GRAD_OP", steps=3, micro_batches=2, no_sync=True),
    ParityConfig("frozen", 2, steps=3, checkpoint="inside"),
]


def _name(c: ParityConfig) -> str:
    return (
        f"{c.model}-w{c.world_size}-{c.strategy}-{c.backward_prefetch}"
        f"-fwd{int(c.forward_prefetch)}-limit{int(c.limit_all_gathers)}"
    )


@pytest.mark.parametrize("config", SWEEP, ids=_name)
def test_late_collectives_change_nothing(pool: WorkerPool, config: ParityConfig) -> None:
    pool.run(delay_job, config)


def _sharded_gpt(group: Any, **options: Any) -> nn.Module:
    model = build("gpt")
    classes = set(cast(Any, model).UNIT_CLASSES)
    return flatshard.fully_shard(model, auto_wrap_policy=classes, process_group=group, **options)


def limiter_job(ctx: WorkerContext, limit: bool) -> dict[str, Any] | None:
    """The root prefetches all three blocks when forward starts: 3 gathers ahead at once."""
    group = ctx.group(2)
    if group is None:
        return None
    model = _sharded_gpt(group, prefetch=flatshard.Prefetch(limit_all_gathers=limit))
    blocks = cast(nn.ModuleList, cast(Any, model).blocks)
    flatshard.set_prefetch(model, forward=list(blocks))
    optim = make_optimizer(model, 1e-2)
    batch = cast(Any, model).make_batch(torch.Generator().manual_seed(0), 8)
    losses = []
    with delayed_collectives(0.002):
        for _ in range(2):
            loss = cast(Any, model).loss(batch)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    return {"ahead": internals.rate_limiter_of(model).max_ahead, "losses": losses}


def test_rate_limiter_bounds_gathers_ahead(pool: WorkerPool) -> None:
    limited = pool.run(limiter_job, True)[0]
    free = pool.run(limiter_job, False)[0]
    assert limited["ahead"] == 2  # the third prefetch waited for the first
    assert free["ahead"] == 3
    assert limited["losses"] == free["losses"]


def limiter_calls_job(ctx: WorkerContext, strategy: str) -> dict[str, int] | None:
    """How often a training step consults the rate limiter (on GPUs: event syncs)."""
    group = ctx.group(2)
    if group is None:
        return None
    model = _sharded_gpt(group, strategy=flatshard.ShardingStrategy[strategy])
    limiter = internals.rate_limiter_of(model)
    batch = cast(Any, model).make_batch(torch.Generator().manual_seed(0), 8)
    cast(Any, model).loss(batch).backward()  # records the forward order
    before = (limiter.prefetches, limiter.frees)
    cast(Any, model).loss(batch).backward()
    return {
        "before_prefetch": limiter.prefetches - before[0],
        "resharded": limiter.frees - before[1],
    }


def test_rate_limiter_only_bounds_units_that_allocate(pool: WorkerPool) -> None:
    # TinyGPT: root + 3 blocks. FULL_SHARD frees blocks 0 and 1 after forward (block 2
    # ends forward and stays) and prefetches blocks 0, 1, 2 in forward and 1, 0 in backward.
    # NO_SHARD at fp32 aliases the shard: nothing is allocated, so nothing to bound (on a
    # GPU a free event and its sync per unit would only stall the CPU).
    assert pool.run(limiter_calls_job, "FULL_SHARD")[0] == {"before_prefetch": 5, "resharded": 2}
    assert pool.run(limiter_calls_job, "NO_SHARD")[0] == {"before_prefetch": 0, "resharded": 0}


def test_collective_choice_is_described(local_group: Any) -> None:
    text = describe_collectives(local_group)
    assert text.startswith("gloo:") and "all_to_all_single" in text


def reduce_scatter_job(ctx: WorkerContext, config: ParityConfig) -> None:
    """Every reduce-scatter implementation on gloo: the reference's sums, late or not."""
    group = ctx.group(config.world_size)
    if group is None:
        return
    reference = run_reference(config) if ctx.rank == 0 else None
    for impl in internals.ReduceScatter:
        with internals.forced_reduce_scatter(impl):
            late = run_on_time_and_late(config, group)
        if reference is not None:
            assert_same(reference, late)


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig("gpt", 3, steps=3),
        ParityConfig("gpt", 4, strategy="HYBRID_SHARD", sharding_factor=2, steps=3),
    ],
    ids=_name,
)
def test_reduce_scatter_implementation_matches(pool: WorkerPool, config: ParityConfig) -> None:
    pool.run(reduce_scatter_job, config)
