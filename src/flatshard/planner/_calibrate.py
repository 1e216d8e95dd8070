"""``cluster="cpu"``: this machine's speed, measured in a few seconds.

Matrix-product FLOP/s per dtype, memory bandwidth (from DRAM, and within the cache) and
the time per op of a tiny training step, then both fitted to two real GPT steps (below),
each the median of its repeats, measured in ``ranks`` local processes at once (each with
its share of the threads, contending as training ranks do), and gloo's ring bandwidth
between them. Two cores shared by compute and gloo's threads leave no room for overlap
(``design/PEERS.md``): ``overlap`` is off.

[Note: fitted to training steps]
A lone ``a @ b`` repeated on hot operands runs faster than the same product inside a
training step (cold operands, the other ranks working beside it), and a step taken by all
ranks at once runs longer than the same step alone (docs/performance.md, "Planner
calibration", has the profiles). Two real steps pin down what the micro-benchmarks miss: a
small GPT's, mostly per-op cost (masks, softmax and the optimizer's updates run strided
and short; Python does more around them), gives the time per op beyond the tiny step's; a
GPT 8 times as wide on 4 times the tokens, mostly matrix products, gives ``achieved``, the
share of the benchmark's rate that a step's products reach (above 1 where the benchmark
itself ran slow: the machine is shared). Each fit uses the other's result, so they
alternate until both settle. Memory-bound ops are priced at the cache's speed only up to a
core's own cache (L2): tensors of a few MiB (``flatshard train``'s default GPT's masks,
softmax and GELU) run at memory speed in a step, not at the speed a hot loop over a shared
L3 shows.
"""

from __future__ import annotations

import os
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._collectives import _ALL_GATHER
from flatshard.comm._processes import fast_context
from flatshard.models import GPT
from flatshard.planner._cluster import Cluster
from flatshard.planner._recorder import Op, Recorder
from flatshard.planner._timing import compute_time

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


def _private_cache_bytes() -> int:
    """A core's own cache (L2; Linux says in sysfs, else 2 MiB). An op touching at most
    this much runs at the cache's speed: in a training step a larger one streams from
    memory, though a shared L3 may hold it ([Note: fitted to training steps])."""
    units = {"K": 10, "M": 20}
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(text.rstrip("KM")) << units.get(text[-1:], 0)
    except (OSError, ValueError):
        return 2 << 20


CACHE_BYTES = _private_cache_bytes()


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


def _gpt_step(dim: int, seq_len: int) -> tuple[list[Op], float]:
    """A small GPT's training step (AdamW, in its steady state): its compute ops and its
    typical seconds."""
    torch.manual_seed(0)
    model = GPT(vocab=128, dim=dim, heads=4, layers=2, seq_len=seq_len)
    for module in model.modules():  # GPT-2's init (PyTorch's default meets subnormal floats)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 128, (4, seq_len))

    def step() -> None:
        logits = model(idx)
        torch.autograd.backward(nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()))
        optim.step()
        optim.zero_grad()

    step()  # the optimizer's state exists from here on, as in a steady-state step
    with Recorder() as recorder:
        recorder.start_recording()
        step()
    ops = [op for op in recorder.ops if op.collective is None]
    return ops, _typical(step, repeats=15 if dim <= 128 else 7)


def _predicted(ops: list[Op], speeds: _Speeds) -> float:
    cluster = _cluster(speeds, ranks=1)
    return sum(compute_time(op, cluster) for op in ops)


def _fitted_to_steps(speeds: _Speeds) -> _Speeds:
    """``speeds`` with the per-op cost and the matrix products' achieved share fitted to
    two real training steps ([Note: fitted to training steps])."""
    small, small_s = _gpt_step(dim=32, seq_len=32)
    large, large_s = _gpt_step(dim=256, seq_len=128)
    fitted = speeds
    for _ in range(3):  # each fit moves the other little: a few rounds settle both
        extra = (small_s - _predicted(small, replace(fitted, overhead=speeds.overhead))) / len(
            small
        )
        fitted = replace(fitted, overhead=speeds.overhead + max(0.0, extra))
        fitted = replace(fitted, achieved=_achieved(large, large_s, fitted))
    return fitted


def _achieved(ops: list[Op], seconds: float, speeds: _Speeds) -> float:
    """The share of the measured matrix-product rate at which ``ops`` take ``seconds``
    (bisection: their predicted time falls as the share grows), within [0.25, 4]: above 1
    where the benchmark's own median ran slow (the machine is shared)."""
    low, high = 0.25, 4.0
    if _predicted(ops, replace(speeds, achieved=high)) >= seconds:
        return high
    if _predicted(ops, replace(speeds, achieved=low)) <= seconds:
        return low
    for _ in range(30):
        middle = (low + high) / 2
        if _predicted(ops, replace(speeds, achieved=middle)) > seconds:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True)
class _Speeds:
    fp32: float
    bf16: float
    memory: float
    cache: float
    overhead: float
    achieved: float = 1.0  # share of ``fp32``/``bf16`` a training step's products reach
    link: float = 1e12  # no peer: nothing crosses a link
    latency: float = 0.0  # s per ring step of a collective (gloo, measured)


def _compute_speeds(ranks: int) -> _Speeds:
    """This process's speeds with the threads each of ``ranks`` processes gets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        speeds = _Speeds(
            fp32=_matmul_flops(torch.float32, 512),
            bf16=_matmul_flops(torch.bfloat16, 128),
            memory=_memory_bandwidth(16 << 20),  # 3 x 64 MiB: a stream from DRAM
            cache=_memory_bandwidth(CACHE_BYTES // 16),  # 3 x 4 bytes x this: 3/4 of it
            overhead=_op_overhead(),
        )
        return _fitted_to_steps(speeds)
    finally:
        torch.set_num_threads(threads)


def _worker(rank: int, ranks: int, store: str, out: Any) -> None:
    """Every rank measures its compute at once (they share the cores and the memory bus,
    as in training), then gloo's ring: its latency (a collective of a few bytes, per
    ring step) and its bandwidth (8 MiB, the latency taken out)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    try:
        dist.barrier()
        speeds = _compute_speeds(ranks)
        torch.set_num_threads(1)
        latency = _collective_seconds(2 * ranks, ranks, repeats=21) / (ranks - 1)
        seconds = _collective_seconds(_COLLECTIVE_BYTES // 4, ranks, repeats=8)
        transfer = max(seconds - latency * (ranks - 1), seconds / 2)
        if rank == 0:
            link = _COLLECTIVE_BYTES * (ranks - 1) / ranks / transfer
            out.put(replace(speeds, link=link, latency=latency))
    finally:
        dist.destroy_process_group()


def _collective_seconds(numel: int, ranks: int, repeats: int) -> float:
    """The median of an all-gather and an all-to-all of ``numel`` floats, each (the two
    collectives flatshard's gloo step makes)."""
    full = torch.zeros(numel)
    shard = torch.ones(numel // ranks)
    received = torch.empty_like(full)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _ALL_GATHER(full, shard)  # the runtime's (no deprecation warning)
        dist.all_to_all_single(received, full)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:])


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
        speeds = _first_result(out, procs)
        for proc in procs:
            proc.join()
    return speeds


def _first_result(out: Any, procs: list[Any]) -> _Speeds:
    """Rank 0's figures, or an error as soon as a rank has died without sending them."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            speeds: _Speeds = out.get(timeout=0.5)
            return speeds
        except queue.Empty:
            dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode]
            if dead:
                for proc in procs:
                    proc.kill()
                rank, code = dead[0]
                raise RuntimeError(
                    f"measuring this machine (cluster='cpu'): calibration rank {rank} exited "
                    f"with code {code} (its error is printed above); plan with a preset "
                    "cluster instead, e.g. cluster='cpu-dev'"
                ) from None
    raise TimeoutError("measuring this machine (cluster='cpu') took over 300 s")


_MEASURED: dict[int, _Speeds] = {}  # ranks -> this process's measurement


def cpu_cluster(ranks: int, again: bool = False) -> Cluster:
    """This machine, measured, as ``ranks`` local processes running at once share it.

    Measured once per process and number of ranks: the plans of one process (a budget
    search, ``flatshard bench``'s prediction, a notebook's plans one after another) are
    priced on the same figures, and the seconds of measuring are paid once. ``again``:
    measure anew (the machine's load changed)."""
    if again or ranks not in _MEASURED:
        _MEASURED[ranks] = _measured_together(ranks) if ranks > 1 else _compute_speeds(1)
    return _cluster(_MEASURED[ranks], ranks)


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
        intra_latency=speeds.latency,
        inter_latency=speeds.latency,
        op_overhead=overhead,
        cache_bytes=CACHE_BYTES,
        cache_bandwidth=cache,
        achieved=speeds.achieved,
        overlap=False,
        backend="gloo",
        device="cpu",
        hosts=1,
        ranks_per_host=ranks,
        notes=(
            f"measured: fp32 matmul {fp32 / 1e9:.1f} GFLOP/s, memory {memory / 1e9:.1f} GB/s "
            f"({cache / 1e9:.1f} GB/s within {CACHE_BYTES / 2**20:g} MiB), "
            f"{overhead * 1e6:.1f} us per op in a training step, "
            f"products at {speeds.achieved:.0%} of that rate in a step, "
            f"gloo ring {link / 1e9:.2f} GB/s per rank and {speeds.latency * 1e6:.0f} us per step",
        ),
    )
