"""The flatshard source files one parameter's life runs through, counted by tracing.

    python benchmarks/parameter_path.py

Two gloo ranks shard a small model (``ReluNet``, FULL_SHARD, its blocks as units), then
forward, backward, AdamW step, a second forward and backward, and a full state dict. Every
flatshard file whose code runs on rank 0 is counted (``sys.settrace`` on the main thread,
calls only), by the phase that first ran it. The model's own file (``testing/models.py``)
is left out: it is the user's code here.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from two_ranks import on_two_ranks

import flatshard
from flatshard.testing.models import ReluLinear, ReluNet

ROOT = os.path.dirname(flatshard.__file__)
USER_CODE = {os.path.join("testing", "models.py")}


def _trace(rank: int, world: int, init_method: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    first_seen: dict[str, str] = {}
    phase = ["fully_shard"]

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT):
            name = os.path.relpath(path, ROOT)
            if name not in USER_CODE:
                first_seen.setdefault(name, phase[0])

    torch.manual_seed(0)
    net = ReluNet()
    x = torch.randn(3, 4)
    sys.settrace(tracer)  # type: ignore[arg-type]
    model = flatshard.fully_shard(net, auto_wrap_policy={ReluLinear})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in ("", " again"):
        phase[0] = "forward" + step
        loss = model(x).sum()
        phase[0] = "backward" + step
        loss.backward()
        phase[0] = "optimizer step" + step
        optim.step()
        optim.zero_grad()
    phase[0] = "full state dict"
    flatshard.full_state_dict(model)
    sys.settrace(None)
    if rank == 0:
        results.put(first_seen)
    dist.destroy_process_group()


def main() -> None:
    first_seen: dict[str, str] = on_two_ranks(_trace)
    by_phase: dict[str, list[str]] = {}
    for name, phase in first_seen.items():
        by_phase.setdefault(phase, []).append(name)
    for phase, names in by_phase.items():
        print(f"{phase}: {len(names)} ({', '.join(sorted(names))})")
    print(f"files: {len(first_seen)}")


if __name__ == "__main__":
    main()
