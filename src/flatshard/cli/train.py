"""``flatshard train``: train a small GPT, sharded over local CPU ranks or under torchrun.

The data is generated: sequences from a fixed random Markov chain, so the model has
something to learn (loss falls from ln(vocab) towards the chain's entropy) with no download.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import flatshard
from flatshard.cli.config import ConfigError, add_config_parser, config_from_args
from flatshard.models import GPT, GPTBlock

PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``flatshard train``."""

    nproc: int = 2  # local ranks to start when not under torchrun
    steps: int = 40  # optimizer steps
    batch: int = 8  # sequences per rank per step
    seq_len: int = 32  # tokens per sequence
    vocab: int = 64  # token ids of the generated data
    dim: int = 64  # model width
    layers: int = 4  # transformer blocks, one unit each
    heads: int = 4  # attention heads
    lr: float = 3e-3  # AdamW learning rate
    seed: int = 0  # model and data seed
    mixed_precision: str = "none"  # none | bf16 | fp16 (fp16 adds a ShardedGradScaler)

    def __post_init__(self) -> None:
        for name in ("nproc", "steps", "batch", "seq_len", "vocab", "dim", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.dim % self.heads:
            raise ConfigError(f"--dim ({self.dim}) must be a multiple of --heads ({self.heads})")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"--mixed-precision must be one of {', '.join(PRECISIONS)}, "
                f"got {self.mixed_precision!r}"
            )


def add_parser(commands: Any) -> None:
    add_config_parser(
        commands,
        "train",
        help="train a small GPT on generated data, sharded with flatshard",
        description=__doc__,
        config=TrainConfig,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(TrainConfig, args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _train(config, store=None)
        return 0
    with tempfile.TemporaryDirectory(prefix="flatshard-train-") as tmp:
        store = os.path.join(tmp, "store")
        return _spawn(config, store)


def _spawn(config: TrainConfig, store: str) -> int:
    """Start one process per local rank; the first failure's exit code is ours."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, config, store)) for r in range(config.nproc)]
    for proc in procs:
        proc.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode for p in procs):  # a rank failed: the others would wait forever
            for proc in procs:
                proc.terminate()
        procs[0].join(timeout=0.2)
    failed = [p.exitcode for p in procs if p.exitcode]
    return 1 if failed else 0


def _worker(rank: int, config: TrainConfig, store: str) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(config.nproc)
    _train(config, store)


def _train(config: TrainConfig, store: str | None) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = f"file://{store}" if store else "env://"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        device = _device(backend)
        low = PRECISIONS[config.mixed_precision]
        model = flatshard.fully_shard(
            _build_model(config).to(device),
            auto_wrap_policy={GPTBlock},
            mixed_precision=flatshard.MixedPrecision(low, reduce_dtype=torch.float32)
            if low is not None
            else None,
        )
        scaler = flatshard.ShardedGradScaler(device.type, enabled=low is torch.float16)
        optim = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
        chain = _markov_chain(config)
        if rank == 0:
            total = sum(p.numel() for p in _build_model(config).parameters())
            print(
                f"flatshard train: {world} ranks ({backend}), {total:,} parameters, "
                f"{config.steps} steps; uniform loss {math.log(config.vocab):.3f}"
            )
            print(flatshard.sharding_summary(model))
            if low is not None:
                print("dtype plan (master = optimizer state dtype):")
                print(flatshard.dtype_plan(model))
        gen = torch.Generator().manual_seed(config.seed * 1000 + rank)
        for step in range(1, config.steps + 1):
            start = time.perf_counter()
            idx = _sample(chain, config, gen).to(device)
            loss = torch.nn.functional.cross_entropy(
                model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()
            )
            torch.autograd.backward(scaler.scale(loss))
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                tokens = config.batch * config.seq_len * world
                elapsed = time.perf_counter() - start
                print(
                    f"step {step:4d}  loss {mean.item() / world:.4f}  "
                    f"{tokens / elapsed:,.0f} tokens/s",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


def _build_model(config: TrainConfig) -> GPT:
    """The GPT with GPT-2's initialization (small weights, zero biases); same on every rank."""
    torch.manual_seed(config.seed)
    model = GPT(config.vocab, config.dim, config.heads, config.layers, config.seq_len)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    return model


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _markov_chain(config: TrainConfig) -> torch.Tensor:
    """Transition probabilities (vocab, vocab): each token has a few likely successors."""
    gen = torch.Generator().manual_seed(config.seed)
    logits = torch.randn(config.vocab, config.vocab, generator=gen) * 3.0
    return logits.softmax(dim=-1)


def _sample(chain: torch.Tensor, config: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(config.batch, config.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, config.vocab, (config.batch,), generator=gen)
    for t in range(1, config.seq_len + 1):
        tokens[:, t] = torch.multinomial(chain[tokens[:, t - 1]], 1, generator=gen).squeeze(1)
    return tokens  # (B, T + 1)
