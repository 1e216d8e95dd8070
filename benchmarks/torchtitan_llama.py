"""torchtitan's Llama 3 debug model at 2 ranks (gloo, fp32): flatshard against FSDP2,
DeepSpeed ZeRO-3 and the no-communication floor, step time and peak RSS.

    python benchmarks/torchtitan_llama.py [--steps 8] [--batch 4] [--seq-len 256]

The model is torchtitan's own ``debugmodel`` (6 blocks, dim 256, vocabulary 2048, untied),
built by its config classes with FlexAttention swapped for SDPA (no FlexAttention kernels on
a CPU). Each system runs in a fresh pair of processes, in turn: flatshard (each block a
unit, ``flatshard.fully_shard``), FSDP2 (``fully_shard`` on each block, then the model),
DeepSpeed ZeRO-3 (``flatshard bench``'s engine: its defaults but no clipping, the same torch
AdamW; where DeepSpeed is installed) and the floor (each rank trains alone: no
communication). Each rank trains on its own batch
with AdamW; 2 warm-up steps, then ``--steps`` timed. Prints rank 0's median step, its ratio
to FSDP2's and the floor's, and rank 0's peak RSS. Needs ``pip install --no-deps
torchtitan`` (and its light dependencies).
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from two_ranks import on_two_ranks

from flatshard.cli.bench.zero3 import missing

SYSTEMS = ("flatshard", "fsdp2", "deepspeed", "floor")


def build() -> tuple[nn.Module, type[nn.Module]]:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = config.build()
    model.init_states(buffer_device=None)
    return model, type(model.layers["0"])


def run(
    system: str, options: argparse.Namespace, rank: int, world: int, address: str, results: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    torch.manual_seed(0)
    model, block = build()
    if system == "flatshard":
        import flatshard

        flatshard.fully_shard(model, auto_wrap_policy={block})
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if isinstance(module, block):
                fully_shard(module)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = None
    if system == "deepspeed":
        from flatshard.cli.bench.zero3 import zero3_engine

        engine = zero3_engine(model, optim, options.batch, 1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(2 + options.steps):
        tokens = torch.randint(0, 2048, (options.batch, options.seq_len + 1), generator=gen)
        start = time.perf_counter()
        logits = (model if engine is None else engine)(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if engine is None:
            loss.backward()
            optim.step()
            optim.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.put((statistics.median(times), rss_mib))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    options = parser.parse_args()
    systems = [s for s in SYSTEMS if s != "deepspeed" or not missing()]
    found = {s: on_two_ranks(functools.partial(run, s, options)) for s in systems}
    fsdp2, floor = found["fsdp2"][0], found["floor"][0]
    print("system      step s  vs fsdp2  vs floor  peak RSS MiB (rank 0)")
    for system, (step, rss) in found.items():
        print(f"{system:<10} {step:7.3f}  {step / fsdp2:7.2f}x {step / floor:8.2f}x  {rss:10,.0f}")


if __name__ == "__main__":
    main()
