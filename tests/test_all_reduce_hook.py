"""``flatshard.set_all_reduce_hook``: FSDP2's all-reduce hook, the replicas' sum as a user
hook (what torchft's replica groups plug into: ``flatshard.integrations.torchft``).

Two groups of 2 ranks each shard the model over their own ranks (FULL_SHARD, and
SHARD_GRAD_OP); the hook all-reduces each reduced shard over the ranks that hold the same
rows in the other group and halves it. Three steps equal DDP over the 4 ranks (each rank's
batch, gradients averaged), with accumulation under ``no_sync`` too (one hook call per
unit and step, by count).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.testing.workers import WorkerContext, WorkerPool

STEPS, LR = 3, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


_GROUPS: dict[str, Any] = {}


def _groups() -> tuple[list[Any], list[Any]]:
    """Shard groups {0, 1}, {2, 3}; replica groups {0, 2}, {1, 3} (made once, in order)."""
    if not _GROUPS:
        _GROUPS["shard"] = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["replica"] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return _GROUPS["shard"], _GROUPS["replica"]


class AcrossReplicas:
    """The hook: the two groups' average of a reduced shard (counts its calls)."""

    def __init__(self, group: Any) -> None:
        self.group, self.calls = group, 0

    def __call__(self, shard: torch.Tensor) -> None:
        self.calls += 1
        dist.all_reduce(shard, group=self.group)
        shard.div_(2)


def hook_job(ctx: WorkerContext, strategy: str, micro: int) -> dict[str, Any]:
    shards, replicas = _groups()
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    model = flatshard.fully_shard(
        copy.deepcopy(reference),
        auto_wrap_policy={Block},
        strategy=flatshard.ShardingStrategy[strategy],
        process_group=shards[ctx.rank // 2],
    )
    hook = AcrossReplicas(replicas[ctx.rank % 2])
    flatshard.set_all_reduce_hook(model, hook)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=LR)
    calls = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        xs, ys = (
            torch.randn(4, micro, 4, 8, generator=gen),
            torch.randn(4, micro, 4, 8, generator=gen),
        )
        before = hook.calls

        def loss(i: int, step_x: Any = xs, step_y: Any = ys) -> torch.Tensor:
            return ((model(step_x[ctx.rank, i]) - step_y[ctx.rank, i]) ** 2).mean()

        flatshard.train_step(model, [optim], loss, micro)
        calls.append(hook.calls - before)
        ref_optim.zero_grad()
        for rank in range(4):  # DDP's semantics: each rank's micro-batches, averaged
            for i in range(micro):
                (((reference(xs[rank, i]) - ys[rank, i]) ** 2).mean() / (4 * micro)).backward()
        ref_optim.step()
    worst = 0.0
    with flatshard.summon_full_params(model):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, float((p - q).norm() / q.norm()))
    units = len(flatshard.unit_modules(model))
    return {"worst": worst, "calls": calls, "units": units}


@pytest.mark.parametrize(("strategy", "micro"), [("FULL_SHARD", 1), ("SHARD_GRAD_OP", 2)])
def test_the_hook_sums_the_replicas_as_ddp_does(
    pool: WorkerPool, strategy: str, micro: int
) -> None:
    for result in pool.run(hook_job, strategy, micro):
        assert result["worst"] < 2e-6, result
        assert result["calls"] == [result["units"]] * STEPS, result  # once a unit and step


def refusal_job(ctx: WorkerContext) -> str:
    model = flatshard.fully_shard(nn.Sequential(Block()))
    flatshard.set_all_reduce_hook(model, None)  # none: the built-in reduction alone
    try:
        flatshard.set_all_reduce_hook(model, 3)  # type: ignore[arg-type]
    except TypeError as error:
        return str(error)
    return "no error"


def test_the_hook_is_refused_where_it_cannot_run(pool: WorkerPool) -> None:
    """(In the pool: a process group in the suite's own process would send the CLI's
    in-process plans to a child process.)"""
    for message in pool.run(refusal_job):
        assert "hook must be callable or None, got 3" in message, message
