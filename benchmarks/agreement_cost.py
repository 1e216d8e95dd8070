"""What one agreement through the c10d store costs: ``flatshard.no_sync`` entered 200 times
at 2 ranks on a sharded model, on a TCP store (torchrun's) and on a file store (the one
``flatshard bench``, ``flatshard train`` and the test pool use).

    python benchmarks/agreement_cost.py

Prints milliseconds per entry on rank 0 for each store. ``train_step`` agrees once per
step for this reason (docs/performance.md, "The agreed configuration").
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from two_ranks import on_two_ranks

import flatshard
from flatshard.testing.models import ReluLinear, ReluNet

ENTRIES = 200


def _measure(rank: int, world: int, init_method: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear})
    start = time.perf_counter()
    for _ in range(ENTRIES):
        with flatshard.no_sync(model):
            pass
    per_entry_ms = (time.perf_counter() - start) / ENTRIES * 1e3
    if rank == 0:
        results.put(per_entry_ms)
    dist.destroy_process_group()


def _on_file_store(rank: int, world: int, init_method: str, results: Any) -> None:
    path = os.path.join(
        tempfile.gettempdir(), f"flatshard-agreement-{init_method.rsplit(':', 1)[1]}"
    )
    _measure(rank, world, f"file://{path}", results)


if __name__ == "__main__":
    print(f"TCP store:  {on_two_ranks(_measure):.2f} ms per no_sync entry")
    print(f"file store: {on_two_ranks(_on_file_store):.2f} ms per no_sync entry")
