"""Decoding on a sharded model: every token all-gathers each unit, unless kept gathered.

A Hugging Face Llama (width 256, 8 layers) on 2 gloo ranks generates 32 tokens greedily,
twice each way, interleaved: plain ``generate`` on the sharded model (each forward gathers
every unit and frees it), and ``generate`` inside ``summon_full_params(model,
writeback=False)`` under ``torch.no_grad()`` (gathered once, no collective per token; the
whole model on every rank). Prints rank 0's seconds per token for each, and checks the
tokens are the same.

    python benchmarks/generate_gathered.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import flatshard

CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
TOKENS = 32


def _generate(model: LlamaForCausalLM, gathered: bool) -> tuple[float, list[int]]:
    prompt = torch.arange(8).reshape(1, 8)
    start = time.perf_counter()
    if gathered:
        with flatshard.summon_full_params(model, writeback=False), torch.no_grad():
            out = model.generate(prompt, max_new_tokens=TOKENS, do_sample=False)
    else:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=TOKENS, do_sample=False)
    return (time.perf_counter() - start) / TOKENS, [int(t) for t in out[0]]


def _rank(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer})
    seconds: dict[bool, list[float]] = {False: [], True: []}
    tokens = {}
    for _ in range(2):
        for gathered in (False, True):
            per_token, tokens[gathered] = _generate(model, gathered)
            seconds[gathered].append(per_token)
    assert tokens[False] == tokens[True]
    if rank == 0:
        for gathered, name in ((False, "sharded"), (True, "kept gathered")):
            print(f"{name:<14} {statistics.median(seconds[gathered]) * 1e3:7.1f} ms per token")
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"),), nprocs=2)


if __name__ == "__main__":
    main()
