"""``flatshard bench``'s prediction line: what ``flatshard plan`` said of flatshard's run,
next to what the bench measured (the planner's accounting checked on every bench)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import flatshard
from flatshard.cli.bench.config import BenchConfig
from flatshard.models import GPT, GPTBlock
from flatshard.models.gpt import cut_to_stage
from flatshard.planner import Pipeline, cpu_cluster

MiB = 1 << 20


def predict(config: BenchConfig) -> dict[str, float]:
    """The plan of flatshard's bench run: tensor peak (MiB) and, on CPU (this machine,
    measured), the step (s); on a GPU memory only (the step depends on which GPU)."""

    cpu = config.device == "cpu"
    cluster = cpu_cluster(config.nproc) if cpu else "h200"
    plan = flatshard.plan(  # module-level callables: a process in a group plans in a child
        partial(_build, config),
        partial(_inputs, config),
        loss=_loss,
        auto_wrap_policy={GPTBlock},
        cluster=cluster,
        ranks_per_host=config.nproc,
        optimizer=config.optimizer,
        grad_accum=config.grad_accum,
        clip=False,  # the bench's step does not clip
        pipeline=(
            Pipeline(config.pp, config.grad_accum, cut_to_stage, _stage_loss, config.pp_schedule)
            if config.pp > 1
            else None
        ),
    )
    predicted = {"tensor_peak_mib": plan.peak_memory_bytes / MiB}
    if cpu:
        predicted["median_step_s"] = plan.step.seconds
    if plan.pipeline is not None:
        predicted["bubble"] = plan.pipeline.bubble_fraction
    return predicted


def _build(config: BenchConfig) -> nn.Module:
    """The bench's GPT (--pp: the head untied, as the bench's stages hold it)."""
    shape = (config.vocab, config.dim, config.heads, config.layers, config.seq_len)
    return GPT(*shape, config.tied and config.pp == 1)


def _inputs(config: BenchConfig) -> tuple[torch.Tensor, ...]:
    """One micro-batch."""
    rows = config.batch // config.grad_accum
    return (torch.randint(0, config.vocab, (rows, config.seq_len)),)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    logits = model(batch[0])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].flatten())


def _stage_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].flatten())


def predicted_line(predicted: dict[str, float], measured: dict[str, float]) -> str:
    line = (
        f"flatshard plan predicted: tensors {predicted['tensor_peak_mib']:,.1f} MiB "
        f"(measured {measured['tensor_peak_mib']:,.1f})"
    )
    if "median_step_s" in predicted:
        step, actual = predicted["median_step_s"], measured["median_step_s"]
        line += f", step {step:.3f} s (measured {actual:.3f})"
    if "bubble" in predicted and "bubble" in measured:
        line += f", bubble {predicted['bubble']:.2f} (measured {measured['bubble']:.2f})"
    return line
