"""Ranks that issue different collectives in a step get an error, not a silent wrong result.

Collectives pair by issue order (see [Note: collectives pair by issue order] in
``comm/_agreement.py``). Each case here issues equally many, equally sized collectives on every
rank, for different units: every collective completes, so without the end-of-step check
training went on with mixed-up weights or gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import flatshard
from flatshard.testing.models import ReluLinear, Trunk
from flatshard.testing.workers import WorkerContext, WorkerPool


class MoE(nn.Module):
    """Four experts, each a unit; the caller says which ones run (routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(ReluLinear() for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        y = sum((self.experts[i](x) for i in chosen), torch.zeros_like(x))
        out: torch.Tensor = self.head(y)
        return out


def _sharded_moe(ctx: WorkerContext) -> nn.Module | None:
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    return flatshard.fully_shard(MoE(), auto_wrap_policy={ReluLinear}, process_group=group)


def _error_of(run: Any) -> str:
    try:
        run()
    except flatshard.CollectiveMismatchError as error:
        return str(error)
    return "no error"


def moe_job(ctx: WorkerContext, backward: bool) -> str | None:
    model = _sharded_moe(ctx)
    if model is None:
        return None
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    chosen = [0, 2] if ctx.rank == 0 else [1, 3]  # each rank's tokens went elsewhere

    def step() -> None:
        if backward:
            model(x, chosen).sum().backward()
        else:
            with torch.no_grad():
                model(x, chosen)

    return _error_of(step)


def test_experts_run_on_some_ranks_only_are_an_error(pool: WorkerPool) -> None:
    for rank, message in enumerate(pool.run(moe_job, True)[:2]):
        assert "ranks issued different collectives in one backward pass" in message, message
        assert "First difference at call 2" in message  # call 1 gathers the root on both
        assert "rank 0 (" in message and "all_gather of unit 'experts.0'" in message
        assert "rank 1 (" in message and "all_gather of unit 'experts.1'" in message
        assert f"seen on rank {rank}" in message
        assert "run conditional units (e.g. experts that got no tokens) on every rank" in message


def test_forward_only_mismatch_is_an_error(pool: WorkerPool) -> None:
    for message in pool.run(moe_job, False)[:2]:
        assert "different collectives in one forward without backward" in message, message


def unused_output_job(ctx: WorkerContext) -> str | None:
    """Head c's output reaches the loss on rank 0 only: rank 0 reduces c mid-backward, rank
    1 at the end of backward (as zeros), so equal-sized reductions pair across units.

    SHARD_GRAD_OP keeps units gathered into backward, so only reductions are issued there.
    Under FULL_SHARD the re-gathers also interleave differently with the reductions, and a
    gather pairs with a reduction: that hangs before the end-of-step check (a timeout's job).
    """
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    model = flatshard.fully_shard(
        Trunk(),
        auto_wrap_policy={nn.Linear},
        process_group=group,
        strategy=flatshard.ShardingStrategy.SHARD_GRAD_OP,
    )
    x = torch.randn(4, 8)
    b, c = model(x)
    loss = b.sum() + (c.sum() if ctx.rank == 0 else 0)
    return _error_of(loss.backward)


def test_output_reaching_the_loss_on_some_ranks_only_is_an_error(pool: WorkerPool) -> None:
    for message in pool.run(unused_output_job)[:2]:
        assert "ranks issued different collectives in one backward pass" in message, message
        assert "reduce of unit 'c'" in message
        assert "add 0 * output.sum() to the loss" in message


def same_everywhere_job(ctx: WorkerContext) -> float | None:
    """The same routing on every rank: no error, and training goes on."""
    model = _sharded_moe(ctx)
    if model is None:
        return None
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):
        loss = model(x, [1, 2]).sum()
        loss.backward()
        with torch.no_grad():
            model(x, [0, 3])
    return float(loss)


def test_same_routing_everywhere_is_fine(pool: WorkerPool) -> None:
    assert all(isinstance(v, float) for v in pool.run(same_everywhere_job)[:2])
