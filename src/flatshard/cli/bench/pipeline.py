"""``flatshard bench --pp``: each system's GPT cut into pipeline stages, run by torch's schedule.

Every rank builds the GPT as ``flatshard train --pp`` cuts it (``cut_to_stage``: its blocks,
the embeddings on the first stage, the final norm and the untied head on the last), shards
its stages over the ranks that hold the same stage (flatshard: ``fully_shard`` with one unit
per block, ``flatshard.integrations.pipelining.PipelineStage``; FSDP2: ``fully_shard`` per
block and on the stage, torch's ``PipelineStage``) on a ("pp", "dp") mesh, and runs
``--pp-schedule`` over ``--grad-accum`` micro-batches of its ``--batch`` sequences.

[Note: the bubble, measured]
A rank's bubble is its share of the step spent outside its stages' forward, backward and
weight passes (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``:
the sharding's own collectives inside them count as work): waiting for a neighbour's
activations or gradients, and the schedule's own bookkeeping. The bench reports its mean
over the ranks, beside the planner's estimate of the same layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flatshard
from flatshard.cli.bench.config import BenchConfig
from flatshard.models import GPT, GPTBlock
from flatshard.models.gpt import cut_to_stage

_PASSES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class PipelinedGPT(nn.Module):
    """This rank's stages of the GPT and the schedule that runs them; ``busy_s``: the
    seconds spent inside their passes so far ([Note: the bubble, measured])."""

    def __init__(self, parts: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.first, self.last = first, last
        self.schedule: Any = None
        self.busy_s = 0.0
        self._depth = 0  # a pass inside a pass counts once

    def timed(self, stage: Any) -> Any:
        """``stage`` with its passes timed into ``busy_s``."""
        for name in _PASSES:
            setattr(stage, name, self._timer(getattr(stage, name)))
        return stage

    def _timer(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.busy_s += time.perf_counter() - start

        return timed

    def train_step(
        self, idx: torch.Tensor, optimizers: list[torch.optim.Optimizer], system: str
    ) -> None:
        """One optimizer step: the schedule over this replica's sequences (flatshard's
        through ``flatshard.train_step``, as ``flatshard train --pp`` takes it)."""
        inputs, target = idx[:, :-1], idx[:, 1:]
        args = (inputs,) if self.first else ()

        def run(_: int) -> torch.Tensor:
            self.schedule.step(*args, target=target if self.last else None)
            return torch.zeros(())

        if system == "flatshard":
            flatshard.train_step(self.parts, optimizers, run, accumulation="schedule")
            return
        run(0)
        for optim in optimizers:
            optim.step()
            optim.zero_grad()


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def build_pipelined(config: BenchConfig, system: str, device: torch.device) -> PipelinedGPT:
    """This rank's stages of ``system``, sharded over their data-parallel ranks, and the
    schedule (see the module docstring)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from flatshard.integrations.pipelining import PipelineStage

    mesh = init_device_mesh(
        device.type, (config.pp, config.nproc // config.pp), mesh_dim_names=("pp", "dp")
    )
    rank, stages = mesh.get_local_rank("pp"), config.pp_stages
    group = mesh["pp"].get_group()
    parts, built = [], []
    for index in range(rank, stages, config.pp):
        torch.manual_seed(0)
        gpt = GPT(config.vocab, config.dim, config.heads, config.layers, config.seq_len, False)
        cut_to_stage(gpt, index, stages)
        gpt = gpt.to(device)
        if system == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in gpt.blocks:
                if isinstance(block, GPTBlock):
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(gpt, mesh=mesh["dp"])
            part: nn.Module = gpt
            stage: Any = TorchStage(part, index, stages, device, group=group)
        else:
            part = flatshard.fully_shard(gpt, auto_wrap_policy={GPTBlock}, process_group=mesh["dp"])
            stage = PipelineStage(part, index, stages, device, group=group)
        parts.append(part)
        built.append(stage)
    run = PipelinedGPT(parts, first=rank == 0, last=rank == config.pp - 1)
    timed = [run.timed(stage) for stage in built]
    micro = config.grad_accum
    if config.pp_schedule == "interleaved":
        run.schedule = ScheduleInterleaved1F1B(timed, micro, loss_fn=_next_token_loss)
    elif config.pp_schedule == "zero-bubble":
        run.schedule = ScheduleInterleavedZeroBubble(timed, micro, loss_fn=_next_token_loss)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[config.pp_schedule]
        run.schedule = kind(timed[0], micro, loss_fn=_next_token_loss)
    return run
