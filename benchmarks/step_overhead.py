"""flatshard's per-step CPU overhead on a model too small for compute to hide it.

One rank (gloo, nothing to communicate), a GPT of 8 blocks of width 64: a step is mostly
Python and autograd bookkeeping, which is what a fast GPU exposes. Prints the minimum and
median step time of flatshard and of the same model unsharded ("floor") in one process,
their steps interleaved. To compare two versions of flatshard, run it under each
(``PYTHONPATH=<checkout>/src python benchmarks/step_overhead.py``), alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.models import GPT, GPTBlock


def _step(model: nn.Module, optim: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(idx[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{os.path.join(tmp, 'store')}"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            floor = GPT(256, 64, 4, 8, 32)
            sharded = flatshard.fully_shard(GPT(256, 64, 4, 8, 32), auto_wrap_policy={GPTBlock})
            systems = {"flatshard": sharded, "floor": floor}
            optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in systems.items()}
            times: dict[str, list[float]] = {k: [] for k in systems}
            gen = torch.Generator().manual_seed(0)
            for step in range(args.steps + 5):
                idx = torch.randint(0, 256, (2, 33), generator=gen)
                for name, model in systems.items():
                    took = _step(model, optims[name], idx)
                    if step >= 5:
                        times[name].append(took)
        finally:
            dist.destroy_process_group()
    for name, values in times.items():
        low, mid = min(values) * 1e3, statistics.median(values) * 1e3
        print(f"{name:10s} min {low:.2f} ms  median {mid:.2f} ms")
    over = [a - b for a, b in zip(times["flatshard"], times["floor"], strict=True)]
    print(f"flatshard over floor: median {statistics.median(over) * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
