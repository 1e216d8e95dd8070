"""The options of ``flatshard train``: one typed dataclass, one docstring per field.

Flags (``--seq-len 256``), a TOML file (``--config run.toml`` with ``seq_len = 256``), or
both (flags win). Everything that can be checked before processes start is checked here,
with a one-line error naming the option.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

import flatshard
from flatshard.cli.config import fail, strategy_option
from flatshard.cli.internals import AutoWrapPolicy
from flatshard.cli.lm.lora import parse_lora
from flatshard.cli.lm.optimizers import OPTIMIZERS
from flatshard.cli.sizes import parse_size

PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The dtype parameters travel in when all-gathered (MixedPrecision(gather_dtype=...))
GATHER_DTYPES = {
    "none": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8-e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
SCHEDULES = ("cosine", "linear", "constant")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
UNITS = ("blocks", "sublayers")
LOG_SINKS = ("tensorboard",)  # where --log-to writes besides metrics.jsonl


def unit_policy(blocks: set[type[nn.Module]], units: str) -> AutoWrapPolicy:
    """--units: the blocks, or the blocks split into their sublayers."""
    return flatshard.SublayerPolicy(frozenset(blocks)) if units == "sublayers" else blocks


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``flatshard train``."""

    model: str = "gpt"
    """'gpt' (flatshard's own GPT) or 'hf:<config dir, config.json or model type>' for a
    Hugging Face causal LM built from its config with random weights (needs transformers)"""
    hf_overrides: str = ""
    """comma-separated key=value settings for the Hugging Face config, e.g. 'n_layer=2,n_embd=64'"""
    init: str = "random"
    """random | pretrained: start from the weights in --model hf:<dir> (safetensors, loaded
    sharded: each rank reads only its rows); the model's vocabulary is kept"""
    freeze: str = ""
    """comma-separated patterns of parameter names not to train, e.g. 'model.embed_tokens.*'"""
    lora: str = ""
    """LoRA adapters (peft; --model hf: only), e.g. 'r=8,alpha=16,targets=q_proj,v_proj'
    (optional dropout=0.05): only the adapters train; merged into the exported weights"""
    data: str = ""
    """a UTF-8 text file to train on; empty: the shipped public-domain corpus"""
    nproc: int = 2
    """local ranks to start (ignored under torchrun, which starts them)"""
    max_restarts: int = 0
    """restart all ranks this many times when one fails, each time from the newest whole
    checkpoint (torch's elastic agent; implies --resume auto; ignored under torchrun)"""
    device: str = "auto"
    """auto | cpu | cuda: where ranks compute (auto: one GPU per rank with NCCL when GPUs
    are visible, else CPUs with gloo)"""
    share_gpus: bool = False
    """for testing only: more local ranks than GPUs, sharing them over NCCL (each rank
    poses as a host of its own, sockets over loopback): slow, for correctness checks"""
    steps: int = 300
    """optimizer steps"""
    batch: int = 16
    """sequences per rank per micro-batch"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    accum_no_sync: bool = True
    """accumulate micro-batches without communication (flatshard.no_sync); off: reduce each"""
    seq_len: int = 128
    """bytes per training sequence (the model's context)"""
    dim: int = 128
    """GPT width"""
    layers: int = 4
    """GPT transformer blocks (one unit each)"""
    heads: int = 4
    """GPT attention heads"""
    optimizer: str = "adamw"
    """adamw | muon | adafactor: muon orthogonalizes the blocks' weight matrices
    (torch.optim.Muon, AdamW for the embeddings, head, norms and biases); adafactor factors
    the second moment (torch.optim.Adafactor). Both shard whole parameters
    (fully_shard(placement=flatshard.Whole())): each parameter whole on one rank, which steps it"""
    lr: float = 3e-3
    """peak learning rate (Muon's scaled to match AdamW's update size)"""
    min_lr: float = 3e-4
    """learning rate at the end of the cosine or linear decay"""
    lr_schedule: str = "cosine"
    """cosine | linear | constant, after the warm-up"""
    warmup_steps: int = 20
    """steps of linear warm-up from 0 to --lr"""
    weight_decay: float = 0.1
    """weight decay, for parameters with 2+ dimensions (adafactor: for all)"""
    clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    strategy: str = "FULL_SHARD"
    """how units are sharded: {strategies}; any case"""
    sharding_factor: int = 0
    """ranks a unit is sharded over for the hybrid strategies (0: ranks per host)"""
    units: str = "blocks"
    """blocks | sublayers: the units: each transformer block, or also each block's
    attention and MLP and the untied input embedding and output head (less gathered at
    once, more collectives; flatshard.SublayerPolicy)"""
    keep_gathered: int = 0
    """the last N units keep their parameters gathered from forward to backward
    (FULL_SHARD, HYBRID_SHARD): no all-gather when backward reaches them, more memory"""
    mixed_precision: str = "none"
    """none | bf16 | fp16 (fp16 adds a ShardedGradScaler)"""
    gather_dtype: str = "none"
    """the dtype parameters travel in when all-gathered, decoded into the compute dtype
    before each unit runs: int8 | fp8 (float8_e4m3fn) | fp8-e5m2, one byte per weight
    and a float32 scale per row of each matrix (vectors stay in the compute dtype); bf16 |
    fp16, a cast; none: the compute dtype. With int8 and fp8 the embedding tables (and a
    head tied to one) stay in the compute dtype. Master weights, optimizer, checkpoints and
    the gradient reduction are unchanged (MixedPrecision(gather_dtype=...))"""
    checkpoint_activations: bool = False
    """recompute each block's activations in backward (less memory, more compute)"""
    cpu_offload: bool = False
    """keep the sharded parameters, their gradients and the optimizer state in CPU memory
    (the optimizer steps on the CPU): less device memory, slower steps"""
    experts: int = 0
    """--model gpt: each block's MLP a mixture of this many experts (top-2, each half the
    dense MLP's width); 0: dense MLPs"""
    ep: int = 1
    """expert parallelism: groups of --ep ranks split the experts, each rank holding
    experts / ep of them (fully_shard(placement=flatshard.Experts(ep)) for the stacked
    expert weights) and the tokens moving to them by all-to-all; 1: data parallel"""
    pp: int = 1
    """pipeline stages (--model gpt): the blocks cut into --pp stages, the embeddings on
    the first, the final norm and the head (untied from the embedding: torch's pipelining
    cannot share a parameter between stages) on the last, each stage sharded over the
    ranks / pp ranks that hold it and run by --pp-schedule over --microbatches
    micro-batches (flatshard.integrations.pipelining.PipelineStage)"""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved | zero-bubble: torch.distributed.pipelining's schedule for
    --pp (interleaved: 2 x --pp stages, two on each rank; zero-bubble: backward split into
    input and weight passes)"""
    microbatches: int = 0
    """--pp: micro-batches per optimizer step, each --batch sequences of every data-parallel
    replica (0: --grad-accum's count; at least --pp)"""
    ft_replicas: int = 0
    """fault-tolerant replica groups (torchft; pip install 'flatshard[ft]'): this run is
    replica group --ft-replica-id of this many, each its own run (its own ranks, sharded
    inside); every step averages the gradients over the groups alive, a group that dies
    leaves the others training, and one that comes back copies a live group's state
    (0: off)"""
    ft_replica_id: int = 0
    """--ft-replicas: which replica group this run is (0 to --ft-replicas - 1); it reads
    its own part of each step's batch"""
    ft_lighthouse: str = ""
    """--ft-replicas: torchft's Lighthouse (e.g. http://host:29510; start one with
    torchft_lighthouse --min_replicas 1); empty: the TORCHFT_LIGHTHOUSE variable"""
    ft_min_replicas: int = 1
    """--ft-replicas: the fewest replica groups a step commits with"""
    ft_quorum_timeout: float = 60.0
    """--ft-replicas: seconds a step waits for a quorum (of the Lighthouse's
    --min_replicas groups, and of --ft-min-replicas) before the run stops with an error
    naming the groups the Lighthouse has heard from; also how long a peer group that
    stops answering (frozen, not dead) holds a step, and a heal's transfer may take"""
    row_sparse_tables: bool = False
    """row-sparse embedding tables (fully_shard(..., placement=flatshard.RowSparse())): each lookup
    fetches only its tokens' rows and sends back only their gradients, where that moves
    fewer bytes than the whole table"""
    fit_memory: str = ""
    """e.g. '20GiB': plan every strategy with and without activation checkpointing first
    (flatshard plan) and train with the fastest whose predicted memory per rank fits,
    keeping as many of its last blocks gathered as still fit, or with --cpu-offload where
    nothing else fits (sets --strategy, --units, --keep-gathered, --checkpoint-activations
    and --cpu-offload)"""
    predict: bool = False
    """plan the run first (flatshard plan with these options; on CPUs this machine
    measured) and print the predicted peak of live tensors on rank 0 and the step time
    next to the measured ones at the end (GPUs: the memory only)"""
    compile: bool = False
    """torch.compile each transformer block (one graph per block: flatshard's hooks run
    outside it)"""
    seed: int = 0
    """model, data and sampling seed"""
    out_dir: str = "runs/train"
    """where metrics.jsonl and loss.png go"""
    log_every: int = 10
    """print a progress line every this many steps when not on a terminal"""
    log_to: str = ""
    """'tensorboard': also write metrics.jsonl's fields as TensorBoard scalars, one event per
    step, to <out-dir>/tensorboard (needs the tensorboard package: pip install tensorboard);
    view with: tensorboard --logdir <out-dir>/tensorboard"""
    ckpt_dir: str = ""
    """checkpoint directory (empty: <out-dir>/checkpoints)"""
    ckpt_every: int = 0
    """save a checkpoint every this many steps and at the end (0: never)"""
    keep_ckpts: int = 2
    """checkpoints to keep (older ones are deleted)"""
    ckpt_async: bool = False
    """save checkpoints in the background: each save copies the state to host memory and
    training goes on while a thread writes it (a checkpoint counts once whole; a crash
    meanwhile resumes from the one before)"""
    ckpt_on_preempt: bool = False
    """on SIGTERM (what SLURM, Kubernetes and torchrun send to stop or preempt a job): finish
    the step, save a checkpoint (a save being written is finished first) and exit with
    status 143, which schedulers read as stopped by SIGTERM (requeue it with --resume auto)"""
    resume: str = ""
    """continue from a checkpoint directory; 'latest' (the newest in --ckpt-dir); or 'auto'
    (the newest whole one, else start afresh: for jobs restarted after a crash). Options
    that differ from the saved run's are listed with what they change"""
    exact_resume: bool = False
    """with --resume: refuse to continue where an option differs from the saved run's in a
    way that changes the losses (seed, data, batch, schedule, model, precision, ...)"""
    sample_bytes: int = 300
    """bytes of text to generate at the end (0: none)"""

    def __post_init__(self) -> None:
        positive = ("nproc", "steps", "batch", "grad_accum", "seq_len", "dim", "layers", "heads")
        for name in positive:
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "ckpt_every",
            "sample_bytes",
            "sharding_factor",
            "keep_gathered",
            "max_restarts",
        ):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}")
        if self.log_every < 1 or self.keep_ckpts < 1:
            fail("log_every" if self.log_every < 1 else "keep_ckpts", "must be >= 1")
        if self.dim % self.heads:
            fail("dim", f"({self.dim}) must be a multiple of --heads ({self.heads})")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            fail("lr", f"must be > 0 and >= --min-lr >= 0, got {self.lr} and {self.min_lr}")
        if self.weight_decay < 0 or self.clip < 0:
            fail("weight_decay" if self.weight_decay < 0 else "clip", "must be >= 0")
        _one_of(self, "lr_schedule", SCHEDULES)
        _one_of(self, "mixed_precision", tuple(PRECISIONS))
        _one_of(self, "gather_dtype", tuple(GATHER_DTYPES))
        object.__setattr__(self, "strategy", strategy_option(self.strategy).name)  # as named
        if self.keep_gathered and self.sharding_strategy.kept_gathered is None:
            fail("keep_gathered", f"applies to FULL_SHARD and HYBRID_SHARD, not {self.strategy}")
        _one_of(self, "units", UNITS)
        if self.log_to:
            _one_of(self, "log_to", LOG_SINKS)
            if importlib.util.find_spec("tensorboard") is None:
                fail(
                    "log_to",
                    "tensorboard needs the tensorboard package: pip install tensorboard (in "
                    "the environment of make train: make extras EXTRAS=tensorboard)",
                )
        _one_of(self, "optimizer", OPTIMIZERS)
        if self.optimizer == "adafactor" and (self.predict or self.fit_memory):
            name = "predict" if self.predict else "fit_memory"
            fail(name, "cannot plan --optimizer adafactor (its step reads values a plan lacks)")
        units = self.layers * (3 if self.units == "sublayers" else 1)  # GPT: + attn, MLP
        if self.keep_gathered > units and self.model == "gpt":
            fail(
                "keep_gathered",
                f"({self.keep_gathered}) exceeds the {units} units of the GPT "
                f"(--layers {self.layers}, --units {self.units})",
            )
        if self.model != "gpt" and not self.model.startswith("hf:"):
            fail("model", f"must be 'gpt' or 'hf:<config>', got {self.model!r}")
        if self.max_restarts and self.resume not in ("", "auto"):
            fail("max_restarts", f"resumes with --resume auto, not {self.resume!r}")
        _one_of(self, "init", ("random", "pretrained"))
        if self.init == "pretrained" and not self.model.startswith("hf:"):
            fail("init", "pretrained needs --model hf:<directory with config and weights>")
        for name in ("hf_overrides", "lora"):
            if getattr(self, name) and not self.model.startswith("hf:"):
                fail(name, "only applies to --model hf:...")
        if self.lora:
            parse_lora(self.lora)
        if self.fit_memory:
            parse_size(self.fit_memory, "--fit-memory", 0)
        if self.experts < 0 or self.ep < 1:
            fail("experts" if self.experts < 0 else "ep", "must be >= 0 (experts), >= 1 (ep)")
        if self.experts and self.model != "gpt":
            fail("experts", "only applies to --model gpt")
        if self.ep > 1 and (not self.experts or self.experts % self.ep):
            fail("ep", f"({self.ep}) must divide --experts ({self.experts})")
        if self.experts and (self.predict or self.fit_memory):
            name = "predict" if self.predict else "fit_memory"
            fail(name, "cannot plan --experts (a simulated router has no choices to route by)")
        self._check_pipeline()
        self._check_fault_tolerance()

    def _check_fault_tolerance(self) -> None:
        """--ft-replicas: what a replica group of a fault-tolerant run takes."""
        if self.ft_replicas == 0:
            given = ("ft_replica_id", "ft_lighthouse", "ft_min_replicas", "ft_quorum_timeout")
            for name in given:
                if getattr(self, name) != _DEFAULTS[name]:
                    fail(name, "applies with --ft-replicas")
            return
        if self.ft_replicas < 2:
            fail("ft_replicas", f"must be >= 2 replica groups (or 0: off), got {self.ft_replicas}")
        if importlib.util.find_spec("torchft") is None:
            fail("ft_replicas", "needs torchft: pip install 'flatshard[ft]'")
        if not 0 <= self.ft_replica_id < self.ft_replicas:
            fail(
                "ft_replica_id",
                f"must be 0 to {self.ft_replicas - 1} (--ft-replicas {self.ft_replicas}), "
                f"got {self.ft_replica_id}",
            )
        if not 1 <= self.ft_min_replicas <= self.ft_replicas:
            fail("ft_min_replicas", f"must be 1 to {self.ft_replicas}, got {self.ft_min_replicas}")
        if self.ft_quorum_timeout <= 0:
            fail("ft_quorum_timeout", f"must be > 0 seconds, got {self.ft_quorum_timeout}")
        refused = {
            "pp": self.pp > 1,
            "optimizer": self.optimizer == "muon",  # two optimizers: one commit decision
            "mixed_precision": self.mixed_precision == "fp16",  # the scaler's skipped steps
            "predict": self.predict,
            "fit_memory": bool(self.fit_memory),
        }
        for name, value in refused.items():
            if value:
                fail(name, "does not combine with --ft-replicas yet")

    def _check_pipeline(self) -> None:
        """--pp: what a pipelined GPT run takes (the rest is refused by name)."""
        _one_of(self, "pp_schedule", PP_SCHEDULES)
        if self.pp < 1:
            fail("pp", f"must be >= 1, got {self.pp}")
        if self.microbatches < 0:
            fail("microbatches", f"must be >= 0, got {self.microbatches}")
        if self.pp == 1:
            if self.microbatches:
                fail("microbatches", "applies to --pp > 1; without a pipeline: --grad-accum")
            return
        if self.model != "gpt":
            fail("pp", "only applies to --model gpt (stages cut by its blocks)")
        if self.layers % self.pp_stages:
            each = " (two a rank)" if self.pp_stages > self.pp else ""
            fail(
                "pp",
                f"({self.pp}) must divide --layers ({self.layers}) into {self.pp_stages} "
                f"stages{each} of whole blocks",
            )
        if self.microbatches and self.grad_accum not in (1, self.microbatches):
            fail(
                "microbatches",
                f"({self.microbatches}) and --grad-accum ({self.grad_accum}) both count the "
                "micro-batches of a pipelined step: give one of them",
            )
        if self.micro_batches < self.pp:
            name = "microbatches" if self.microbatches else "grad_accum"
            fail(
                name,
                f"({self.micro_batches}) micro-batches for --pp {self.pp}: give at least {self.pp}",
            )
        if self.pp_stages > self.pp:
            for name in ("ckpt_every", "ckpt_on_preempt", "resume"):
                if getattr(self, name):
                    fail(
                        name,
                        f"does not combine with --pp-schedule {self.pp_schedule} yet: a rank "
                        "holding two stages cannot write its part of one checkpoint (use "
                        "gpipe or 1f1b)",
                    )
        refused = {
            "experts": self.experts,
            "predict": self.predict,
            "fit_memory": self.fit_memory,
            "compile": self.compile,
            "sharding_factor": self.sharding_factor,
            "keep_gathered": self.keep_gathered,
        }
        for name, value in refused.items():
            if value:
                fail(name, "does not combine with --pp yet")
        if self.mixed_precision == "fp16":
            fail(
                "mixed_precision",
                "fp16 (a gradient scaler) does not combine with --pp yet: use bf16",
            )

    @property
    def micro_batches(self) -> int:
        """--pp: the schedule's micro-batches per optimizer step."""
        return self.microbatches or self.grad_accum

    @property
    def pp_stages(self) -> int:
        """--pp: the stages the GPT is cut into (two a rank under the interleaved schedule)."""
        return 2 * self.pp if self.pp_schedule == "interleaved" else self.pp

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.ckpt_dir) if self.ckpt_dir else Path(self.out_dir) / "checkpoints"

    @property
    def sharding_strategy(self) -> flatshard.ShardingStrategy:
        return strategy_option(self.strategy)

    def check_world(self, world: int) -> None:
        """What depends on the number of ranks (known only once they exist under torchrun)."""
        factor = self.sharding_factor
        if factor and not self.sharding_strategy.is_hybrid:
            fail("sharding_factor", f"only applies to hybrid strategies, not {self.strategy}")
        if factor and (factor > world or world % factor):
            fail("sharding_factor", f"({factor}) must divide the number of ranks ({world})")
        if world % self.ep:
            fail("ep", f"({self.ep}) must divide the number of ranks ({world})")
        if world % self.pp:
            fail("pp", f"({self.pp}) must divide the number of ranks ({world})")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (1-based)."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        progress = min(progress, 1.0)
        if self.lr_schedule == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        cosine = 0.5 * (1 + math.cos(progress * math.pi))
        return self.min_lr + (self.lr - self.min_lr) * cosine


def _one_of(config: object, name: str, allowed: tuple[str, ...]) -> None:
    """The option ``name`` as one of ``allowed``, matched in any case (set to its spelling
    there); an error naming the closest choice otherwise."""
    value = getattr(config, name)
    for choice in allowed:
        if choice.lower() == value.lower():
            object.__setattr__(config, name, choice)  # a frozen dataclass, still building
            return
    close = difflib.get_close_matches(value.lower(), [a.lower() for a in allowed], n=1)
    hint = (
        f" (did you mean {allowed[[a.lower() for a in allowed].index(close[0])]}?)" if close else ""
    )
    fail(name, f"must be one of {', '.join(allowed)}, got {value!r}{hint}")


# What every option is when not given (an option that applies only with another is
# refused when it differs from it).
_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
