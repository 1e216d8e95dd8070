"""``cluster="cpu"``: this machine's speed, measured in a few seconds.

Matrix-product FLOP/s per dtype, memory bandwidth (from DRAM, and within the cache) and
the time per op of a training step (a tiny one's, plus what a small GPT's costs beyond
its priced ops), each the median of its repeats, measured in ``ranks`` local processes
at once (each with its share of the threads, contending as training ranks do), and
gloo's ring bandwidth between them. Two cores shared by compute and gloo's threads leave no room for
overlap (``design/PEERS.md``): ``overlap`` is off.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard._planner.cluster import Cluster
from flatshard._planner.recorder import Recorder
from flatshard._planner.timing import compute_time
from flatshard._processes import fast_context
from flatshard.models import GPT

_COLLECTIVE_BYTES = 8 << 20


def _typical(fn: Callable[[], object], repeats: int = 9) -> float:
    """The median seconds of ``fn`` after a warm-up: the statistic a step time is quoted
    in (the best of a few repeats would predict every step fast)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _typical(lambda: a @ b)


CACHE_BYTES = 12 << 20  # an op touching at most this much runs at the cache's speed


def _memory_bandwidth(numel: int) -> float:
    x, y = torch.randn(numel), torch.randn(numel)
    return 3 * x.numel() * 4 / _typical(lambda: torch.add(x, y))


def _op_overhead() -> float:
    """Seconds per op of a training step whose tensors are tiny: what modules, autograd
    and the dispatcher cost around each kernel the plan counts (a bare ``torch.add`` in a
    loop would be a third of it)."""
    blocks = [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))]
    model = nn.Sequential(*(blocks * 8))
    x = torch.randn(4, 8)

    def step() -> None:
        torch.autograd.backward(model(x).square().mean())

    with Recorder() as recorder:
        recorder.start_recording()
        step()
    return _typical(step) / len(recorder.ops)


def _step_extra_per_op(speeds: _Speeds) -> float:
    """Seconds per op that a real training step costs beyond the roofline and the tiny
    step's per-op cost, measured on a small GPT's step (masks, softmax, norms and the
    optimizer's updates run strided, broadcast and short; Python does more around them).
    Put on every op, it fades as ops grow (larger models are priced by their bytes)."""
    torch.manual_seed(0)
    model = GPT(vocab=128, dim=128, heads=4, layers=2, seq_len=64)
    for module in model.modules():  # GPT-2's init (PyTorch's default meets subnormal floats)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 128, (4, 64))

    def step() -> None:
        logits = model(idx)
        torch.autograd.backward(nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()))
        optim.step()
        optim.zero_grad()

    step()  # the optimizer's state exists from here on, as in a steady-state step
    with Recorder() as recorder:
        recorder.start_recording()
        step()
    cluster = _cluster(speeds, ranks=1)
    ops = [op for op in recorder.ops if op.collective is None]
    predicted = sum(compute_time(op, cluster) for op in ops)
    return max(0.0, _typical(step, repeats=25) - predicted) / len(ops)


@dataclass(frozen=True)
class _Speeds:
    fp32: float
    bf16: float
    memory: float
    cache: float
    overhead: float
    link: float = 1e12  # no peer: nothing crosses a link


def _compute_speeds(ranks: int) -> _Speeds:
    """This process's speeds with the threads each of ``ranks`` processes gets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        speeds = _Speeds(
            fp32=_matmul_flops(torch.float32, 512),
            bf16=_matmul_flops(torch.bfloat16, 128),
            memory=_memory_bandwidth(16 << 20),  # 3 x 64 MiB: a stream from DRAM
            cache=_memory_bandwidth(1 << 20),  # 3 x 4 MiB
            overhead=_op_overhead(),
        )
        return replace(speeds, overhead=speeds.overhead + _step_extra_per_op(speeds))
    finally:
        torch.set_num_threads(threads)


def _worker(rank: int, ranks: int, store: str, out: Any) -> None:
    """Every rank measures its compute at once (they share the cores and the memory bus,
    as in training), then gloo's ring."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    try:
        dist.barrier()
        speeds = _compute_speeds(ranks)
        torch.set_num_threads(1)
        full = torch.zeros(_COLLECTIVE_BYTES // 4)
        shard = torch.ones(full.numel() // ranks)
        received = torch.empty_like(full)
        times = []
        for _ in range(8):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            dist.all_to_all_single(received, full)
            times.append((time.perf_counter() - start) / 2)
        if rank == 0:
            seconds = statistics.median(times[1:])
            out.put(replace(speeds, link=_COLLECTIVE_BYTES * (ranks - 1) / ranks / seconds))
    finally:
        dist.destroy_process_group()


def _measured_together(ranks: int) -> _Speeds:
    """``_worker`` in ``ranks`` local processes; rank 0's figures."""
    context = fast_context()
    out = context.Queue()
    with tempfile.TemporaryDirectory(prefix="flatshard-plan-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            context.Process(target=_worker, args=(rank, ranks, store, out)) for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        speeds: _Speeds = out.get(timeout=300)
        for proc in procs:
            proc.join()
    return speeds


def cpu_cluster(ranks: int) -> Cluster:
    """This machine, measured, as ``ranks`` local processes running at once share it."""
    speeds = _measured_together(ranks) if ranks > 1 else _compute_speeds(1)
    return _cluster(speeds, ranks)


def _cluster(speeds: _Speeds, ranks: int) -> Cluster:
    fp32, bf16, memory, cache = speeds.fp32, speeds.bf16, speeds.memory, speeds.cache
    overhead, link = speeds.overhead, speeds.link
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
            f"{overhead * 1e6:.1f} us per op in a training step, "
            f"gloo ring {link / 1e9:.2f} GB/s per rank",
        ),
    )
