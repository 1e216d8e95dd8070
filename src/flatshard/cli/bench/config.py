"""The options of ``flatshard bench``: which systems, which GPT, how many rounds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard.cli.bench.zero3 import missing
from flatshard.cli.config import ConfigError
from flatshard.cli.lm.optimizers import OPTIMIZERS, needs_whole_params

SYSTEMS = ("flatshard", "fsdp2", "ddp", "floor")
# Also available, not run by default: flatshard without any prefetch (what prefetch buys).
# flatshard-dense: flatshard with its embedding tables gathered whole, whatever
# --row-sparse-tables says (what row-sparse tables buy, side by side).
# flatshard-twin: flatshard with its reductions on a process group of their own
# (set_separate_reduce_scatter_group).
# flatshard-gather-int8 / -fp8 / -bf16: flatshard gathering its parameters in that dtype
# (MixedPrecision(gather_dtype=...)), computing in fp32 like the others.
# flatshard-noep: flatshard with the experts data parallel, whatever --ep says (what
# expert parallelism buys, side by side).
# deepspeed: DeepSpeed ZeRO-3 with its defaults (an optional extra, cli/bench/zero3.py).
GATHER_SYSTEMS = {
    "flatshard-gather-int8": torch.int8,
    "flatshard-gather-fp8": torch.float8_e4m3fn,
    "flatshard-gather-bf16": torch.bfloat16,
}
EXTRA_SYSTEMS = (
    "comm",  # the least collectives alone, run beside "floor" on CPUs: the bound
    "flatshard-noprefetch",
    "flatshard-debug",
    "flatshard-dense",
    "flatshard-twin",
    "flatshard-noep",
    *GATHER_SYSTEMS,
    "deepspeed",
)


ACCUMULATIONS = ("no_sync", "reduce", "keep")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
PP_SYSTEMS = ("flatshard", "fsdp2")  # the systems --pp runs in stages

# bool values are flags too (``tied``, ``row_sparse_tables``)
PRESETS: dict[str, dict[str, int]] = {
    "byte-gpt": {"vocab": 256, "dim": 512, "layers": 8, "heads": 8, "seq_len": 128, "batch": 4},
    "llm-32k": {
        **{"vocab": 32768, "dim": 384, "layers": 6, "heads": 6, "seq_len": 256, "batch": 4},
        "row_sparse_tables": True,
    },
    "llm-128k": {
        **{"vocab": 131072, "dim": 256, "layers": 4, "heads": 4, "seq_len": 128, "batch": 1},
        **{"tied": False, "row_sparse_tables": True},
    },
    "overhead": {"vocab": 16, "dim": 16, "layers": 16, "heads": 2, "seq_len": 4, "batch": 1},
    "moe": {
        **{"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq_len": 128, "batch": 4},
        **{"experts": 8, "ep": 2},
    },
}


@dataclass(frozen=True)
class BenchConfig:
    """Options of ``flatshard bench``."""

    nproc: int = 2
    """ranks (local processes)"""
    device: str = "auto"
    """auto | cpu | cuda (auto: cuda with NCCL, one GPU per rank, when GPUs are visible)"""
    share_gpus: bool = False
    """for testing only: more local ranks than GPUs, sharing them over NCCL (each rank
    poses as a host of its own, sockets over loopback): slow, for correctness checks"""
    systems: str = ""
    """comma-separated subset of flatshard,fsdp2,ddp,floor,flatshard-noprefetch,
    flatshard-debug (every collective checked across ranks first: Checks(debug=True)),
    flatshard-dense (embedding tables gathered whole: --row-sparse-tables off for it),
    flatshard-twin (reductions on a process group of their own),
    flatshard-noep (the experts data parallel, whatever --ep says),
    flatshard-gather-int8, flatshard-gather-fp8, flatshard-gather-bf16 (parameters
    all-gathered in that dtype, one byte per weight with a scale per row for int8 and fp8,
    decoded to fp32 before each block runs: MixedPrecision(gather_dtype=...)),
    deepspeed (DeepSpeed ZeRO-3 with its default buckets and prefetch, the same torch
    AdamW and no clipping, as the others: pip install deepspeed; it reduces every
    micro-batch, so --grad-accum above 1 takes --accum reduce);
    default: flatshard,fsdp2,ddp,floor (without fsdp2 for --optimizer muon or adafactor);
    on CPUs "comm" runs beside "floor": FULL_SHARD's least collectives alone, whose CPU
    time plus the floor is the step no system can beat there ("vs bound")"""
    optimizer: str = "adamw"
    """adamw | muon | adafactor, as in flatshard train: muon and adafactor shard whole
    parameters under flatshard (fsdp2 would update slices of the matrices: not offered)"""
    vocab: int = 8192
    """vocabulary of the GPT (the default model has about 31M parameters)"""
    dim: int = 512
    """model width"""
    layers: int = 8
    """transformer blocks"""
    heads: int = 8
    """attention heads"""
    tied: bool = True
    """the LM head shares the token embedding's weight (--no-tied: a head of its own)"""
    row_sparse_tables: bool = False
    """flatshard looks its embedding tables up row-sparse (fully_shard(...,
    placement=flatshard.RowSparse())): each rank fetches its tokens' rows, their gradients go back
    as rows; the llm presets turn it on"""
    experts: int = 0
    """each block's MLP a mixture of this many experts, top-2, each half the dense MLP's
    width (0: dense MLPs)"""
    ep: int = 1
    """flatshard's expert-parallel degree (placement=flatshard.Experts(ep) for the stacked
    expert weights): groups of --ep ranks split the experts; the other systems, and
    flatshard-noep, keep them data parallel"""
    seq_len: int = 256
    """tokens per sequence"""
    batch: int = 4
    """sequences per rank per step"""
    warmup: int = 1
    """untimed steps per system and round"""
    steps: int = 4
    """timed steps per system and round"""
    rounds: int = 2
    """rounds: fresh processes for every system, which then take their steps in turn"""
    compile: bool = False
    """torch.compile every system's transformer blocks alike (warm up with --warmup 2+)"""
    grad_accum: int = 1
    """micro-batches per step (--batch split into them), accumulated as --accum says"""
    accum: str = "no_sync"
    """no_sync | reduce | keep: how micro-batches but the last run, every system alike:
    no_sync skips the reduction (flatshard.no_sync; FSDP2 set_requires_gradient_sync(False);
    DDP no_sync()), reduce reduces every micro-batch, keep is no_sync with the units kept
    gathered between micro-batches (set_reshard_after_backward(False); FSDP2 too)"""
    scaling: bool = False
    """run every world size from 1 to --nproc, each a bench of its own, and print per-rank
    memory and collective bytes (flatshard's against its formula) and step time by world
    size (more ranks than cores oversubscribe the machine: step times then say little)"""
    preset: str = ""
    """byte-gpt | llm-32k | llm-128k | overhead | moe: a model and batch shape (flags given
    with it win); moe is a GPT of 4 blocks whose MLPs are 8 experts (top-2; dim 256,
    vocabulary 4096, 4 x 128 tokens per rank) with --ep 2; byte-gpt is the 25M GPT of
    vocabulary 256 (dim 512, 8 blocks, 4 x 128 tokens
    per rank); llm-32k a 32,768-token vocabulary tied to the head (dim 384, 6 blocks, 4 x
    256 tokens per rank), llm-128k an untied 131,072 x 256 table and head (4 blocks, 1 x
    128 tokens per rank: the head's matmul would otherwise hide all communication on a
    CPU), both with --row-sparse-tables;
    overhead a model with negligible compute (16 blocks of width 16, 4 tokens): the
    "ms/unit" column (time over the floor per unit) is then host overhead, best measured
    with --nproc 1 --systems flatshard,fsdp2,floor (and --compile)"""
    pp: int = 1
    """pipeline stages: each system's GPT cut into --pp stages as train --pp cuts it (head
    untied), each stage sharded over nproc / pp ranks, run by --pp-schedule over
    --grad-accum micro-batches of the --batch sequences; systems flatshard and fsdp2; a
    line after the table gives the bubble measured (each rank's share of the step outside
    its stages' passes, mean over ranks) and the bytes per step by kind"""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved | zero-bubble (interleaved: 2 x --pp stages, two a rank;
    zero-bubble runs flatshard alone: FSDP2's is not exact)"""
    out: str = "runs/bench"
    """directory for bench.json and bench.png"""

    def __post_init__(self) -> None:
        for name in ("nproc", "vocab", "dim", "layers", "heads", "seq_len", "batch", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmup < 0 or self.rounds < 1:
            raise ConfigError("--warmup must be >= 0 and --rounds >= 1")
        if self.dim % self.heads:
            raise ConfigError(f"--dim ({self.dim}) must be a multiple of --heads ({self.heads})")
        unknown = set(self.system_list) - set(SYSTEMS + EXTRA_SYSTEMS)
        if unknown or not self.system_list:
            raise ConfigError(
                "--systems must be a comma-separated subset of "
                f"{','.join(SYSTEMS + EXTRA_SYSTEMS)}, "
                f"got {self.systems!r}"
            )

        if self.accum not in ACCUMULATIONS:
            raise ConfigError(
                f"--accum must be one of {', '.join(ACCUMULATIONS)}, got {self.accum!r}"
            )
        if self.grad_accum < 1 or self.batch % self.grad_accum:
            raise ConfigError(
                f"--grad-accum ({self.grad_accum}) must be >= 1 and divide --batch ({self.batch})"
            )
        self._check_deepspeed()
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if needs_whole_params(self.optimizer) and "fsdp2" in self.system_list:
            raise ConfigError(
                f"--optimizer {self.optimizer}: fsdp2 would update each rank's slice of a "
                "matrix, not the unsharded update; leave it out of --systems"
            )
        if self.experts < 0 or self.ep < 1:
            raise ConfigError("--experts must be >= 0 and --ep >= 1")
        if self.ep > 1 and (not self.experts or self.experts % self.ep or self.nproc % self.ep):
            raise ConfigError(
                f"--ep {self.ep} needs --experts (got {self.experts}) and --nproc (got "
                f"{self.nproc}) that it divides"
            )
        if self.preset and self.preset not in PRESETS:
            raise ConfigError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        self._check_pipeline()

    def _check_deepspeed(self) -> None:
        """--systems deepspeed: installed, and run where it compares like with like."""
        if "deepspeed" not in self.system_list:
            return
        if why := missing():
            raise ConfigError(why)
        for name, value in {
            f"--optimizer {self.optimizer} (it runs a torch AdamW)": self.optimizer != "adamw",
            "--compile": self.compile,
            f"--accum {self.accum} with --grad-accum {self.grad_accum} (ZeRO-3 reduces every "
            "micro-batch's gradients: use --accum reduce)": self.grad_accum > 1
            and self.accum != "reduce",
            "--pp": self.pp > 1,
        }.items():
            if value:
                raise ConfigError(f"--systems deepspeed does not run with {name}")

    def _check_pipeline(self) -> None:
        """--pp: what a pipelined bench takes (the rest refused by name)."""
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(
                f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}"
            )
        if self.pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {self.pp}")
        if self.pp == 1:
            return
        if self.nproc % self.pp or self.layers % self.pp_stages or self.grad_accum < self.pp:
            raise ConfigError(
                f"--pp {self.pp} needs --nproc ({self.nproc}) it divides, --layers "
                f"({self.layers}) that {self.pp_stages} stages divide, and at least {self.pp} "
                f"micro-batches (--grad-accum, got {self.grad_accum})"
            )
        allowed = ("flatshard",) if self.pp_schedule == "zero-bubble" else PP_SYSTEMS
        if set(self.system_list) - set(allowed):
            raise ConfigError(
                f"--pp --pp-schedule {self.pp_schedule} runs --systems {','.join(allowed)}"
                + (
                    " (FSDP2's zero-bubble is not exact)"
                    if self.pp_schedule == "zero-bubble"
                    else ""
                )
                + f", got {self.systems!r}"
            )
        for name, value in {
            "--experts": self.experts,
            "--row-sparse-tables": self.row_sparse_tables,
            "--compile": self.compile,
            "--scaling": self.scaling,
            "--accum reduce|keep": self.accum != "no_sync",
            f"--optimizer {self.optimizer}": self.optimizer != "adamw",
        }.items():
            if value:
                raise ConfigError(f"{name} does not combine with --pp yet")

    @property
    def pp_stages(self) -> int:
        """--pp: the stages (two a rank under the interleaved schedule)."""
        return 2 * self.pp if self.pp_schedule == "interleaved" else self.pp

    @property
    def system_list(self) -> list[str]:
        if not self.systems and self.pp > 1:
            return ["flatshard"] if self.pp_schedule == "zero-bubble" else list(PP_SYSTEMS)
        if not self.systems:
            exact = not needs_whole_params(self.optimizer)
            found = [s for s in SYSTEMS if s != "fsdp2" or exact]
        else:
            found = [s for s in self.systems.split(",") if s]
        if "floor" in found and "comm" not in found and self.device == "cpu" and self.pp == 1:
            found.append("comm")  # the bound beside the floor ([Note: the achievable bound])
        return found
