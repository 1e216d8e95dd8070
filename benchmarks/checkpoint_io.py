"""Checkpoint saves that stop training, and ones that do not: flatshard's synchronous and
asynchronous ``save_checkpoint`` against DCP's ``save``/``async_save``/``load`` (on FSDP2's
``fully_shard`` of the same model and AdamW state), at 2 ranks::

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:0 \\
        benchmarks/checkpoint_io.py --blocks 12 --dim 2048 --rounds 3

A stack of ``--blocks`` bias-free ``dim x dim`` linears (one unit each), AdamW. Two parts,
in the same processes:

1. The stall per save in a training loop: ``--steps`` steps with a save every
   ``--every`` steps (not at the last one), synchronous, asynchronous, and none,
   alternating over ``--rounds`` rounds; the loop ends when the last write is committed.
   Per save: the seconds the ``save_checkpoint`` call blocked the loop, and the loop's
   seconds beyond the run without saves divided by the saves (on CPUs the writer thread
   competes with training for the cores: this is what a run loses per save).
2. Throughput: each rank's bytes of state over the seconds of one save (and, for the
   asynchronous ones, of the call and of the whole write) and of one load, flatshard and
   DCP alike; MB/s per rank, median over the rounds.

Rank 0 prints one line per measurement. Files go to ``--dir`` (default: a temporary
directory), on one file system the ranks share; loads read what the save just wrote
(mostly from the page cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_shard

import flatshard


def build(blocks: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(blocks)])


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def loop_seconds(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    x: torch.Tensor,
    args: argparse.Namespace,
    save: Callable[[int], Any] | None,
) -> tuple[float, list[float]]:
    """Seconds of ``--steps`` steps with ``save(step)`` every ``--every``; each call's."""
    calls: list[float] = []
    pending: Any = None
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        train_step(model, optim, x)
        if save is not None and step % args.every == 0 and step < args.steps:
            began = time.perf_counter()
            pending = save(step)
            calls.append(time.perf_counter() - began)
    if pending is not None:
        pending.wait()  # the last write counts: the run ends when it is committed
    dist.barrier()
    return time.perf_counter() - start, calls


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    root = Path(args.dir or tempfile.gettempdir()) / "flatshard-checkpoint-io"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    say = print if rank == 0 else (lambda *a, **k: None)

    model = build(args.blocks, args.dim)
    for block in model:
        flatshard.fully_shard(block)
    flatshard.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.dim)
    train_step(model, optim, x)  # moments exist

    reference = build(args.blocks, args.dim)
    for block in reference:
        fsdp2_shard(block)
    fsdp2_shard(reference)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    train_step(reference, ref_optim, x)
    dcp_group = dist.new_group(backend="gloo")  # DCP's advice for async_save

    staged = flatshard.save_checkpoint(root / "probe", model, optim, async_op=True)
    staged.wait()
    mb = staged.staged_bytes / 2**20
    params = sum(p.numel() for p in build(args.blocks, args.dim).parameters())
    say(f"model: {params / 1e6:.1f}M parameters; state per rank {mb:.0f} MiB; {world} ranks")

    def save_sync(step: int) -> None:
        flatshard.save_checkpoint(root / f"sync_{step}", model, optim)

    def save_async(step: int) -> flatshard.CheckpointSave:
        return flatshard.save_checkpoint(root / f"async_{step}", model, optim, async_op=True)

    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    lost: dict[str, list[float]] = {"sync": [], "async": []}
    saves = (args.steps - 1) // args.every  # none at the last step: a write has steps to hide in
    for _ in range(args.rounds):
        base, _ = loop_seconds(model, optim, x, args, None)
        for name, save in (("sync", save_sync), ("async", save_async)):
            total, calls = loop_seconds(model, optim, x, args, save)  # type: ignore[arg-type]
            stalls[name] += calls
            lost[name].append((total - base) / saves)
            dist.barrier()
            if rank == 0:
                for path in root.glob(f"{name}_*"):
                    shutil.rmtree(path)
    for name in ("sync", "async"):
        say(
            f"stall per save, {name:5s}: call {statistics.median(stalls[name]):.3f} s, loop "
            f"slower by {statistics.median(lost[name]):.3f} s per save "
            f"({args.steps} steps, a save every {args.every}; median of {args.rounds} rounds)"
        )
    call_ratio = statistics.median(stalls["async"]) / statistics.median(stalls["sync"])
    lost_ratio = statistics.median(lost["async"]) / statistics.median(lost["sync"])
    say(f"async / sync: call {call_ratio:.2f}, loop time lost {lost_ratio:.2f}")

    ref_bytes = 0
    msd, osd = get_state_dict(reference, ref_optim)
    for value in [*msd.values(), *(v for s in osd["state"].values() for v in s.values())]:
        local = value.to_local() if hasattr(value, "to_local") else value
        ref_bytes += local.nbytes if isinstance(local, torch.Tensor) else 0
    seconds: dict[str, list[float]] = {}
    for i in range(args.rounds):
        one = throughput_round(root / f"round_{i}", model, optim, reference, ref_optim, dcp_group)
        for name, value in one.items():
            seconds.setdefault(name, []).append(value)
        if rank == 0:
            shutil.rmtree(root / f"round_{i}")
    for name, values in seconds.items():
        nbytes = ref_bytes if name.startswith("DCP") else staged.staged_bytes
        median = statistics.median(values)
        say(f"{name:22s} {median:7.3f} s  {nbytes / 2**20 / median:8.1f} MB/s per rank")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def throughput_round(
    root: Path,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    reference: nn.Module,
    ref_optim: torch.optim.Optimizer,
    dcp_group: dist.ProcessGroup,
) -> dict[str, float]:
    """Seconds of one save and load each way, into ``root``."""
    out: dict[str, float] = {}
    out["flatshard save"] = timed(lambda: flatshard.save_checkpoint(root / "fs", model, optim))
    out["flatshard load"] = timed(lambda: flatshard.load_checkpoint(root / "fs", model, optim))
    began = time.perf_counter()
    pending: list[flatshard.CheckpointSave] = []
    out["flatshard async call"] = timed(
        lambda: pending.append(
            flatshard.save_checkpoint(root / "fs_async", model, optim, async_op=True)
        )
    )
    pending[0].wait()
    out["flatshard async whole"] = timed(lambda: None) + time.perf_counter() - began
    msd, osd = get_state_dict(reference, ref_optim)
    state = {"model": msd, "optim": osd}
    out["DCP save"] = timed(lambda: dcp.save(state, checkpoint_id=str(root / "dcp")))
    out["DCP load"] = timed(lambda: _dcp_load(reference, ref_optim, root / "dcp"))
    began = time.perf_counter()
    futures: list[Any] = []
    out["DCP async_save call"] = timed(
        lambda: futures.append(
            dcp.async_save(state, checkpoint_id=str(root / "dcp_async"), process_group=dcp_group)
        )
    )
    futures[0].result()
    out["DCP async_save whole"] = timed(lambda: None) + time.perf_counter() - began
    return out


def _dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


if __name__ == "__main__":
    main()
