"""``cluster="cpu"``: this machine's speed, measured in a few seconds.

Matrix-product FLOP/s per dtype, memory bandwidth (from DRAM, and within the cache) and
per-op dispatch time in this process
(with the threads each of ``ranks`` processes would get), and gloo's ring bandwidth
between ``ranks`` local processes (skipped at one rank). Two cores shared by compute and
gloo's threads leave no room for overlap (``design/PEERS.md``): ``overlap`` is off.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flatshard._planner.cluster import Cluster

_COLLECTIVE_BYTES = 8 << 20


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_flops(dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: a @ b)


CACHE_BYTES = 12 << 20  # an op touching at most this much runs at the cache's speed


def _memory_bandwidth(numel: int) -> float:
    x, y = torch.randn(numel), torch.randn(numel)
    return 3 * x.numel() * 4 / _best(lambda: torch.add(x, y))


def _op_overhead() -> float:
    x = torch.randn(8)
    n = 2000

    def many() -> None:
        for _ in range(n):
            torch.add(x, x)

    return _best(many, 3) / n


def _ring_worker(rank: int, ranks: int, store: str, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    try:
        full = torch.zeros(_COLLECTIVE_BYTES // 4)
        shard = torch.ones(full.numel() // ranks)
        received = torch.empty_like(full)
        times = []
        for _ in range(4):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            dist.all_to_all_single(received, full)
            times.append((time.perf_counter() - start) / 2)
        if rank == 0:
            out.put(statistics.median(times[1:]))
    finally:
        dist.destroy_process_group()


def _gloo_bandwidth(ranks: int) -> float:
    """Bytes/s per rank of gloo's ring between ``ranks`` local processes."""
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory(prefix="flatshard-plan-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            context.Process(target=_ring_worker, args=(rank, ranks, store, out))
            for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        seconds = float(out.get(timeout=120))
        for proc in procs:
            proc.join()
    return _COLLECTIVE_BYTES * (ranks - 1) / ranks / seconds


def cpu_cluster(ranks: int) -> Cluster:
    """This machine, measured, as ``ranks`` local processes would share it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        fp32 = _matmul_flops(torch.float32, 512)
        bf16 = _matmul_flops(torch.bfloat16, 128)
        memory = _memory_bandwidth(16 << 20)  # 3 x 64 MiB: a stream from DRAM
        cache = _memory_bandwidth(1 << 20)  # 3 x 4 MiB
        overhead = _op_overhead()
    finally:
        torch.set_num_threads(threads)
    link = _gloo_bandwidth(ranks) if ranks > 1 else 1e12
    return Cluster(
        name="cpu (measured)",
        memory_bytes=int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // ranks,
        flops={torch.float32: fp32, torch.bfloat16: bf16, torch.float16: bf16},
        memory_bandwidth=memory,
        intra_bandwidth=link,
        inter_bandwidth=link,
        intra_latency=50e-6,
        inter_latency=50e-6,
        op_overhead=overhead,
        cache_bytes=CACHE_BYTES,
        cache_bandwidth=cache,
        achieved=1.0,  # measured, not peak
        overlap=False,
        backend="gloo",
        device="cpu",
        hosts=1,
        ranks_per_host=ranks,
        notes=(
            f"measured: fp32 matmul {fp32 / 1e9:.1f} GFLOP/s, memory {memory / 1e9:.1f} GB/s "
            f"({cache / 1e9:.1f} GB/s within {CACHE_BYTES >> 20} MiB), "
            f"{overhead * 1e6:.1f} us per op, gloo ring {link / 1e9:.2f} GB/s per rank",
        ),
    )
