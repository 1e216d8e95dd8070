"""``flatshard train``: train a language model on text, sharded with flatshard.

By default a small GPT learns the shipped public-domain corpus (Genesis and Exodus, King
James Version) byte by byte at 2 local CPU ranks, then writes a sample of generated text.
Without a launcher it starts --nproc local processes; under torchrun (single or multi-node)
it uses the ranks torchrun starts. NCCL on GPUs, gloo on CPUs. Options come from flags and
an optional TOML file (--config run.toml; flags win).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.cli.config import ConfigError, add_config_parser, config_from_args
from flatshard.cli.devices import (
    backend_for,
    init_rank,
    peak_memory_label,
    peak_memory_mib,
    resolve_device,
)
from flatshard.cli.internals import exit_without_teardown, kept_phrase
from flatshard.cli.lm.config import PRECISIONS, TrainConfig
from flatshard.cli.lm.data import VOCAB, Corpus, batch_for_step, decode, encode, load_corpus
from flatshard.cli.lm.model import (
    LanguageModel,
    build_language_model,
    check_hugging_face,
    export_hugging_face,
    shard_language_model,
)
from flatshard.cli.lm.optimizers import build_optimizers
from flatshard.cli.sizes import parse_size
from flatshard.cli.train.checkpoints import (
    check_checkpoint_dir,
    check_checkpoint_room,
    check_resumable,
    resume_from,
)
from flatshard.cli.train.elastic import run_elastic
from flatshard.cli.train.fault_tolerant import FaultTolerance
from flatshard.cli.train.fit_memory import fit_memory
from flatshard.cli.train.launch import (
    PREEMPT_GRACE_S,
    STOP_GRACE_S,
    run_local_ranks,
)
from flatshard.cli.train.predict import Measurement, Prediction, predict_run, prediction_line
from flatshard.cli.train.progress import (
    MetricsLog,
    ProgressBar,
    StepMetrics,
    TensorBoardLog,
    plot,
)
from flatshard.cli.train.resume import resume_changes
from flatshard.models.gpt import cut_to_stage

PROMPT = "And God said"


def add_parser(commands: Any) -> None:
    add_config_parser(
        commands,
        "train",
        help="train a GPT (or a Hugging Face model) on text, sharded with flatshard",
        description=__doc__,
        config=TrainConfig,
        run=run,
        config_file=True,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(TrainConfig, args)
    load_corpus(config.data, config.seq_len)  # a missing file fails here, once
    if config.resume:  # a checkpoint to resume from must exist, be whole and fit the model
        check_resumable(config, resume_from(config))
    check_checkpoint_dir(config)
    if config.model.startswith("hf:"):
        check_hugging_face(config)  # a bad config or missing transformers fails here too
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        config.check_world(world)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        config = replace(config, device=resolve_device(config.device, local, config.share_gpus))
        lead = os.environ["RANK"] == "0"
        config = _fitted(config, world, lead)
        _train(config, None, _predicted(config, world, local) if lead else None)
        return 0
    config.check_world(config.nproc)
    if config.max_restarts:
        resume = [] if config.resume else ["--resume", "auto"]
        return run_elastic(config.nproc, config.max_restarts, [*args.argv, *resume])
    config = replace(config, device=resolve_device(config.device, config.nproc, config.share_gpus))
    config = _fitted(config, config.nproc, lead=True)
    prediction = _predicted(config, config.nproc, config.nproc)
    with tempfile.TemporaryDirectory(prefix="flatshard-train-") as tmp:
        return _spawn(config, os.path.join(tmp, "store"), prediction)


def _predicted(config: TrainConfig, world: int, local: int) -> Prediction | None:
    """--predict: the plan of this run, before any rank starts (rank 0's, under torchrun)."""
    if not config.predict:
        return None
    prediction = predict_run(config, world, local)
    print(prediction_line(prediction), flush=True)
    return prediction


def _fitted(config: TrainConfig, world: int, lead: bool) -> TrainConfig:
    """--fit-memory: the planner's choice of strategy and checkpointing (the same on every
    rank: it plans with a fixed cluster preset)."""
    if not config.fit_memory:
        return config
    budget = parse_size(config.fit_memory, "--fit-memory", 0)
    return fit_memory(config, budget, world, config.device, quiet=not lead)


def _spawn(config: TrainConfig, store: str, prediction: Prediction | None) -> int:
    """One process per local rank (see ``launch.run_local_ranks``); with --ckpt-on-preempt
    a SIGTERM gives them time to finish the step and save."""
    grace = PREEMPT_GRACE_S if config.ckpt_on_preempt else STOP_GRACE_S
    return run_local_ranks(config.nproc, _worker, (config, store, prediction), grace)


def _worker(rank: int, config: TrainConfig, store: str, prediction: Prediction | None) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(config.nproc)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(config.nproc))
    try:
        _train(config, store, prediction)
    except ConfigError as error:  # found by every rank alike: one line, from rank 0
        if rank == 0:
            print(f"flatshard train: error: {error}", file=sys.stderr)
        sys.exit(2)
    exit_without_teardown(0)  # see [Note: exiting without teardown]


# ---------------------------------------------------------------- one rank
class _Losses(flatshard.StepObserver):
    """Sums a step's micro-batch losses (this rank's mean loss of the step)."""

    def __init__(self) -> None:
        self.total = 0.0

    def backward_done(self, loss: torch.Tensor) -> None:
        self.total += loss.item()


class Trainer:
    """Everything one rank holds while training."""

    def __init__(
        self, config: TrainConfig, device: torch.device, prediction: Prediction | None = None
    ) -> None:
        self.config = config
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.corpus: Corpus = load_corpus(config.data, config.seq_len)
        # --predict: rank 0 measures from the model's construction on (predict.py).
        self.measurement = None
        if prediction is not None and self.rank == 0:
            self.measurement = Measurement.start(device, prediction)
        self.lm: LanguageModel = build_language_model(config)
        self.params = sum(p.numel() for p in self.lm.module.parameters())
        self.replicas = self.world  # data-parallel copies of the model (--pp: fewer)
        self.model = self._sharded()
        self.optims = build_optimizers(
            self.model, self.lm.unit_classes, config.optimizer, config.lr, config.weight_decay
        )
        low = PRECISIONS[config.mixed_precision]
        self.scaler = flatshard.ShardedGradScaler(device.type, enabled=low is torch.float16)
        self.step = 0
        self.pending: flatshard.CheckpointSave | None = None  # --ckpt-async's last save
        # --ft-replicas: this run is one replica group; torchft commits the steps.
        self.ft: FaultTolerance | None = None
        if config.ft_replicas:
            (optim,) = self.optims
            self.ft = FaultTolerance(self.model, optim, config)
            self.optims = [self.ft.optim]

    def _sharded(self) -> nn.Module:
        """The model, sharded over every rank."""
        sharded = shard_language_model(self.lm, self.config, self.device)
        return _compiled(sharded, self.lm, self.config)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.lm.logits(self.model, idx[:, :-1].to(self.device))
        target = idx[:, 1:].to(self.device)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def train_step(self) -> float:
        """One optimizer step over --grad-accum micro-batches; this rank's mean loss.
        --ft-replicas: taken again until torchft commits it (or the group heals past it)."""
        if self.ft is None:
            loss = self._train_step(self.step + 1)
            self.step += 1
            return loss
        loss = self.ft.take(self._train_step)
        self.step = self.ft.step
        return loss

    def _train_step(self, step: int) -> float:
        """Optimizer step ``step`` (1-based) taken once; this rank's mean loss."""
        config = self.config
        for optim in self.optims:
            for group in optim.param_groups:
                group["lr"] = config.lr_at(step)
        rows = config.batch * self.world * config.grad_accum
        # --ft-replicas: the step's batch is every group's; this group reads its part
        groups, mine = max(1, config.ft_replicas), config.ft_replica_id
        every = batch_for_step(self.corpus.train, config.seq_len, rows * groups, config.seed, step)
        batch = every[mine * rows : (mine + 1) * rows]

        def micro_loss(micro: int) -> torch.Tensor:
            first = (micro * self.world + self.rank) * config.batch
            return self.loss(batch[first : first + config.batch])

        losses = _Losses()
        # --no-accum-no-sync under a hybrid strategy: reduce-scatter every micro-batch,
        # the all-reduce across replicas once per step (flatshard.set_requires_all_reduce).
        flatshard.train_step(
            self.model,
            self.optims,
            micro_loss,
            config.grad_accum,
            accumulation="no_sync" if config.accum_no_sync else "reduce",
            clip=config.clip if config.clip > 0 else None,
            scaler=self.scaler,
            observer=losses,
        )
        return losses.total

    @torch.no_grad()
    def val_loss(self, batches: int = 4) -> float:
        """Mean loss on held-out windows (the same on every rank)."""
        rows = self.config.batch
        losses = [
            self.loss(batch_for_step(self.corpus.val, self.config.seq_len, rows, 12345, i)).item()
            for i in range(batches)
        ]
        return sum(losses) / len(losses)

    @torch.no_grad()
    def sample(self, length: int) -> str:
        """Text generated from ``PROMPT`` (every rank runs the same forwards)."""
        gen = torch.Generator().manual_seed(self.config.seed)
        ids = encode(PROMPT)
        for _ in range(length):
            context = torch.tensor([ids[-self.config.seq_len :]])
            logits = self.lm.logits(self.model, context.to(self.device))[0, -1, :VOCAB]  # bytes
            logits = logits.float().cpu()
            probs = (logits / 0.8).softmax(-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
        return decode(ids)

    def save(self, now: bool = False) -> Path:
        """Save this step's checkpoint (``now``: synchronously, even with --ckpt-async)."""
        path = self.config.checkpoint_dir / f"step_{self.step:06d}"
        extra = {"step": self.step, "rng": torch.get_rng_state(), "config": asdict(self.config)}
        extra["world"] = self.world  # a resume at another world size says what changes
        # With --ckpt-async it is written in the background; the next save waits for it,
        # and only whole checkpoints are listed (a '.partial' one is not pruned or counted).
        self.pending = flatshard.save_checkpoint(
            path,
            self.model,
            self.optims,
            extra=extra,
            async_op=self.config.ckpt_async and not now,
            keep=self.config.keep_ckpts,  # counted once committed (an async save, too)
        )
        return path

    def resume(self, path: Path) -> list[str]:
        """Continue from the checkpoint at ``path``; the options that differ from the saved
        run's, each with what it changes ([Note: what a resume changes])."""
        extra = flatshard.load_checkpoint(path, self.model, self.optims)
        self.step = int(extra["step"])
        torch.set_rng_state(extra["rng"])
        saved_world = extra.get("world")
        world = saved_world if isinstance(saved_world, int) else self.world
        return resume_changes(extra["config"], world, self.config, self.world)


class PipelineTrainer(Trainer):
    """--pp: this rank's stages of the GPT (one; two under --pp-schedule interleaved),
    each sharded over the ranks that hold the same stage, run by
    torch.distributed.pipelining's --pp-schedule over --microbatches micro-batches. The
    ranks form a ("pp", "dp") mesh (pipeline-major, as torchtitan lays it out)."""

    def _sharded(self) -> nn.Module:
        """This rank's stage of the model (interleaved: a ModuleList of its two), sharded
        over the ranks that hold the same stage; the schedule that runs it."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        from flatshard.integrations.pipelining import PipelineStage

        config, device = self.config, self.device
        self.replicas = self.world // config.pp  # data-parallel ranks per stage
        mesh = init_device_mesh(
            device.type, (config.pp, self.replicas), mesh_dim_names=("pp", "dp")
        )
        rank = mesh.get_local_rank("pp")
        self.replica = mesh.get_local_rank("dp")
        self.pipeline = mesh["pp"].get_group()
        self.first, self.last = rank == 0, rank == config.pp - 1
        # A rank holds stages rank, rank + pp, ...: the first on pipeline rank 0, the last
        # on pipeline rank pp - 1 (torch's interleaved layout).
        indices = range(rank, config.pp_stages, config.pp)
        parts: list[nn.Module] = []
        stages: list[Any] = []  # torch's schedules take its stage base class
        for index in indices:
            module = self.lm.module if len(indices) == 1 else copy.deepcopy(self.lm.module)
            cut_to_stage(module, index, config.pp_stages)
            part = shard_language_model(replace(self.lm, module=module), config, device, mesh["dp"])
            parts.append(part)
            stages.append(PipelineStage(part, index, config.pp_stages, device, group=self.pipeline))
        micro = config.micro_batches
        if config.pp_schedule == "zero-bubble":
            self.schedule: Any = ScheduleInterleavedZeroBubble(
                stages, micro, loss_fn=_next_byte_loss
            )
        elif config.pp_schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, micro, loss_fn=_next_byte_loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[config.pp_schedule]
            self.schedule = kind(stages[0], micro, loss_fn=_next_byte_loss)
        return parts[0] if len(parts) == 1 else nn.ModuleList(parts)

    def _run(self, rows: torch.Tensor, train: bool) -> float:
        """The schedule over this replica's rows; the mean of its micro-batches' losses,
        sent from the last stage to every stage of the pipeline."""
        idx, target = rows[:, :-1].to(self.device), rows[:, 1:].to(self.device)
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        if self.first:
            run(idx, target=target if self.last else None, losses=losses)
        else:
            run(target=target if self.last else None, losses=losses)
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        mean = mean.detach().to(torch.float64)
        dist.broadcast(mean, group_src=self.config.pp - 1, group=self.pipeline)
        return float(mean)

    def _rows(self, source: torch.Tensor, seed: int, step: int, per_replica: int) -> torch.Tensor:
        batch = batch_for_step(source, self.config.seq_len, per_replica * self.replicas, seed, step)
        return batch[self.replica * per_replica : (self.replica + 1) * per_replica]

    def train_step(self) -> float:
        """One optimizer step: the schedule over --microbatches micro-batches of --batch
        sequences on each data-parallel replica; this replica's mean loss."""
        config, step = self.config, self.step + 1
        for optim in self.optims:
            for group in optim.param_groups:
                group["lr"] = config.lr_at(step)
        rows = self._rows(self.corpus.train, config.seed, step, config.batch * config.micro_batches)
        losses = _Losses()
        flatshard.train_step(  # the schedule runs the micro-batches; the norm: every stage's
            self.model,
            self.optims,
            lambda _: torch.tensor(self._run(rows, train=True)),
            accumulation="schedule",
            clip=config.clip if config.clip > 0 else None,
            observer=losses,
        )
        self.step = step
        return losses.total

    @torch.no_grad()
    def val_loss(self, batches: int = 4) -> float:
        """Mean loss on held-out windows (the same on every rank)."""
        rows = self.config.batch * self.config.micro_batches
        losses = []
        for i in range(batches):
            window = batch_for_step(self.corpus.val, self.config.seq_len, rows, 12345, i)
            losses.append(self._run(window, train=False))
        return sum(losses) / len(losses)

    def sample(self, length: int) -> str:
        """None under --pp: generating token by token through the stages is not built."""
        return ""


def _next_byte_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _compiled(model: nn.Module, lm: LanguageModel, config: TrainConfig) -> nn.Module:
    """--compile: each block compiled; the model's other parts and the hooks stay eager."""
    if config.compile:
        for module in model.modules():
            if type(module) in lm.unit_classes:
                module.compile()
    return model


_PREEMPTED: list[str] = []  # the signal that asked this rank to stop, once received
PREEMPTED_STATUS = 128 + signal.SIGTERM  # what schedulers read as "stopped by SIGTERM"


def _on_preempt(signum: int, frame: Any) -> None:
    """--ckpt-on-preempt: note the signal; the step's end agrees on it (``_loop``)."""
    _PREEMPTED.append(signal.Signals(signum).name)


def _train(config: TrainConfig, store: str | None, prediction: Prediction | None) -> None:
    if config.ckpt_on_preempt:
        signal.signal(signal.SIGTERM, _on_preempt)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    init = f"file://{store}" if store else "env://"
    device = init_rank(config.device, init, rank, world, local, config.share_gpus)
    try:
        backend = backend_for(config.device)
        if backend == "gloo":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        trainer = (PipelineTrainer if config.pp > 1 else Trainer)(config, device, prediction)
        try:
            _loop(trainer, backend)
        finally:  # a save being written needs the process groups: it ends first
            _settle_save(trainer, failing=sys.exc_info()[0] is not None)
            if trainer.ft is not None:
                trainer.ft.close()
    finally:
        dist.destroy_process_group()


def _settle_save(trainer: Trainer, failing: bool) -> None:
    """Wait for --ckpt-async's last save; while another error is raised, say its failure
    instead of raising it over that error."""
    if trainer.pending is None:
        return
    try:
        trainer.pending.wait()
    except flatshard.CheckpointError as error:
        if not failing:
            raise
        print(f"flatshard train: {error}", file=sys.stderr)


def _loop(trainer: Trainer, backend: str) -> None:
    config, lead = trainer.config, trainer.rank == 0
    out = Path(config.out_dir)
    check_checkpoint_room(config, trainer.params)
    path = resume_from(config)
    if path is not None:
        changes = trainer.resume(path)
        if lead:
            print(f"resumed from {path} at step {trainer.step}")
            if changes:
                print("options that differ from the saved run:\n  " + "\n  ".join(changes))
    elif config.resume == "auto" and lead:
        print(f"--resume auto: no whole checkpoint in {config.checkpoint_dir}, starting afresh")
    if trainer.ft is not None:  # the first quorum: a late or restarted group heals here
        trainer.ft.start(trainer.step)
        healed, trainer.step = trainer.step != trainer.ft.step, trainer.ft.step
        if lead and healed:
            print(f"replica group {config.ft_replica_id}: healed from a live group at step "
                  f"{trainer.step}")  # fmt: skip
    if lead:
        _print_start(trainer, backend)
    resumed_at = trainer.step if path is not None or trainer.step else None
    log = MetricsLog(out / "metrics.jsonl", resumed_at) if lead else None
    board = None
    if lead and config.log_to == "tensorboard":
        board = TensorBoardLog(out / "tensorboard", resumed_at)
    memory = peak_memory_label(trainer.device)
    bar = ProgressBar(config.steps, trainer.step + 1, config.log_every, memory) if lead else None
    started = time.perf_counter()
    while trainer.step < config.steps:
        tick = time.perf_counter()
        local = trainer.train_step()
        if trainer.measurement is not None:
            trainer.measurement.stepped(time.perf_counter() - tick)
        peak = peak_memory_mib(trainer.device)
        # On the rank's device: NCCL gathers GPU tensors only. The third: this rank got
        # SIGTERM (--ckpt-on-preempt); ranks get it at different steps, all stop at one.
        stop = float(bool(_PREEMPTED))
        facts = torch.tensor([local, peak, stop], dtype=torch.float64, device=trainer.device)
        everyone = [torch.zeros_like(facts) for _ in range(trainer.world)]
        dist.all_gather(everyone, facts)
        # Logged before the save: a crash during the save keeps the step's line, and a
        # resume from an older checkpoint drops it (MetricsLog) and logs it again.
        if log is not None and bar is not None:
            tokens = config.batch * config.grad_accum * config.seq_len * trainer.replicas
            metrics = StepMetrics(
                step=trainer.step,
                loss=sum(float(f[0]) for f in everyone) / trainer.world,
                lr=trainer.optims[0].param_groups[0]["lr"],
                tokens_per_s=tokens / (time.perf_counter() - tick),
                peak_mem_mib=[round(float(f[1]), 1) for f in everyone],
                elapsed_s=round(time.perf_counter() - started, 3),
                replica_groups=list(trainer.ft.group.quorum) if trainer.ft is not None else None,
                quorum_change=trainer.ft.group.change if trainer.ft is not None else None,
            )
            log.write(metrics)
            if trainer.ft is not None and trainer.ft.group.change:
                bar.note(trainer.ft.group.change)
            if board is not None:
                board.write(metrics)
            bar.update(metrics)
        preempted = any(bool(f[2]) for f in everyone) and trainer.step < config.steps
        saved = None
        if config.ckpt_every and (
            trainer.step % config.ckpt_every == 0 or trainer.step == config.steps
        ):
            saved = trainer.save(now=preempted)
            if bar is not None:
                background = config.ckpt_async and not preempted
                how = "writing in the background" if background else "saved"
                bar.note(f"checkpoint of step {trainer.step}: {saved} ({how})")
        if preempted:
            saved = saved or trainer.save(now=True)
            if lead:
                print(
                    f"flatshard train: SIGTERM at step {trainer.step}: saved {saved}; exiting "
                    f"with status {PREEMPTED_STATUS} (rerun with --resume auto to continue)",
                    flush=True,
                )
            if board is not None:
                board.close()
            raise SystemExit(PREEMPTED_STATUS)
    _finish(trainer, out, board)


def _accumulation_line(config: TrainConfig) -> str:
    """What each of --grad-accum's micro-batches communicates."""
    n, strategy = config.grad_accum, config.sharding_strategy
    if config.accum_no_sync:
        early = "no reduction (flatshard.no_sync: unsharded gradients kept)"
    elif strategy.is_hybrid:
        early = "a reduce-scatter per unit inside each host, nothing across hosts"
    else:
        early = "a reduction per unit"
    gathers = "the all-gathers of the strategy" if strategy.name != "NO_SHARD" else "no gather"
    first = "micro-batch 1" if n == 2 else f"micro-batches 1-{n - 1}"
    return (
        f"accumulation: {n} micro-batches per step; {first}: {early}, {gathers}; "
        f"micro-batch {n}: the reduction of the whole step's gradients"
    )


def _optimizer_phrase(kind: str) -> str:
    """How the banner names --optimizer (nothing for the default)."""
    names = {"adamw": "", "muon": "Muon + AdamW", "adafactor": "Adafactor"}
    return f", {names[kind]}, whole parameters" if names[kind] else ""


def _print_start(trainer: Trainer, backend: str) -> None:
    config = trainer.config
    units = ", sublayer units" if config.units == "sublayers" else ""
    print(
        f"flatshard train: {trainer.lm.description}, {trainer.params:,} parameters, "
        f"{trainer.world} ranks ({backend}, {config.sharding_strategy.name}{units}"
        f"{kept_phrase(config.keep_gathered)}{', CPU offload' if config.cpu_offload else ''}"
        f"{', row-sparse embeddings' if config.row_sparse_tables else ''}"
        f"{f', experts split over {config.ep} ranks' if config.ep > 1 else ''}"
        f"{_gather_phrase(config.gather_dtype)}"
        f"{_optimizer_phrase(config.optimizer)}), {config.steps} steps"
    )
    print(
        f"data: {trainer.corpus.name}, {len(trainer.corpus.train):,} training bytes; "
        f"unigram entropy {trainer.corpus.unigram_entropy:.3f} nats/byte (uniform 5.545)"
    )
    if config.pp > 1:
        print(
            f"pipeline: {config.pp_stages} stages"
            f"{', two a rank' if config.pp_stages > config.pp else ''} ({config.pp_schedule}, "
            f"{config.micro_batches} micro-batches a step), each sharded over "
            f"{trainer.replicas} rank"
            f"{'s' if trainer.replicas > 1 else ''}; "
            "below: rank 0's part (the first stage); no text sample at the end"
        )
    elif config.grad_accum > 1:
        print(_accumulation_line(config))
    print(flatshard.sharding_summary(trainer.model))
    if config.mixed_precision != "none" or config.gather_dtype != "none":
        print("dtype plan (master = optimizer state dtype):")
        print(flatshard.dtype_report(trainer.model))


def _gather_phrase(gather_dtype: str) -> str:
    if gather_dtype == "none":
        return ""
    scaled = " with row scales" if gather_dtype in ("int8", "fp8", "fp8-e5m2") else ""
    return f", {gather_dtype} gathers{scaled}"


def _finish(trainer: Trainer, out: Path, board: TensorBoardLog | None) -> None:
    """Held-out loss, a text sample, the plot (collectives first, then rank 0 prints)."""
    val = trainer.val_loss()
    text = trainer.sample(trainer.config.sample_bytes) if trainer.config.sample_bytes else ""
    exported = None
    if trainer.config.model.startswith("hf:"):  # for from_pretrained (config.json included)
        exported = out / "hf_model"
        export_hugging_face(trainer.model, trainer.lm, exported)
    if trainer.rank != 0:
        return
    if trainer.measurement is not None:
        print(trainer.measurement.report())
    if trainer.ft is not None:
        print(
            f"replica group {trainer.config.ft_replica_id} of {trainer.config.ft_replicas}: "
            f"{trainer.ft.group.fewer} steps taken with fewer replica groups"
        )
    if exported is not None:
        print(f"exported for from_pretrained: {exported}")
    print(
        f"held-out loss {val:.4f} nats/byte (unigram entropy {trainer.corpus.unigram_entropy:.3f})"
    )
    if text:
        print("sample:\n" + text)
    print(plot(out / "metrics.jsonl", out / "loss.png", val, trainer.corpus.unigram_entropy))
    print(f"metrics: {out / 'metrics.jsonl'}")
    if board is not None:
        board.finish(trainer.step, val)
        print(f"TensorBoard: tensorboard --logdir {board.directory}")
