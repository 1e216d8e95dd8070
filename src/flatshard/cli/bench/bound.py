"""The "comm" system of ``flatshard bench``: the least collectives of a sharded step, alone.

[Note: the achievable bound]
On CPUs both ranks compute on the cores that gloo's copies need, so communication cannot
overlap compute: a data-parallel step costs at least the floor (each rank training alone)
plus the CPU time of the collectives its strategy cannot do without. For FULL_SHARD those
are, per micro-batch, each unit's parameters all-gathered for forward and each block's
again for backward but the last block's (backward starts with it: it can stay gathered, as
can the root, whose forward spans the whole step), and per step each unit's gradient
reduce-scattered once, in the cheapest form gloo offers: an all-to-all of the gradient's
chunks and a sum of the chunks received (each rank sends (W - 1) / W of the gradient,
what a ring sends). The "comm" system issues
exactly those and nothing else, on fp32 buffers of the units' sizes (each block, and the
root's remaining parameters; experts and row-sparse tables too, as plain rows), and the
bench takes rank 0's CPU seconds per step (all its threads) as their cost. The bound is the
floor plus that cost, the same for every system: a system that moves more than the least
pays for it in its ratio to the bound. A system can go below it by moving less than the
least (row-sparse tables send rows, expert parallelism keeps the experts where they are).
On GPUs collectives run beside compute on other engines: there the bound is the floor,
and "comm" is not run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flatshard.models import GPT

# torch 2.13 names it all_gather_single and warns on the old name (kept before 2.13)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LeastCollectives(nn.Module):
    """One rank's buffers for the collectives of [Note: the achievable bound]."""

    def __init__(self, gpt: GPT, world: int, device: torch.device) -> None:
        super().__init__()
        blocks = [sum(p.numel() for p in block.parameters()) for block in gpt.blocks]
        root = sum(p.numel() for p in gpt.parameters()) - sum(blocks)
        chunks = [-(-n // world) for n in [root, *blocks]]  # each rank's rows, padded
        self.world = world
        self.shards = [torch.zeros(c, device=device) for c in chunks]
        self.gathered = [torch.empty(c * world, device=device) for c in chunks]
        self.grads = [torch.ones(c * world, device=device) for c in chunks]
        self.received = [torch.empty(c * world, device=device) for c in chunks]

    def step(self, micro_batches: int) -> None:
        """Forward's gathers (the root first), backward's (from the last block but one)
        each micro-batch; one reduction per unit at the end of the step."""
        units = range(len(self.shards))
        for _ in range(micro_batches):
            for unit in units:
                _ALL_GATHER(self.gathered[unit], self.shards[unit])
            for unit in reversed(units[1:-1]):
                _ALL_GATHER(self.gathered[unit], self.shards[unit])
        for unit in reversed(units):
            dist.all_to_all_single(self.received[unit], self.grads[unit])
            self.received[unit].view(self.world, -1).sum(0)
