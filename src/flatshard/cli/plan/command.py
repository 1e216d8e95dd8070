"""flatshard plan: predict per-rank memory and step time of a training run before launch.

The model is built on the meta device and flatshard itself runs two training steps on it
in a simulated world of --hosts x --nproc ranks (nothing is allocated or sent), so the
memory figure is the run's own: the steady-state peak of live tensors on a rank, broken
down by what they hold. Step time comes from each op's FLOPs and bytes on the --cluster's
devices and each collective on its links, with the overlap that prefetch gives.

Example: will Llama-3-8B train on one host of 8 x 80 GB, and with which options?

  flatshard plan --model hf:llama --hf-overrides hidden_size=4096,intermediate_size=14336,\\
    num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256 \\
    --seq-len 8192 --batch 1 --mixed-precision bf16 --cluster h100-80gb --nproc 8 \\
    --memory-budget device
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

import flatshard
from flatshard.cli.config import (
    ConfigError,
    add_config_parser,
    config_from_args,
    fail,
    flag,
    strategy_option,
)
from flatshard.cli.lm.config import (
    GATHER_DTYPES,
    PP_SCHEDULES,
    PRECISIONS,
    UNITS,
    TrainConfig,
    unit_policy,
)
from flatshard.cli.lm.optimizers import tables_placement
from flatshard.cli.lm.planned import PlannedModel, language_model_loss, planned_model, stage_loss
from flatshard.cli.plan.report import chart, table
from flatshard.cli.sizes import parse_size, size
from flatshard.models.gpt import cut_to_stage
from flatshard.planner import (
    PRESETS,
    Candidate,
    Pipeline,
    Problem,
    Setup,
    best_fit,
    plan,
    recommend,
)

CLUSTERS = (*PRESETS, "cpu")


@dataclass(frozen=True)
class PlanConfig:
    """Options of ``flatshard plan`` (the model, sharding and batch ones as in train)."""

    model: str = "gpt"
    """'gpt', 'hf:<config dir, config.json or model type>' or 'package.module:function'
    (returns the model; called under the meta device)"""
    hf_overrides: str = ""
    """comma-separated key=value settings for the Hugging Face config (vocab_size is kept)"""
    vocab: int = 256
    """vocabulary of the built-in GPT and of a module:function model's inputs"""
    dim: int = 128
    """GPT width"""
    layers: int = 4
    """GPT transformer blocks (one unit each)"""
    heads: int = 4
    """GPT attention heads"""
    seq_len: int = 128
    """tokens per sequence"""
    batch: int = 16
    """sequences per rank per micro-batch"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    nproc: int = 0
    """ranks per host (0: the cluster's: 8 GPUs, or 1 for cpu)"""
    hosts: int = 1
    """hosts"""
    strategy: str = "FULL_SHARD"
    """how units are sharded: {strategies}; any case"""
    sharding_factor: int = 0
    """ranks a unit is sharded over for the hybrid strategies (0: ranks per host)"""
    units: str = "blocks"
    """blocks | sublayers: the units: each transformer block, or also each block's
    attention and MLP and the untied input embedding and output head"""
    keep_gathered: int = 0
    """the last N units keep their parameters gathered from forward to backward
    (FULL_SHARD, HYBRID_SHARD): no all-gather when backward reaches them"""
    mixed_precision: str = "none"
    """none | bf16 | fp16: compute and all-gather dtype (gradients reduced in fp32)"""
    gather_dtype: str = "none"
    """int8 | fp8 | fp8-e5m2 (one byte per weight, a scale per row) | bf16 | fp16 (a
    cast) | none: the dtype parameters travel in when all-gathered, as train
    --gather-dtype"""
    checkpoint_activations: bool = False
    """recompute each block's activations in backward"""
    cpu_offload: bool = False
    """shards, gradients and optimizer state in host memory, the optimizer's step on the
    host CPUs: the device's peak, the host's, and the PCIe copies in the step"""
    row_sparse_tables: bool = False
    """row-sparse embedding tables (fully_shard(..., placement=flatshard.RowSparse())), priced with
    every token id of a batch distinct: the most its lookups can move"""
    optimizer: str = "adamw"
    """adamw | adam | sgd-momentum | sgd | muon (what its state costs; muon: the blocks'
    matrices Muon steps kept whole on one rank each, as train --optimizer muon)"""
    cluster: str = "a100-80gb"
    """a100-80gb (the paper's: 2 Tb/s RoCE a host) | h100-80gb | h200 | cpu (this machine,
    measured in a few seconds, gloo) | cpu-dev (fixed figures of a 2-core machine)"""
    json: bool = False
    """print one JSON object (peak_memory_bytes, memory_bytes, step_time_s, ...)"""
    memory_budget: str = ""
    """e.g. '20GiB' or 'device': also plan every strategy with and without activation
    checkpointing (across hosts, the hybrid ones at F = ranks per host x 2^k below the
    world size; with sublayer units where that can make a faster one fit), recommend the
    fastest whose device memory fits, and keep as many of its last units gathered as
    still fit (FULL_SHARD with CPU offload where nothing else fits)"""
    chart: str = ""
    """write the live-tensor memory over one step as a PNG to this path"""
    pp: int = 1
    """pipeline stages (--model gpt): plan the GPT cut into --pp stages as train --pp cuts
    it, each sharded over ranks / pp ranks: every pipeline rank's memory (activations of
    the micro-batches in flight), the schedule's bubble and its sends"""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved | zero-bubble: the schedule --pp is priced for"""
    microbatches: int = 0
    """--pp: micro-batches per optimizer step (0: --grad-accum's count)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", strategy_option(self.strategy).name)  # as named
        for name in ("vocab", "dim", "layers", "heads", "seq_len", "batch", "grad_accum"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        for name, least in (
            ("nproc", 0),
            ("hosts", 1),
            ("sharding_factor", 0),
            ("keep_gathered", 0),
        ):
            if getattr(self, name) < least:
                fail(name, f"must be >= {least}, got {getattr(self, name)}")
        for name, allowed in (
            ("mixed_precision", tuple(PRECISIONS)),
            ("gather_dtype", tuple(GATHER_DTYPES)),
            ("optimizer", ("adamw", "adam", "sgd-momentum", "sgd", "muon")),
            ("cluster", CLUSTERS),
            ("units", UNITS),
        ):
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.memory_budget:
            parse_size(self.memory_budget, "--memory-budget", 0)
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if self.pp_schedule not in PP_SCHEDULES:
            fail(
                "pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}"
            )
        if self.pp < 1 or self.microbatches < 0:
            fail(
                "pp" if self.pp < 1 else "microbatches",
                "must be >= 1 (--pp), >= 0 (--microbatches)",
            )
        if self.pp == 1:
            return
        if self.model != "gpt":
            fail("pp", "only applies to --model gpt (stages cut by its blocks)")
        stages = self.pp * (2 if self.pp_schedule == "interleaved" else 1)
        if self.layers % stages:
            fail("pp", f"({self.pp}) must divide --layers ({self.layers}) into {stages} stages")
        if self.micro_batches < self.pp:
            fail(
                "microbatches",
                f"({self.micro_batches}) for --pp {self.pp}: give at least {self.pp}",
            )
        for name in ("cpu_offload", "keep_gathered", "memory_budget"):
            if getattr(self, name):
                fail(
                    name,
                    "is not planned with --pp yet (the budget search cuts the model "
                    "into pipeline stages itself where nothing else fits)",
                )

    @property
    def micro_batches(self) -> int:
        return self.microbatches or self.grad_accum

    def pipeline(self, ranks: int, microbatches: int, schedule: str) -> Pipeline:
        """The GPT cut as ``flatshard train --pp`` cuts it."""
        return Pipeline(ranks, microbatches, cut_to_stage, stage_loss, schedule)


def add_parser(commands: Any) -> None:
    add_config_parser(
        commands,
        "plan",
        help="predict per-rank memory and step time before launch (nothing is allocated)",
        description=__doc__,
        config=PlanConfig,
        run=run,
        config_file=True,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(PlanConfig, args)
    train = TrainConfig(
        model=config.model if config.model.startswith(("gpt", "hf:")) else "gpt",
        hf_overrides=config.hf_overrides,
        dim=config.dim,
        layers=config.layers,
        heads=config.heads,
        seq_len=config.seq_len,
    )
    model = planned_model(config.model, train, config.vocab, untied=config.pp > 1)
    result = _plan(config, model, config.checkpoint_activations)
    if config.json and not config.memory_budget:
        print(json.dumps(result.to_json()))
    elif not config.memory_budget:
        print(f"model: {model.description}")
        print(table(result))
    if config.chart:
        chart(result, config.chart)
    if config.memory_budget:
        return _recommend(config, model, result)
    return 0


def _plan(config: PlanConfig, model: PlannedModel, checkpointing: bool) -> flatshard.Plan:
    strategy = strategy_option(config.strategy)
    if config.sharding_factor and not strategy.is_hybrid:
        fail("sharding_factor", f"only applies to hybrid strategies, not {config.strategy}")
    if config.keep_gathered and strategy.kept_gathered is None:
        fail("keep_gathered", f"applies to FULL_SHARD and HYBRID_SHARD, not {config.strategy}")
    try:
        return _planned(config, model, checkpointing, strategy)
    except ValueError as error:  # the planner's refusals (a layout it cannot plan), as errors
        raise ConfigError(str(error)) from None


def _planned(
    config: PlanConfig, model: PlannedModel, checkpointing: bool, strategy: Any
) -> flatshard.Plan:
    return plan(
        model.build(checkpointing),
        _inputs(config, model.vocab),
        loss=language_model_loss,
        auto_wrap_policy=unit_policy(model.unit_classes, config.units),
        cluster=config.cluster,
        hosts=config.hosts,
        ranks_per_host=config.nproc or None,
        strategy=strategy,
        sharding_factor=config.sharding_factor or None,
        mixed_precision=PRECISIONS[config.mixed_precision],
        gather_dtype=GATHER_DTYPES[config.gather_dtype],
        grad_accum=config.grad_accum,
        optimizer=config.optimizer,
        keep_gathered=config.keep_gathered,
        cpu_offload=config.cpu_offload,
        placement=tables_placement(config.row_sparse_tables),
        pipeline=(
            config.pipeline(config.pp, config.micro_batches, config.pp_schedule)
            if config.pp > 1
            else None
        ),
    )


def _inputs(config: PlanConfig, vocab: int) -> Any:
    def make() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, vocab, (config.batch, config.seq_len)),)

    return make


def _recommend(config: PlanConfig, model: PlannedModel, first: flatshard.Plan) -> int:
    budget = parse_size(config.memory_budget, "--memory-budget", first.cluster.memory_bytes)
    inputs = _inputs(config, model.vocab)
    # Candidates start from no offload (offload_where_nothing_fits adds it back).
    foreach = first.cluster.device != "cpu"
    setup: Setup = replace(first.setup, kept_gathered=0, cpu_offload=False, foreach=foreach)
    problem = Problem(
        model.build, inputs, language_model_loss, first.cluster, pipelines=_pipelines(config)
    )
    found = recommend(problem, setup, budget)
    best = best_fit(found, budget)
    if config.json:
        print(
            json.dumps(
                {
                    "budget_bytes": budget,
                    "recommended": best.label if best else None,
                    "candidates": [{"setup": c.label, **c.plan.to_json()} for c in found],
                }
            )
        )
        return 0 if best else 1
    _print_candidates(model, found, budget)
    if best is None:
        print("nothing fits: add ranks or hosts, lower --batch or --seq-len, or use bf16")
        return 1
    flags = planned_train_flags(config, best.plan.cluster.ranks_per_host, best.pipeline)
    flags += f"--strategy {best.strategy.name}"
    if best.pipeline is not None:
        pipe = best.pipeline
        flags += (
            f" --pp {pipe.ranks} --pp-schedule {pipe.schedule} --microbatches {pipe.microbatches}"
        )
    if best.sublayers:
        flags += " --units sublayers"
    if best.sharding_factor:
        flags += f" --sharding-factor {best.sharding_factor}"
    if best.kept_gathered:
        flags += f" --keep-gathered {best.kept_gathered}"
    if best.checkpoint_activations:
        flags += " --checkpoint-activations"
    if best.plan.setup.cpu_offload:
        flags += " --cpu-offload"
    if config.row_sparse_tables:
        flags += " --row-sparse-tables"
    if config.model.startswith(("gpt", "hf:")):
        print(f"recommended: {best.label} (flatshard train {flags})")
    else:  # a model of your own: fully_shard's options in your script
        print(f"recommended: {best.label}")
    print(table(best.plan, budget))
    return 0


# What ``flatshard train`` sets from the recommendation itself, or has no flag for.
_NOT_REPEATED = {
    "strategy", "sharding_factor", "units", "keep_gathered", "checkpoint_activations",
    "cpu_offload", "row_sparse_tables", "pp", "pp_schedule", "microbatches",
}  # fmt: skip


def planned_train_flags(
    config: PlanConfig, ranks_per_host: int, pipeline: Pipeline | None = None
) -> str:
    """The train flags that reproduce what was planned: every option ``flatshard train``
    shares with ``plan`` whose value differs from train's default (--nproc: the ranks per
    host planned for; a pipeline's micro-batches are its own flag)."""
    train = {f.name: f.default for f in fields(TrainConfig)}
    flags = ""
    for f in fields(PlanConfig):
        value = ranks_per_host if f.name == "nproc" else getattr(config, f.name)
        if f.name in _NOT_REPEATED or f.name not in train or value == train[f.name]:
            continue
        if pipeline is not None and f.name == "grad_accum":
            continue
        if isinstance(value, bool):
            flags += f"{flag(f.name) if value else '--no-' + flag(f.name)[2:]} "
        else:
            flags += f"{flag(f.name)} {shlex.quote(str(value))} "
    return flags


def _pipelines(config: PlanConfig) -> Any:
    """The budget search's pipelines (--model gpt): 1F1B over P x --grad-accum
    micro-batches (the same global batch), the blocks cut into P stages."""
    if config.model != "gpt" or config.pp > 1:
        return None

    def cut_into(ranks: int) -> Pipeline | None:
        if config.layers % ranks:
            return None
        return config.pipeline(ranks, config.grad_accum * ranks, "1f1b")

    return cut_into


def _print_candidates(model: PlannedModel, found: list[Candidate], budget: int) -> None:
    print(f"model: {model.description}; budget {size(budget)} per device")
    print(f"  {'setup':<78} {'step':>10} {'device memory':>14}")
    for c in found:
        verdict = "fits" if c.plan.fits_within(budget) else "over budget"
        print(
            f"  {c.label:<78} {c.plan.step.seconds * 1e3:>8.1f}ms "
            f"{size(c.plan.device_memory_needed):>14}  {verdict}"
        )
