"""Micro-benchmark: gloo's tensor collectives against all-reduce based equivalents.

Run: .venv/bin/python benchmarks/gloo_collectives.py [--ranks 2] [--repeats 7]

For each shard size it times, interleaved in one run (so machine drift cancels), the median
of: all_gather_into_tensor vs (zero a buffer, copy the own chunk, all_reduce), and
reduce_scatter_tensor vs (all_reduce in place, copy the own chunk) vs (all_to_all_single,
sum the received chunks). It prints the ratios; above 1 means the second form is faster.
Results are checked for equality.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# float32 elements per shard: 1, 4, 6, 8, 12, 16 and 24 MiB
SIZES = (1 << 18, 1 << 20, 3 << 19, 1 << 21, 3 << 20, 1 << 22, 6 << 20)


def timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(rank: int, world: int, n: int, repeats: int) -> dict[str, float]:
    """Median seconds of each form for shards of ``n`` float32 elements."""
    shard = torch.randn(n)
    full, emulated = torch.empty(world * n), torch.empty(world * n)
    out, emulated_out, summed_out = torch.empty(n), torch.empty(n), torch.empty(n)
    mine = slice(rank * n, (rank + 1) * n)

    def gather() -> None:
        dist.all_gather_into_tensor(full, shard)

    def gather_by_reduce() -> None:
        emulated.zero_()
        emulated[mine].copy_(shard)
        dist.all_reduce(emulated)

    times: dict[str, list[float]] = {"ag": [], "ag_ar": [], "rs": [], "rs_ar": [], "rs_a2a": []}
    for _ in range(repeats):
        grad = torch.randn(world * n, generator=torch.Generator().manual_seed(rank))
        grad_copy = grad.clone()

        def scatter(g: torch.Tensor = grad) -> None:
            dist.reduce_scatter_tensor(out, g)

        def scatter_by_reduce(g: torch.Tensor = grad_copy) -> None:
            dist.all_reduce(g)
            emulated_out.copy_(g[mine])

        def scatter_by_all_to_all(g: torch.Tensor = grad) -> None:
            received = torch.empty_like(g)
            dist.all_to_all_single(received, g)
            torch.sum(received.view(world, n), dim=0, out=summed_out)

        times["ag"].append(timed(gather))
        times["ag_ar"].append(timed(gather_by_reduce))
        times["rs"].append(timed(scatter))
        times["rs_ar"].append(timed(scatter_by_reduce))
        times["rs_a2a"].append(timed(scatter_by_all_to_all))
    assert torch.equal(full, emulated)
    # Sums of W values in another order: equal to float32 rounding (absolute near zero).
    close = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(out, emulated_out, **close) and torch.allclose(out, summed_out, **close)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(rank: int, world: int, store: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for n in SIZES:
        med = measure(rank, world, n, repeats)
        if rank == 0:
            print(
                f"{world} ranks, {n * 4 / 2**20:>4.0f} MiB shard: "
                f"all_gather / all-reduce form = {med['ag'] / med['ag_ar']:.2f}, "
                f"reduce_scatter / all-reduce form = {med['rs'] / med['rs_ar']:.2f}, "
                f"all-reduce form / all-to-all form = {med['rs_ar'] / med['rs_a2a']:.2f}",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker,
            args=(args.ranks, os.path.join(tmp, "store"), args.repeats),
            nprocs=args.ranks,
        )


if __name__ == "__main__":
    main()
