"""The planner against the FSDP paper's figures (Zhao et al., 2023), on the paper's cluster.

Run: .venv/bin/python benchmarks/plan_paper.py  (about 10 minutes on 2 CPU cores; needs
transformers for T5). Prints a markdown table: predicted per-GPU TFLOP/s (executed FLOPs,
recomputation included, over the predicted step) next to the paper's, and whether DDP
(NO_SHARD) and FSDP fit in 80 GB. The cluster is the ``a100-80gb`` preset: A100 80GB,
312 TFLOPS bf16, NVLink inside hosts of 8, 2 Tb/s RoCE between hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

import flatshard
from flatshard.cli.lm.model import checkpoint_hf_blocks
from flatshard.models import GPT, GPTBlock

S = flatshard.ShardingStrategy
GPT_175B = {"vocab": 50304, "dim": 12288, "heads": 96, "layers": 96, "seq_len": 2048}
# T5 sizes (transformers' T5Config fields); 2.28B and 11B as in the paper's figures.
T5 = {
    "T5-2.28B": {"d_model": 1024, "d_ff": 16384, "num_heads": 32, "d_kv": 64, "num_layers": 24},
    "T5-11B": {"d_model": 1024, "d_ff": 65536, "num_heads": 128, "d_kv": 128, "num_layers": 24},
}
T5_TOKENS = 512


def gpt_175b(batch: int, hosts: int) -> flatshard.Plan:
    def build() -> nn.Module:
        model = GPT(**GPT_175B)
        model.checkpoint_blocks = True
        return model

    def inputs() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, GPT_175B["vocab"], (batch, GPT_175B["seq_len"])),)

    def loss(model: nn.Module, batch_: tuple[torch.Tensor, ...]) -> torch.Tensor:
        logits = model(batch_[0])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch_[0].flatten())

    return flatshard.plan(
        build, inputs, loss=loss, auto_wrap_policy={GPTBlock}, cluster="a100-80gb",
        hosts=hosts, ranks_per_host=8, mixed_precision=torch.bfloat16,
    )  # fmt: skip


def t5(name: str, batch: int, hosts: int, strategy: flatshard.ShardingStrategy) -> flatshard.Plan:
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    config = T5Config(vocab_size=32128, decoder_start_token_id=0, pad_token_id=0, **T5[name])

    def build() -> nn.Module:
        model = T5ForConditionalGeneration(config)
        checkpoint_hf_blocks(model)
        return model

    def inputs() -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, 32128, (batch, T5_TOKENS))
        return ids, ids

    def loss(model: nn.Module, batch_: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out: torch.Tensor = model(input_ids=batch_[0], labels=batch_[1]).loss
        return out

    return flatshard.plan(
        build, inputs, loss=loss, auto_wrap_policy={T5Block}, cluster="a100-80gb",
        hosts=hosts, ranks_per_host=8, mixed_precision=torch.bfloat16, strategy=strategy,
    )  # fmt: skip


def row(label: str, make: Callable[[], flatshard.Plan], paper: str) -> None:
    start = time.perf_counter()
    p = make()
    print(
        f"| {label} | {p.tflops_per_device:.0f} | {paper} | {p.peak_memory_bytes / 2**30:.1f} GiB"
        f" | {'fits' if p.fits else 'out of memory'} | {p.step.seconds:.2f} s "
        f"| {time.perf_counter() - start:.0f} s |",
        flush=True,
    )


def main() -> None:
    print(
        "| setup | predicted TFLOP/s per GPU | paper | peak per GPU | 80 GB | step | planned in |"
    )
    print("|---|---|---|---|---|---|---|")
    for gpus in (128, 512):
        for batch, paper in ((1, ">173"), (2, ">186")):
            row(f"GPT-175B, {gpus} GPUs, batch {batch}", partial(gpt_175b, batch, gpus // 8), paper)
    for gpus in (8, 512):
        fsdp = partial(t5, "T5-11B", 8, gpus // 8, S.FULL_SHARD)
        row(f"T5-11B FSDP, {gpus} GPUs, batch 8", fsdp, "-7% from 8 to 512 GPUs")
    for name in T5:
        ddp = partial(t5, name, 8, 1, S.NO_SHARD)
        row(f"{name} DDP (NO_SHARD), 8 GPUs, batch 8", ddp, "DDP out of memory above 2.28B")


if __name__ == "__main__":
    main()
