"""``flatshard train --fit-memory 20GiB``: train with the fastest setup the planner finds
that fits the budget (``flatshard plan --memory-budget`` does the same, and shows all).

The candidates (each strategy, with and without activation checkpointing, with sublayer
units where they can make a faster one fit; then the best with as many of its last units
kept gathered as still fit) are planned on the meta
device before any rank starts. Their step times come from a fixed cluster
preset (``h100-80gb`` for GPUs, ``cpu-dev`` for CPUs), not from a measurement, so every
rank of a torchrun job that plans on its own reaches the same choice.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flatshard.cli.config import ConfigError
from flatshard.cli.lm.config import GATHER_DTYPES, PRECISIONS, TrainConfig, unit_policy
from flatshard.cli.lm.data import VOCAB
from flatshard.cli.lm.optimizers import tables_placement
from flatshard.cli.lm.planned import language_model_loss, planned_model
from flatshard.cli.sizes import size
from flatshard.planner import PRESETS, Problem, Setup, best_fit, recommend


def fit_memory(
    config: TrainConfig, budget: int, world: int, device: str, quiet: bool = False
) -> TrainConfig:
    """``config`` with the chosen --strategy, --units, --keep-gathered,
    --checkpoint-activations and --cpu-offload."""
    if config.lora:
        raise ConfigError("--fit-memory does not plan LoRA adapters yet; choose the setup by hand")
    model = planned_model(config.model, config, VOCAB, fit_to_bytes=True)
    cluster = PRESETS["cpu-dev" if device == "cpu" else "h100-80gb"]
    cluster = cluster.sized(1, world)
    setup = Setup(
        world_size=world,
        auto_wrap_policy=unit_policy(model.unit_classes, config.units),
        param_dtype=PRECISIONS[config.mixed_precision],
        gather_dtype=GATHER_DTYPES[config.gather_dtype],
        grad_accum=config.grad_accum,
        optimizer="muon" if config.optimizer == "muon" else "adamw",
        clip=config.clip > 0,
        backend=cluster.backend,
        foreach=cluster.device != "cpu",
        placement=tables_placement(config.row_sparse_tables),
    )

    def inputs() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, VOCAB, (config.batch, config.seq_len)),)

    found = recommend(Problem(model.build, inputs, language_model_loss, cluster), setup, budget)
    best = best_fit(found, budget)
    if best is None:
        least = min(found, key=lambda c: c.plan.device_memory_needed)
        raise ConfigError(
            f"--fit-memory {config.fit_memory}: nothing fits; the leanest setup "
            f"({least.label}) needs {size(least.plan.device_memory_needed)} per rank. Add "
            "ranks, lower --batch or --seq-len, or use --mixed-precision bf16"
        )
    if not quiet:
        print(
            f"--fit-memory {config.fit_memory}: {best.label} "
            f"(predicted {size(best.plan.device_memory_needed)} per rank)",
            flush=True,
        )
    return replace(
        config,
        strategy=best.strategy.name,
        units="sublayers" if best.sublayers else "blocks",
        checkpoint_activations=best.checkpoint_activations,
        keep_gathered=best.kept_gathered,
        cpu_offload=best.plan.setup.cpu_offload,
        sharding_factor=best.sharding_factor or 0,
    )
