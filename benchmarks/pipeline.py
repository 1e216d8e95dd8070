"""Pipeline stages side by side: flatshard's and FSDP2's, PP2 x DP2 on 4 local gloo ranks.

    python benchmarks/pipeline.py [--dim 256] [--steps 8]

A stack of 4 residual MLP blocks (dim -> 4 dim -> dim), one block pair per stage, each
stage sharded over its 2 data-parallel ranks (FULL_SHARD; flatshard: per block units;
FSDP2: ``fully_shard`` per block and on the stage), 4 micro-batches of 16 rows per rank,
SGD. Systems, each in the same processes one after another: flatshard with ``Schedule1F1B``
(also with ``set_reshard_after_forward(stage, False)``: each unit gathered once per step)
and with ``ScheduleInterleavedZeroBubble`` (one stage per rank), FSDP2 with
``Schedule1F1B`` (its zero-bubble run is not exact: see docs/guide.md), and the same
stages unsharded (a process group of one rank each: no collective but the pipeline's
sends) with ``Schedule1F1B``. Prints each system's median step over ``--steps`` timed
steps (after 2 warm-up steps) on rank 0, and its ratio to FSDP2's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from two_ranks import on_ranks

ROWS, MICRO, BLOCKS = 16, 4, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def run(rank: int, world: int, address: str, results: Any, dim: int, steps: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble

    import flatshard
    from flatshard.integrations.pipelining import PipelineStage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    pp_rank, dp_rank = divmod(rank, 2)
    dps = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    pps = [dist.new_group([j, 2 + j]) for j in range(2)]
    singles = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    whole = nn.Sequential(*[Block(dim) for _ in range(BLOCKS)])

    def part() -> nn.Sequential:
        return copy.deepcopy(nn.Sequential(*list(whole)[2 * pp_rank : 2 * pp_rank + 2]))

    def timed(schedule: Any, module: nn.Module) -> float:
        optim = torch.optim.SGD(module.parameters(), lr=1e-3)
        x, y = torch.randn(MICRO * ROWS, dim), torch.randn(MICRO * ROWS, dim)
        times = []
        for step in range(2 + steps):
            dist.barrier()
            start = time.perf_counter()
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            optim.step()
            optim.zero_grad()
            dist.barrier()
            if step >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    found = {}
    systems = (
        "flatshard 1F1B",
        "flatshard 1F1B, kept",
        "flatshard zero-bubble",
        "FSDP2 1F1B",
        "unsharded 1F1B",
    )
    for name in systems:
        module = part()
        if name.startswith("FSDP2"):
            mesh = DeviceMesh.from_group(dps[pp_rank], "cpu")
            for block in module:
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
            stage: Any = TorchStage(module, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
        else:
            group = singles[rank] if name.startswith("unsharded") else dps[pp_rank]
            flatshard.fully_shard(module, auto_wrap_policy={Block}, process_group=group)
            if name.endswith("kept"):  # gathered once per step, held through it
                flatshard.set_reshard_after_forward(module, False)
            stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
        if "zero-bubble" in name:
            schedule: Any = ScheduleInterleavedZeroBubble([stage], MICRO, loss_fn=_loss)
        else:
            schedule = Schedule1F1B(stage, MICRO, loss_fn=_loss)
        found[name] = timed(schedule, module)
    if rank == 0:
        results.put(found)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    found = _run(args.dim, args.steps)
    base = found["FSDP2 1F1B"]
    print(f"PP2 x DP2, 4 blocks of {args.dim}, {MICRO} micro-batches of {ROWS} rows per rank")
    for name, seconds in found.items():
        print(f"  {name:<24} {seconds * 1000:8.1f} ms per step   {seconds / base:5.2f}x FSDP2")


def _run(dim: int, steps: int) -> dict[str, float]:
    import functools

    result: dict[str, float] = on_ranks(functools.partial(run, dim=dim, steps=steps), 4)
    return result


if __name__ == "__main__":
    main()
