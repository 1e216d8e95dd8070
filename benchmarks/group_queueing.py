"""Does a small all-gather wait behind a large all-to-all on the same gloo group?

    python benchmarks/group_queueing.py

Two ranks; 15 tries each of: a 50 MB all-to-all, then a 2 MB all-gather on the same group
("same") or on a second group over the same ranks ("separate"). Prints, per mode, the
median seconds until the all-gather and until the all-to-all finished, and the share of
tries in which the all-gather finished with the all-to-all (within 3 ms): it waited behind
it. See ``flatshard.set_separate_reduce_scatter_group`` and docs/performance.md.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from two_ranks import on_two_ranks

TRIES = 15


def run(rank: int, world: int, address: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    first = dist.new_group(list(range(world)))
    second = dist.new_group(list(range(world)))
    big = torch.randn(12_500_000)  # 50 MB
    received = torch.empty_like(big)
    small = torch.randn(500_000)  # 2 MB
    gathered = torch.empty(small.numel() * world)
    timings: dict[str, list[tuple[float, float]]] = {}
    for mode in ["same", "separate"] * TRIES:
        dist.barrier()
        start = time.perf_counter()
        reduce = dist.all_to_all_single(received, big, group=first, async_op=True)
        group = first if mode == "same" else second
        gather = dist.all_gather_into_tensor(gathered, small, group=group, async_op=True)
        gather.wait()
        small_done = time.perf_counter() - start
        reduce.wait()
        timings.setdefault(mode, []).append((small_done, time.perf_counter() - start))
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def main() -> None:
    for mode, tries in on_two_ranks(run).items():
        small = statistics.median(a for a, _ in tries)
        big = statistics.median(b for _, b in tries)
        behind = sum(1 for a, b in tries if b - a < 0.003) / len(tries)
        print(f"{mode}: all-gather {small:.4f} s, all-to-all {big:.4f} s, behind it {behind:.0%}")


if __name__ == "__main__":
    main()
