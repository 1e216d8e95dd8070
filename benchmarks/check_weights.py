"""What comparing the replicas' weights at ``fully_shard`` costs (on by default where ranks
hold replicas: ``InitOptions.check_weights``), on a model of about 1B parameters.

Each rank builds the model on the meta device; ``fully_shard`` materializes and
initializes it one unit at a time (NO_SHARD: every rank a replica), once with the check
and once without, in the same processes, alternating. Prints each build's seconds on
rank 0 and the ratio::

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:0 \\
        benchmarks/check_weights.py --blocks 16 --dim 4096

16 blocks of four bias-free 4096 x 4096 linears: 1.07B parameters (4.3 GB in fp32 per rank).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn

import flatshard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linears = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linears(x)
        return out


def build_seconds(blocks: int, dim: int, check: bool) -> float:
    with torch.device("meta"):
        model = nn.Sequential(*[Block(dim) for _ in range(blocks)])
    dist.barrier()
    start = time.perf_counter()
    flatshard.fully_shard(
        model,
        auto_wrap_policy={Block},
        strategy=flatshard.ShardingStrategy.NO_SHARD,
        init=flatshard.InitOptions(check_weights=check),
    )
    dist.barrier()
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # meta initialization seeds from it: the same weights everywhere
    params = args.blocks * 4 * args.dim * args.dim
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for check in (False, True):
            times[check].append(build_seconds(args.blocks, args.dim, check))
    if dist.get_rank() == 0:
        on, off = min(times[True]), min(times[False])
        print(f"{params / 1e9:.2f}B parameters, {dist.get_world_size()} ranks, NO_SHARD")
        print(f"fully_shard without the weight check: {off:.2f} s (best of {args.repeats})")
        print(f"fully_shard with the weight check:    {on:.2f} s (best of {args.repeats})")
        print(f"the check adds {on - off:.2f} s ({on / off:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
