"""``flatshard plan --cluster cpu`` against real runs on this machine: step time and peak.

Run: .venv/bin/python benchmarks/plan_vs_measured.py  (about a minute and a half; needs
transformers for the Llama row). For each setup it plans with this machine measured
(``cluster="cpu"``) and then runs the same training steps on gloo ranks: the median of 5
steps after 2 warm-up steps, and the steady-state peak of live tensors on rank 0 (with
CPU offload, of both memories: on a CPU they are one). Prints a markdown table with the
ratios.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.cli.lm.planned import language_model_loss
from flatshard.models import GPT, GPTBlock
from flatshard.testing.internals import measured_step_peak, measured_step_seconds
from flatshard.testing.isolated import run_isolated

S = flatshard.ShardingStrategy
VOCAB, SEQ, BATCH = 256, 128, 4


def gpt(checkpointing: bool = False, dim: int = 256) -> nn.Module:
    """With GPT-2's init, as ``flatshard train`` builds it. (PyTorch's default init of this
    shape sends backward's matrix products into subnormal floats on this CPU, 8-30x
    slower (``torch.set_flush_denormal(True)`` removes it): data-dependent speed that no
    plan made from shapes can see.)"""
    model = GPT(VOCAB, dim, 4, 4, SEQ)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    model.checkpoint_blocks = checkpointing
    return model


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def llama_units() -> set[type[nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


def tokens() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ)),)


def train_tokens() -> tuple[torch.Tensor, ...]:
    """``flatshard train``'s default micro-batch: 16 x 128 bytes."""
    return (torch.randint(0, VOCAB, (16, SEQ)),)


CASES: list[tuple[str, Any, int, dict[str, Any]]] = [
    ("GPT FULL_SHARD, 2 ranks", gpt, 2, {}),
    ("GPT SHARD_GRAD_OP + checkpointing, 2 ranks", partial(gpt, True), 2,
     {"strategy": S.SHARD_GRAD_OP}),
    ("GPT NO_SHARD, 1 rank", gpt, 1, {"strategy": S.NO_SHARD}),
    ("GPT FULL_SHARD, 4 ranks (oversubscribed)", gpt, 4, {}),
    ("Llama (transformers) FULL_SHARD, 2 ranks", llama, 2, {}),
    ("GPT FULL_SHARD + CPU offload, 2 ranks", gpt, 2, {"cpu_offload": True}),
    # flatshard train's defaults: width 128, 16 x 128 tokens (attention's memory-bound ops
    # on 4 MiB tensors weigh more).
    ("GPT width 128, batch 16 (train's default), 2 ranks", partial(gpt, dim=128), 2,
     {"inputs": train_tokens}),
]  # fmt: skip


def _rank(rank: int, world: int, index: int, setup: Any) -> tuple[int, float]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    build, inputs = CASES[index][1], CASES[index][3].get("inputs", tokens)
    group = dist.group.WORLD
    assert group is not None
    peak = measured_step_peak(build, inputs, language_model_loss, setup, group)
    seconds = measured_step_seconds(build, inputs, language_model_loss, setup, group)
    return peak, seconds


def measured(index: int, world: int, setup: Any) -> tuple[int, float]:
    """Rank 0's steady-state peak and median step, on ``world`` fresh gloo ranks."""
    outcomes = run_isolated(_rank, world, index, setup, world_size=world, deadline_s=600)
    result: tuple[int, float] = outcomes[0]
    return result


def main() -> None:
    print(
        "| setup | predicted / measured peak (MiB) | predicted / measured step (s) | step ratio |"
    )
    print("|---|---|---|---|")
    for index, (label, build, world, options) in enumerate(CASES):
        units = llama_units() if build is llama else {GPTBlock}
        options = dict(options)
        inputs = options.pop("inputs", tokens)
        plan = flatshard.plan(
            build, inputs, loss=language_model_loss, auto_wrap_policy=units, cluster="cpu",
            ranks_per_host=world, **options,
        )  # fmt: skip
        peak, seconds = measured(index, world, plan.setup)
        mib = 1 << 20
        print(
            f"| {label} | {plan.total_peak_bytes / mib:.1f} / {peak / mib:.1f} "
            f"| {plan.step.seconds:.3f} / {seconds:.3f} | {plan.step.seconds / seconds:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
