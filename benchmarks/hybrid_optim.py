"""HYBRID_SHARD_OPTIM against HYBRID_SHARD and FULL_SHARD at 4 CPU ranks (2 x 2 for the
hybrids): each rank's optimizer-state bytes (exact, AdamW's moments), parameter and
gradient bytes, bytes each rank sends per step, and step time, the strategies
interleaved step by step in one process group so that the machine's noise falls on all
alike (ratios to HYBRID_SHARD; the median of the timed steps):

    python benchmarks/hybrid_optim.py [--steps 6] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatshard
from flatshard.measure import CollectiveTracker, distinct_storage_bytes
from flatshard.models.gpt import GPT, GPTBlock

STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_OPTIM", "FULL_SHARD")
WORLD = 4


def build(args: argparse.Namespace, strategy: str) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(256, args.dim, 4, args.layers, 64)
    factor = 2 if strategy.startswith("HYBRID") else None
    flatshard.fully_shard(
        model, auto_wrap_policy={GPTBlock}, strategy=strategy, sharding_factor=factor
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: Any, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - start


def run(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    built = {s: build(args, s) for s in STRATEGIES}
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    sent: dict[str, int] = {}
    for index in range(args.steps + 2):
        for strategy, (model, optim) in built.items():
            with CollectiveTracker() as tracker:
                seconds = step(model, optim, tokens)
            if index >= 2:  # past the first steps (order recording, moments created)
                times[strategy].append(seconds)
                sent[strategy] = sum(tracker.bytes.values())
    rows = {}
    for strategy, (model, optim) in built.items():
        moments = [v for st in optim.state.values() for k, v in st.items() if k != "step"]
        params = list(model.parameters())
        grads_bytes = sum(p.numel() * p.element_size() for p in params)  # .grad: one each
        rows[strategy] = (
            distinct_storage_bytes(moments),
            sum(f.shard_numel for f in flatshard.sharding_summary(model).flat_params) * 4,
            grads_bytes,
            sent[strategy],
            statistics.median(times[strategy]),
        )
    every = [None] * WORLD
    dist.all_gather_object(every, rows)
    if rank == 0:
        base = statistics.median(r["HYBRID_SHARD"][4] for r in every)  # type: ignore[index]
        print(
            "strategy            optim state/rank  shard/rank  grads/rank  gathered+reduced  time"
        )
        for strategy in STRATEGIES:
            values = [r[strategy] for r in every]  # type: ignore[index]
            optim_bytes = max(v[0] for v in values)
            shard_bytes = max(v[1] for v in values)
            grad_bytes = max(v[2] for v in values)
            moved = max(v[3] for v in values)
            seconds = statistics.median(v[4] for v in values)
            print(
                f"{strategy:19} {optim_bytes / 2**20:12.2f} MiB {shard_bytes / 2**20:7.2f} MiB "
                f"{grad_bytes / 2**20:7.2f} MiB {moved / 2**20:12.2f} MiB  {seconds / base:5.2f}x"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, args), nprocs=WORLD)


if __name__ == "__main__":
    main()
