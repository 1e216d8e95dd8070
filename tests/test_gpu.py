"""The CUDA path against the non-sharded reference; skipped where no GPU is visible.

CI has no GPU: run ``pytest tests/test_gpu.py -s`` on a machine with one (the figures it
prints are for the closing notes). Two set-ups, because NCCL refuses two ranks on one GPU:
- one rank over NCCL: every unit has F = 1, but device placement, mixed-precision casts,
  CPU offload (pinned shards, non-blocking copies) and the rate limiter's CUDA events run;
- two ranks sharing one GPU over gloo, which takes CUDA tensors: the asynchronous
  all-gathers and reductions of FULL_SHARD on CUDA, on time and late (``delays``), and
  peak GPU memory against FSDP2's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flatshard.testing.parity import (
    ParityConfig,
    RunResult,
    assert_same,
    run_flatshard,
    run_fsdp2,
    run_mixed_reference,
    run_on_time_and_late,
    run_reference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RTOL = 1e-4  # CUDA's atomically accumulated gradients (embeddings) change summation order
BF16_RTOL = 4 * 2**-7  # as tests/test_mixed_precision.py

ONE_RANK = [
    ParityConfig("gpt", 1, device="cuda", steps=3),
    ParityConfig("gpt", 1, device="cuda", steps=3, forward_prefetch=True),
    ParityConfig("gpt", 1, device="cuda", steps=3, backward_prefetch="BACKWARD_POST"),
    ParityConfig("gpt", 1, device="cuda", steps=3, offload=True),
    ParityConfig("mlp", 1, device="cuda", steps=3, strategy="SHARD_GRAD_OP"),
    ParityConfig("gpt", 1, device="cuda", steps=3, param_dtype="bfloat16"),
]

TWO_RANKS = [
    ParityConfig("gpt", 2, device="cuda", steps=3),
    ParityConfig("gpt", 2, device="cuda", steps=3, forward_prefetch=True),
    ParityConfig("gpt", 2, device="cuda", steps=3, backward_prefetch=None),
    ParityConfig("gpt", 2, device="cuda", steps=3, limit_all_gathers=False),
    ParityConfig("gpt", 2, device="cuda", steps=3, offload=True),
    ParityConfig("gpt", 2, device="cuda", steps=3, param_dtype="bfloat16"),
    ParityConfig("nested", 2, device="cuda", steps=3, forward_prefetch=True),
]


def _check(config: ParityConfig, ours: RunResult) -> None:
    if config.param_dtype is not None:
        assert_same(run_mixed_reference(config), RunResult(ours.losses, ours.params), BF16_RTOL)
    else:
        assert_same(run_reference(config), ours, rtol=RTOL)


def _name(c: ParityConfig) -> str:
    return (
        f"{c.model}-{c.strategy}-{c.backward_prefetch}-fwd{int(c.forward_prefetch)}"
        f"-limit{int(c.limit_all_gathers)}-offload{int(c.offload)}-{c.param_dtype or 'fp32'}"
    )


def _job(rank: int, backend: str, world: int, store: str, configs: list[Any], out: str) -> None:
    """Every config on time and late (bitwise equal), checked on rank 0; peak memory.

    Each config's outcome is written down rather than raised, so that one run on a
    borrowed GPU reports every case.
    """
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD
    outcomes = []
    try:
        for config in configs:
            try:
                _on_time_and_late(rank, config, group)
                outcomes.append(f"ok {backend} {_name(config)}")
            except Exception as error:
                outcomes.append(f"FAILED {backend} {_name(config)}: {error!r}"[:2000])
        if world > 1:
            ours, fsdp2 = _peak_memory(replace(configs[0], steps=2), group)
            outcomes.append(f"peak {ours} {fsdp2}")
    finally:
        Path(f"{out}.{rank}").write_text("\n".join(outcomes))
        dist.destroy_process_group()


def _on_time_and_late(rank: int, config: ParityConfig, group: Any) -> None:
    late = run_on_time_and_late(config, group)
    if rank == 0:
        _check(config, late)


def _peak_memory(config: ParityConfig, group: Any) -> tuple[int, int]:
    """Peak GPU memory above the start of a training run: flatshard's, FSDP2's."""
    peaks = []
    for run in (run_flatshard, run_fsdp2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(config, group)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    return peaks[0], peaks[1]


def _run(backend: str, world: int, configs: list[ParityConfig]) -> list[str]:
    """Spawn ``world`` ranks (fresh processes: no process group of the test session)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, store = os.path.join(tmp, "outcomes"), os.path.join(tmp, "store")
        mp.spawn(_job, args=(backend, world, store, configs, out), nprocs=world)
        lines = [line for r in range(world) for line in Path(f"{out}.{r}").read_text().splitlines()]
    print("\n".join(lines))
    return lines


def test_one_rank_nccl_matches_reference() -> None:
    lines = _run("nccl", 1, ONE_RANK)
    assert not [line for line in lines if line.startswith("FAILED")]


def test_two_ranks_on_one_gpu_match_reference() -> None:
    lines = _run("gloo", 2, TWO_RANKS)
    assert not [line for line in lines if line.startswith("FAILED")]
    for line in lines:
        if line.startswith("peak"):
            ours, fsdp2 = (int(x) for x in line.split()[1:])
            print(
                f"peak GPU memory above the start: flatshard {ours / 2**20:.2f} MiB, "
                f"FSDP2 {fsdp2 / 2**20:.2f} MiB"
            )
            assert ours <= fsdp2
