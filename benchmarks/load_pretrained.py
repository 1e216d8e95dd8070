"""Starting a sharded model from a pretrained checkpoint: sharded loading against rank 0.

A Hugging Face Llama (width 512, 8 layers, vocabulary 8192: about 30M parameters) saved
with ``save_pretrained`` in several files is started on 2 gloo ranks two ways:
- "rank0+sync": rank 0 ``from_pretrained``, the other ranks build on meta, and
  ``fully_shard(..., init=InitOptions(sync_module_states=True))`` broadcasts unit by unit
  (the usual recipe);
- "sharded": every rank builds on meta, ``fully_shard(..., param_init_fn=skip_init)``, then
  ``flatshard.load_safetensors`` reads each rank's rows.
Prints per rank the wall time (build + shard + load, ranks started together) and the peak
of live tensor storage created meanwhile (``PeakStorage``: at the dispatcher), in MiB.

    python benchmarks/load_pretrained.py
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import flatshard
from flatshard.measure import PeakStorage

CONFIG = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}


def _rank0_sync(rank: int, directory: str) -> Any:
    if rank == 0:
        model = LlamaForCausalLM.from_pretrained(directory)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model.model.rotary_emb = LlamaRotaryEmbedding(config=LlamaConfig(**CONFIG))
    init = flatshard.InitOptions(sync_module_states=True)
    return flatshard.fully_shard(
        model, auto_wrap_policy={LlamaDecoderLayer}, init=init, device="cpu"
    )


def _sharded(rank: int, directory: str) -> Any:
    config = LlamaConfig(**CONFIG)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    flatshard.fully_shard(
        model,
        auto_wrap_policy={LlamaDecoderLayer},
        param_init_fn=flatshard.skip_init,
        device="cpu",
    )
    flatshard.load_safetensors(model, directory)
    return model


def _rank(rank: int, store: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    probe = torch.arange(16).reshape(2, 8)
    logits = {}
    for name, start in (("rank0+sync", _rank0_sync), ("sharded", _sharded)):
        dist.barrier()
        began = time.perf_counter()
        with PeakStorage() as peak:
            model = start(rank, directory)
        seconds = time.perf_counter() - began
        with torch.no_grad():
            logits[name] = model(probe).logits
        print(f"rank {rank} {name:<11} {seconds:6.2f} s  peak {peak.peak / 2**20:7.1f} MiB")
        del model
    assert torch.equal(logits["rank0+sync"], logits["sharded"])
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
        model.save_pretrained(tmp, max_shard_size="40MB")
        del model
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), tmp), nprocs=2)


if __name__ == "__main__":
    main()
