"""Reproduces the exit-time SIGABRT race that flatshard guards against (see
``StepContext.release_process_groups``): a sharded model trains a few steps, a forward
without backward ends with flatshard's step check, the process group is destroyed, and the
script exits with the model still alive. Before the guard, 1 run in 10 to 20 died with
"terminate called without an active exception" (a gloo worker needing the GIL during
interpreter finalization). Run it repeatedly and count failures::

    for i in $(seq 20); do torchrun --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint localhost:0 benchmarks/exit_race.py > /dev/null 2>&1 || echo fail; done
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.models import GPT, GPTBlock


def main() -> nn.Module:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = flatshard.fully_shard(GPT(256, 32, 2, 2, 32), auto_wrap_policy={GPTBlock})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (4, 33))
    for _ in range(6):
        logits = model(idx[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()
    with torch.no_grad():
        model(idx[:, :-1])  # ends with the step check's collective
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    MODEL = main()  # alive until the interpreter exits, as in most training scripts
