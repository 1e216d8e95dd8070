"""Steady-state peak RSS per rank: flatshard against FSDP2 on a small GPT at 2 gloo ranks.

Each system trains the same GPT (same seed, same batches) in 2 spawned ranks; after
``--warmup`` steps each rank resets its peak resident set (``/proc/self/clear_refs``) and
takes ``--steps`` more; the figure is the largest VmHWM over the ranks, in MiB, and what
each rank held at rest after the last step (VmRSS). Every process runs with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation above 64 KiB on its own
and gives it back when freed, so the peak is what was alive at once, not what the
allocator kept. ``--rounds`` alternates the systems, each round in fresh processes.

    python benchmarks/steady_rss.py --layers 7 --dim 448 --rounds 3

``--where``: one round that also samples rank 0's VmRSS and VmHWM at every block's
forward start and end, at the logits, the loss, the logits' gradient and every block's
backward start and end of the last step, and prints both systems side by side: the
interval where VmHWM rises to its peak is where the step peaks. ``--no-keep-last``:
flatshard reshards the last unit of forward like the others (for A/B of that rule).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from typing import Any

from two_ranks import on_two_ranks

SYSTEMS = ("flatshard", "fsdp2")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _tensor_mib() -> float:
    """MiB of the distinct storages of the tensors Python can reach (at rest: parameters,
    optimizer state, buffers, what a library keeps)."""
    import gc
    import warnings

    import torch

    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module aliases
        tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a wrapper subclass (DTensor): its local tensor is counted
            continue
    return sum(storages.values()) / 2**20


def _rank(args: argparse.Namespace, rank: int, world: int, address: str, results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        from flatshard.models import GPT, GPTBlock

        torch.manual_seed(0)
        model = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq_len)
        blocks = list(model.blocks)
        if args.system == "flatshard":
            import flatshard

            if args.no_keep_last:
                from flatshard.testing.internals import no_keep_last_unit

                no_keep_last_unit()
            model = flatshard.fully_shard(model, auto_wrap_policy={GPTBlock})
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        events: list[tuple[str, float, float]] = []
        last_step = [False]

        def mark(name: str) -> None:
            if args.where and last_step[0]:
                events.append((name, _status_mib("VmRSS"), _status_mib("VmHWM")))

        if args.where:
            _sample_blocks(blocks, mark)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1 + rank)
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current resident set
            last_step[0] = step == args.warmup + args.steps - 1
            if args.where and last_step[0]:  # its own peak
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            mark("step starts")
            idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen)
            logits = model(idx[:, :-1])
            mark("logits")
            if args.where and last_step[0]:
                logits.register_hook(lambda g: mark("logits' gradient"))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            mark("loss")
            loss.backward()
            mark("backward done")
            del logits, loss
            optim.step()
            optim.zero_grad()
            mark("optimizer step done")
        mine = (_status_mib("VmHWM"), _status_mib("VmRSS"), _tensor_mib())
        if rank == 0 and args.where:
            results.put(events)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0 and not args.where:  # the largest of each over the ranks
            results.put(tuple(max(r[i] for r in every) for i in range(3)))
    finally:
        dist.destroy_process_group()


def _sample_blocks(blocks: list[Any], mark: Any) -> None:
    """``mark`` at each block's forward start and end, and (through its input's and
    output's gradients) at its backward's end and start."""
    for i, block in enumerate(blocks):

        def pre(module: Any, inputs: Any, i: int = i) -> None:
            mark(f"block {i} forward starts")
            if inputs[0].requires_grad:
                inputs[0].register_hook(lambda g, i=i: mark(f"block {i} backward ends"))

        def post(module: Any, inputs: Any, output: Any, i: int = i) -> None:
            mark(f"block {i} forward ends")
            output.register_hook(lambda g, i=i: mark(f"block {i} backward starts"))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _where(args: argparse.Namespace) -> None:
    """Both systems' rank 0 sampled through the last step, side by side."""
    found = {}
    for system in SYSTEMS:
        found[system] = on_two_ranks(
            partial(_rank, argparse.Namespace(**vars(args), system=system))
        )
    print(
        f"{'rank 0, MiB':<28} {'flatshard RSS':>14} {'HWM':>7} {'FSDP2 RSS':>10} {'HWM':>7} "
        f"{'RSS diff':>9}"
    )
    fsdp2 = {name: (rss, hwm) for name, rss, hwm in found["fsdp2"]}  # (its hooks' order
    for name, rss, hwm in found["flatshard"]:  # may differ where gradients meet)
        rss2, hwm2 = fsdp2[name]
        print(f"{name:<28} {rss:>14.1f} {hwm:>7.1f} {rss2:>10.1f} {hwm2:>7.1f} {rss - rss2:>+9.1f}")


def _measure(args: argparse.Namespace) -> tuple[float, float, float]:
    """(steady peak, at rest, tensors at rest) in MiB, the largest over the ranks, of one
    fresh run."""
    result: tuple[float, float, float] = on_two_ranks(partial(_rank, args))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--dim", type=int, default=448)
    parser.add_argument("--heads", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--where", action="store_true", help="where the step peaks (above)")
    parser.add_argument("--no-keep-last", action="store_true", help="(above)")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # read at process start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.where:
        _where(args)
        return
    peaks: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    rests: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    tensors: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for _ in range(args.rounds):
        for system in SYSTEMS:
            peak, rest, held = _measure(argparse.Namespace(**vars(args), system=system))
            peaks[system].append(peak)
            rests[system].append(rest)
            tensors[system].append(held)
    print(
        f"{'system':<10} {'steady peak RSS MiB':>20} {'at rest MiB':>12} "
        f"{'tensors at rest':>16}  (median; each round)"
    )
    for system in SYSTEMS:
        each = ", ".join(f"{p:.0f}" for p in peaks[system])
        print(
            f"{system:<10} {statistics.median(peaks[system]):>20.1f} "
            f"{statistics.median(rests[system]):>12.1f} "
            f"{statistics.median(tensors[system]):>16.1f}  ({each})"
        )
    ratio = statistics.median(peaks["flatshard"]) / statistics.median(peaks["fsdp2"])
    print(f"flatshard / fsdp2 steady peak: {ratio:.3f}x")


if __name__ == "__main__":
    main()
