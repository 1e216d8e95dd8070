"""What byte-gpt's collectives cost at 2 ranks on gloo with no compute: what the step over
the no-communication floor pays where communication cannot overlap compute (2 cores).

    python benchmarks/comm_cpu_cost.py

The collectives of one step of ``flatshard bench --preset byte-gpt`` (9 units, the root and
8 blocks of 512 wide; forward all-gathers, then per block in backward an all-gather and
gloo's reduce-scatter form, an all-to-all and a sum), issued alone, 5 steps. Prints the
wall and the CPU seconds (all of rank 0's threads) per step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from two_ranks import on_two_ranks

DIM, LAYERS, STEPS = 512, 8, 5


def run(rank: int, world: int, address: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    block = 12 * DIM * DIM + 13 * DIM  # one GPT block's parameters
    root = (256 + 128) * DIM + 2 * DIM  # token and position tables, final norm
    units = [root] + [block] * LAYERS
    chunks = [(n + world - 1) // world for n in units]
    shards = [torch.randn(c) for c in chunks]
    full = [torch.empty(c * world) for c in chunks]
    grads = [torch.randn(c * world) for c in chunks]
    received = [torch.empty_like(g) for g in grads]

    def reduce(i: int) -> None:
        dist.all_to_all_single(received[i], grads[i])
        received[i].view(world, -1).sum(0)

    def step() -> None:
        for shard, out in zip(shards, full, strict=True):  # forward
            dist.all_gather_into_tensor(out, shard)
        for i in reversed(range(1, len(units))):  # backward: gather, then reduce
            dist.all_gather_into_tensor(full[i], shards[i])
            reduce(i)
        reduce(0)

    step()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(STEPS):
        step()
    dist.barrier()
    if rank == 0:
        results.put(((time.perf_counter() - wall) / STEPS, (time.process_time() - cpu) / STEPS))
    dist.destroy_process_group()


def main() -> None:
    wall, cpu = on_two_ranks(run)
    print(f"byte-gpt's collectives alone, 2 ranks, gloo: {wall:.3f} s wall, {cpu:.3f} s CPU")


if __name__ == "__main__":
    main()
