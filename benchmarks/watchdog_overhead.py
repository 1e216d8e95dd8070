"""What the watchdog adds to one collective: always on, and in debug mode.

Two gloo ranks all-gather 1 KiB per rank, in blocks of 200, three ways interleaved: the raw
``torch.distributed`` call, flatshard's (recorded, then waited for in timed slices: see
[Note: diagnosing a hang] in ``comm/_watchdog.py``), and flatshard's in debug mode (each
collective first agreed on through the c10d store: a TCPStore, as torchrun makes).
Prints the median and minimum microseconds per collective. Multiply by the collectives
of a step (about 2 per unit in forward and 2 in backward) for the step's cost.

    python benchmarks/watchdog_overhead.py
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatshard
from flatshard.testing.internals import collective_tag, gather_now

BLOCK = 200


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.group.WORLD
    assert group is not None
    x, out, tag = torch.ones(256), torch.empty(512), collective_tag()

    def raw() -> None:
        dist.all_gather_into_tensor(out, x, group=group, async_op=True).wait()

    def watched() -> None:
        gather_now(out, x, group, tag)

    def debug() -> None:
        flatshard.set_checks(flatshard.Checks(debug=True))
        gather_now(out, x, group, tag)
        flatshard.set_checks(flatshard.Checks())

    ways: dict[str, Callable[[], None]] = {"raw": raw, "flatshard": watched, "debug": debug}
    seen: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(21):
        for name, way in list(ways.items())[round_ % 3 :] + list(ways.items())[: round_ % 3]:
            start = time.perf_counter()
            for _ in range(BLOCK):
                way()
            if round_:  # the first round warms up
                seen[name].append((time.perf_counter() - start) / BLOCK * 1e6)
    if rank == 0:
        for name, times in seen.items():
            print(
                f"{name:<10} median {statistics.median(times):7.1f} us per collective, "
                f"min {min(times):7.1f}"
            )
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as probe:  # a free port for rank 0's TCPStore
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
