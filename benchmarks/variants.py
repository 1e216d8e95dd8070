"""A/B of flatshard's runtime choices on the bench GPT, interleaved in fresh processes.

Run: .venv/bin/python benchmarks/variants.py [--rounds 2] [--steps 4] [--only V1,V2,...]
    [--shape bench|llm-32k]

Shapes (2 ranks, gloo, one thread per rank): bench, the 31M-parameter GPT of vocabulary
8,192 (width 512, 8 blocks, batch 4 x 256 tokens); llm-32k, the bench preset's 23M GPT
with a 32,768-token vocabulary tied to the head (width 384, 6 blocks, 4 x 256 tokens).
Variants:
  defaults      fully_shard defaults (forward prefetch, BACKWARD_PRE, last unit kept)
  no-keep-last  as defaults, but the last unit of forward is resharded and gathered again
  no-fwd        as defaults, without forward prefetch
  no-bwd        as defaults, without backward prefetch
  none          no prefetch at all, last unit resharded (the plain FSDP schedule)
  rs-all-reduce as defaults, reduce-scatter as an in-place all-reduce (not all-to-all)
  floor         every rank trains alone (no communication)
Prints the median step time of each and its ratio to the defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flatshard
from flatshard.models import GPT, GPTBlock
from flatshard.testing import internals

VARIANTS = (
    "defaults",
    "no-keep-last",
    "no-fwd",
    "no-bwd",
    "none",
    "rs-all-reduce",
    "floor",
)
# (vocab, dim, heads, layers, tokens per sequence)
SHAPES = {"bench": (8192, 512, 8, 8, 256), "llm-32k": (32768, 384, 6, 6, 256)}


def build(variant: str, shape: str) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(*SHAPES[shape])
    if variant == "floor":
        return model
    if variant in ("no-keep-last", "none"):
        internals.no_keep_last_unit()
    if variant == "rs-all-reduce":
        internals.forced_reduce_scatter(internals.ReduceScatter.ALL_REDUCE).__enter__()
    prefetch = flatshard.Prefetch(
        forward=variant not in ("no-fwd", "none"),
        backward=None if variant in ("no-bwd", "none") else flatshard.BackwardPrefetch.BACKWARD_PRE,
    )
    return flatshard.fully_shard(model, auto_wrap_policy={GPTBlock}, prefetch=prefetch)


def worker(rank: int, store: str, variant: str, shape: str, steps: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = build(variant, shape)
    vocab = SHAPES[shape][0]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 1):  # the first step records the forward order: untimed
        idx = torch.randint(0, vocab, (4, 257), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        logits = model(idx[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", help="comma-separated variants to run (defaults always runs)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    args = parser.parse_args()
    chosen = VARIANTS if args.only is None else ("defaults", *args.only.split(","))
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    ctx = mp.get_context("spawn")
    times: dict[str, list[float]] = {v: [] for v in chosen}
    for _ in range(args.rounds):
        for variant in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                results = ctx.Queue()
                store = os.path.join(tmp, "store")
                procs = [
                    ctx.Process(
                        target=worker, args=(r, store, variant, args.shape, args.steps, results)
                    )
                    for r in range(2)
                ]
                for proc in procs:
                    proc.start()
                times[variant] += results.get(timeout=1800)
                for proc in procs:
                    proc.join()
    base = statistics.median(times["defaults"])
    for variant in chosen:
        median = statistics.median(times[variant])
        print(f"{variant:<13} median step {median:.3f} s   vs defaults {median / base:.3f}x")


if __name__ == "__main__":
    main()
