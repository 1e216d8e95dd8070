"""``flatshard bench``: flatshard against FSDP2, DDP and no communication, side by side.

Every system trains the same GPT (same seed, same data) at the same world size, in
processes of its own (so per-rank peak memory is its own). In each round every system's
processes are started afresh and kept alive together, and the systems take their steps in
turn, one step each: machine drift hits all systems alike (the memory of all of them is
needed at once). "floor" is each rank training alone without communicating:
the time any data-parallel system adds on top of it is communication it did not hide plus
its own software overhead. gloo on CPUs; NCCL with one GPU per rank where GPUs are visible
(``--device``). "tensors MiB" is the steady-state peak of tensor memory per rank, tracked
at the dispatcher in a pass of its own after the timed steps (see [Note: honest memory] in
``cli/bench/memory.py``): what sharding saves. "peak RSS" (CPU) or
``max_memory_allocated`` (GPUs) is the process's peak, model building included;
"comm wait" (flatshard's time blocked on its collectives: exposed communication) is
measured on CPU only, since on GPUs waiting is the device's, not the CPU's; a line after
the table splits it by unit. With row-sparse embedding tables (``--row-sparse-tables``,
on in the llm presets) another line gives the bytes they sent per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.cli.bench.bound import LeastCollectives
from flatshard.cli.bench.config import GATHER_SYSTEMS, PRESETS, BenchConfig
from flatshard.cli.bench.formula import flatshard_formulas
from flatshard.cli.bench.memory import steady_state_peak
from flatshard.cli.bench.pipeline import PipelinedGPT, build_pipelined
from flatshard.cli.bench.prediction import predict, predicted_line
from flatshard.cli.bench.report import chart, pipeline_line, scaling_table, summarize, table
from flatshard.cli.bench.zero3 import SYSTEM as DEEPSPEED
from flatshard.cli.bench.zero3 import ZeRO3
from flatshard.cli.config import add_config_parser, config_from_args
from flatshard.cli.devices import init_rank, peak_memory_mib, resolve_device
from flatshard.cli.internals import PlacementRule, TokenBytes, WaitClock, fast_context
from flatshard.cli.lm.optimizers import build_optimizers, placement_for, with_experts
from flatshard.measure import ALL_GATHER, ALL_TO_ALL, CollectiveTracker
from flatshard.models import GPT, GPTBlock
from flatshard.report import describe_collectives


def add_parser(commands: Any) -> None:
    add_config_parser(
        commands,
        "bench",
        help="time flatshard against FSDP2, DDP and no communication on the same GPT",
        description=__doc__,
        config=BenchConfig,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    for name, value in PRESETS.get(getattr(args, "preset", ""), {}).items():
        if not hasattr(args, name):  # the preset's shape, except what was given as a flag
            setattr(args, name, value)
    config = config_from_args(BenchConfig, args)
    config = replace(config, device=resolve_device(config.device, config.nproc, config.share_gpus))
    worlds = range(1, config.nproc + 1) if config.scaling else [config.nproc]
    by_world = {w: _bench(replace(config, nproc=w)) for w in worlds}
    summary, collectives = by_world[config.nproc]
    if collectives:
        print(f"flatshard collectives: {collectives}")
    predicted: dict[str, float] = {}
    if config.scaling:
        print(scaling_table({w: s for w, (s, _) in by_world.items()}, config.system_list))
    else:
        print(table(summary, "RSS" if config.device == "cpu" else "alloc."))
        if config.pp > 1:
            stages = f"{config.pp_stages} stages, {config.pp_schedule}, {config.grad_accum} mb"
            print(pipeline_line(summary, stages))
        # Adafactor's step reads values a plan lacks; the plan accumulates with no_sync.
        plannable = config.optimizer != "adafactor" and config.accum == "no_sync"
        if "flatshard" in summary and not config.compile and plannable:
            if config.row_sparse_tables:  # the planner's meta world has no token ids
                print(  # the plan's bound, not this batch (see flatshard.plan)
                    "flatshard plan: not predicted (a plan takes every token id distinct)"
                )
            elif config.experts:  # routing decides the token traffic; meta has no routing
                print("flatshard plan: not predicted (the planner does not route tokens)")
            else:
                predicted = predict(config)
                print(predicted_line(predicted, summary["flatshard"]))
        for system in (s for s in summary if s.startswith("flatshard")):
            waits = {
                k[len("wait_s ") :]: v
                for k, v in summary[system].items()
                if k.startswith("wait_s ") and v >= 0.0005
            }
            if waits and config.device == "cpu":
                top = sorted(waits.items(), key=lambda kv: -kv[1])[:6]
                shown = ", ".join(f"{unit} {s:.3f}" for unit, s in top)
                print(
                    f"{system} exposed wait per unit (rank 0, s per step, largest first): {shown}"
                )
        if config.experts:
            moved = ", ".join(
                f"{name} {row['all_gather_bytes'] / 1e6:.1f} / {row['token_bytes'] / 1e6:.1f}"
                for name, row in summary.items()
            )
            print(f"MB per step received by rank 0, all-gathered / tokens' all-to-alls: {moved}")
        if "embedding_bytes_per_step" in summary.get("flatshard", {}):
            row = summary["flatshard"]
            print(
                f"flatshard row-sparse tables: {row['embedding_bytes_per_step'] / 1e6:.3f} MB "
                f"sent per step by rank 0 (ids and rows); {row['embedding_sparse_lookups']:.0f} "
                f"sparse and {row['embedding_dense_lookups']:.0f} dense lookups"
            )
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "bench.json"), "w") as f:
        report = {"config": asdict(config), "collectives": collectives, "systems": summary}
        if predicted:
            report["plan"] = predicted
        if config.scaling:
            report["scaling"] = {str(w): s for w, (s, _) in by_world.items()}
        json.dump(report, f, indent=2)
    print(f"results: {config.out}/bench.json")
    print(chart(summary, os.path.join(config.out, "bench.png"), config.device))
    return 0


def _bench(config: BenchConfig) -> tuple[dict[str, dict[str, float]], str]:
    """Every system at ``config.nproc`` ranks: the summary and flatshard's collectives."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in config.system_list}
    for _ in range(config.rounds):
        for system, report in _interleaved_round(config).items():
            runs[system].append(report)
    collectives = next((r["collectives"] for r in runs.get("flatshard", [])), "")
    tokens = config.batch * config.seq_len * config.nproc // config.pp  # --pp: per replica
    return summarize(tokens, config.layers + 1, runs), collectives


class _System:
    """One system's ranks, alive for a round, each running a step when told to."""

    def __init__(self, config: BenchConfig, system: str, store: str) -> None:
        ctx = fast_context()
        self.system = system
        self.answers = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(config.nproc)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, config, system, store, inbox, self.answers))
            for r, inbox in enumerate(self.inboxes)
        ]
        for proc in self.procs:
            proc.start()

    def ask(self, command: str) -> list[dict[str, Any]]:
        """Send ``command`` to every rank; their answers, rank 0 first."""
        for inbox in self.inboxes:
            inbox.put(command)
        return self.collect()

    def collect(self) -> list[dict[str, Any]]:
        """One answer per rank; the first failure is raised at once (its peers may hang)."""
        answers = []
        for _ in self.procs:
            answer = self.answers.get(timeout=3600)
            if "error" in answer:
                raise RuntimeError(f"flatshard bench: {self.system} failed: {answer['error']}")
            answers.append(answer)
        return sorted(answers, key=lambda a: int(a["rank"]))

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


def _interleaved_round(config: BenchConfig) -> dict[str, dict[str, Any]]:
    """Every system in fresh processes, all alive at once, taking steps in turn.

    One system steps at a time (the others wait on their queues without using the CPU),
    so a slow minute of a shared machine falls on every system alike. Returns each
    system's rank-0 step times and waits, collective facts and peak memory of any rank.
    """
    times: dict[str, list[float]] = {s: [] for s in config.system_list}
    cpus: dict[str, list[float]] = {s: [] for s in config.system_list}  # rank 0's CPU s
    waits: dict[str, list[float]] = {s: [] for s in config.system_list}
    bubbles: dict[str, list[float]] = {s: [] for s in config.system_list}  # --pp
    reports: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flatshard-bench-") as tmp:
        systems = [
            _System(config, name, os.path.join(tmp, f"store-{name}")) for name in config.system_list
        ]
        try:
            for system in systems:
                system.collect()  # built and ready
            for step in range(config.warmup + config.steps):
                for system in systems:
                    answers = system.ask("step")
                    rank0 = answers[0]
                    if step >= config.warmup:
                        times[system.system].append(rank0["time"])
                        cpus[system.system].append(rank0["cpu"])
                        waits[system.system].append(rank0["wait"])
                        if "bubble" in rank0:  # [Note: the bubble, measured]
                            bubble = statistics.mean(a["bubble"] for a in answers)
                            bubbles[system.system].append(bubble)
            for system in systems:
                answers = system.ask("stop")
                reports[system.system] = {
                    **answers[0],
                    "step_times": times[system.system],
                    "cpu_times": cpus[system.system],
                    "comm_waits": waits[system.system] if answers[0]["waits_measured"] else [],
                    "bubbles": bubbles[system.system],
                    "peak_mem_mib": max(a["peak_mem_mib"] for a in answers),
                    "tensor_peak_mib": max(a["tensor_peak_mib"] for a in answers),
                    "tensor_rest_mib": max(a["tensor_rest_mib"] for a in answers),
                    "formula_rest_mib": max(a["formula_rest_mib"] for a in answers),
                }
        finally:
            for system in systems:
                for inbox in system.inboxes:
                    inbox.put("stop")  # a rank still waiting for orders ends
                system.close()
    return reports


def _worker(
    rank: int, config: BenchConfig, system: str, store: str, inbox: Any, answers: Any
) -> None:
    """One rank of one system: build, then run a step per "step" order until "stop"."""
    torch.set_num_threads(1)
    try:
        store_at = f"file://{store}"
        device = init_rank(config.device, store_at, rank, config.nproc, rank, config.share_gpus)
        answers.put({"rank": rank, **_serve(config, system, rank, device, inbox, answers)})
    except Exception as error:  # reported by the parent, which then stops
        answers.put({"rank": rank, "error": f"rank {rank}: {error!r}"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(
    config: BenchConfig,
    system: str,
    rank: int,
    device: torch.device,
    inbox: Any,
    answers: Any,
) -> dict[str, Any]:
    model, optim = _build(config, system, device)
    gen = torch.Generator().manual_seed(1 + rank)
    tracker = CollectiveTracker()
    answers.put({"rank": rank, "ready": True})
    step = 0
    by_unit: dict[str, float] = {}  # WaitClock.by_unit when the timed steps began
    tokens_before = TokenBytes.received
    while inbox.get() == "step":
        if step == config.warmup:
            by_unit = dict(WaitClock.by_unit)
        idx = torch.randint(0, config.vocab, (config.batch, config.seq_len + 1), generator=gen)
        idx = idx.to(device)
        _synchronize(device)
        dist.barrier()
        if step == config.warmup:
            tokens_before = TokenBytes.received
        start, cpu, waited = time.perf_counter(), time.process_time(), WaitClock.seconds
        busy = model.busy_s if isinstance(model, PipelinedGPT) else 0.0
        with tracker if step == config.warmup else contextlib.nullcontext():
            _train_step(model, optim, idx, config, system)
        _synchronize(device)
        dist.barrier()
        elapsed = time.perf_counter() - start
        answer = {"rank": rank, "time": elapsed, "wait": WaitClock.seconds - waited}
        answer["cpu"] = time.process_time() - cpu  # all of this rank's threads
        if isinstance(model, PipelinedGPT):  # [Note: the bubble, measured]
            answer["bubble"] = 1 - (model.busy_s - busy) / elapsed
        answers.put(answer)
        step += 1
    formulas = {"rest": -1, "collective": -1}  # -1: no formula for this system
    plain = system.startswith("flatshard") and system not in GATHER_SYSTEMS
    expert_parallel = config.ep > 1 and system != "flatshard-noep"
    if (
        plain and config.grad_accum == 1 and not expert_parallel
    ):  # formulas of one batch (fp32 gathers)
        formulas = flatshard_formulas(model, optim, config.layers, config.nproc)
    tables = flatshard.embedding_traffic(model) if system.startswith("flatshard") else {}
    row_bytes = next((p.element_size() for p in model.parameters()), 4)  # "comm": none
    embedding = _embedding_report(tables, step, row_bytes)
    waits = _unit_waits(by_unit, max(1, step - config.warmup))  # before the memory pass
    token_bytes = (TokenBytes.received - tokens_before) // max(1, step - config.warmup)
    del model, optim  # the memory pass builds its own
    tensor_rest, tensor_peak = steady_state_peak(
        lambda: _build(config, system, device), lambda m, o: _train_step(m, o, idx, config, system)
    )
    return {
        "tensor_rest_mib": tensor_rest / 2**20,
        "formula_rest_mib": formulas["rest"] / 2**20,
        "formula_collective_bytes": formulas["collective"],
        "tensor_peak_mib": tensor_peak / 2**20,
        # flatshard's time blocked on its collectives: exposed communication on CPU only.
        "waits_measured": system.startswith("flatshard") and device.type == "cpu",
        "collectives": describe_collectives(cast(dist.ProcessGroup, dist.group.WORLD))
        if system == "flatshard"
        else "",
        "collective_output_bytes": int(sum(tracker.bytes.values())),
        "sent_bytes": tracker.sent_bytes(),  # [Note: bytes sent, not bytes produced]
        "all_gather_bytes": int(tracker.bytes[ALL_GATHER]),
        "all_to_all_bytes": int(tracker.bytes[ALL_TO_ALL]),
        "bytes_by_kind": {kind: int(n) for kind, n in tracker.bytes.items()},
        # the experts' token all-to-alls alone (gloo's reduce-scatters are all-to-alls too)
        "token_bytes": token_bytes,
        "peak_mem_mib": peak_memory_mib(device),
        **embedding,
        **waits,
    }


def _unit_waits(before: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per timed step this rank waited on each unit's collectives ("wait_s <unit>";
    "" is the step's own checks), from WaitClock.by_unit (CPU: the exposed communication)."""
    return {
        f"wait_s {unit or '<checks>'}": (seconds - before.get(unit, 0.0)) / steps
        for unit, seconds in WaitClock.by_unit.items()
    }


def _embedding_report(
    tables: dict[str, flatshard.TableTraffic], steps: int, row_item: int
) -> dict[str, Any]:
    """Row-sparse tables: bytes this rank sent for them per step (ids and rows, both ways)
    and their sparse/dense lookups, over every step taken (warm-up included)."""
    if not tables or not steps:
        return {}
    sent = sum(
        (t.lookup_ids + t.grad_ids) * 8 + (t.lookup_rows + t.grad_rows) * row_item
        for t in tables.values()
    )
    return {
        "embedding_bytes_per_step": sent / steps,
        "embedding_sparse_lookups": sum(t.lookups for t in tables.values()),
        "embedding_dense_lookups": sum(t.dense_lookups for t in tables.values()),
    }


def _build(
    config: BenchConfig, system: str, device: torch.device
) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    if config.pp > 1:  # AdamW alone: nothing kept whole
        run = build_pipelined(config, system, device)
        return run, build_optimizers(run, {GPTBlock}, config.optimizer, 1e-4, 0.0)
    torch.manual_seed(0)
    gpt = GPT(
        config.vocab,
        config.dim,
        config.heads,
        config.layers,
        config.seq_len,
        config.tied,
        config.experts,
    )
    if system == "comm":  # [Note: the achievable bound]
        return LeastCollectives(gpt, config.nproc, device), []
    if system == DEEPSPEED:
        return ZeRO3(gpt.to(device), config.batch, config.grad_accum, device), []
    sparse = config.row_sparse_tables and system != "flatshard-dense"
    placement = placement_for(config.optimizer, gpt, {GPTBlock}, sparse)
    if config.ep > 1 and system.startswith("flatshard") and system != "flatshard-noep":
        placement = with_experts(placement, gpt, config.ep)
    model = _wrap(gpt.to(device), system, device, placement)
    if config.accum == "keep" and system.startswith("flatshard"):
        flatshard.set_reshard_after_backward(model, False)  # gathered again after a step
    if config.compile:
        for block in gpt.blocks:
            block.compile()
    return model, build_optimizers(model, {GPTBlock}, config.optimizer, 1e-4, 0.0)


def _train_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    idx: torch.Tensor,
    config: BenchConfig,
    system: str,
) -> None:
    """One optimizer step over --grad-accum micro-batches of ``idx``, accumulated as
    --accum says, with each system's own switches."""
    if isinstance(model, PipelinedGPT):  # --pp: the schedule runs the micro-batches
        model.train_step(idx, optimizers, system)
        return
    if isinstance(model, LeastCollectives):
        model.step(config.grad_accum)
        return
    if isinstance(model, ZeRO3):
        model.step(idx)
        return
    count = config.grad_accum
    parts = idx.chunk(count)
    if system.startswith("flatshard"):  # flatshard train's own loop (runtime/_step_loop.py)

        def micro_loss(micro: int) -> torch.Tensor:
            part = parts[micro]
            logits = model(part[:, :-1]).flatten(0, 1)
            return nn.functional.cross_entropy(logits, part[:, 1:].flatten())

        accumulation = "reduce" if config.accum == "reduce" else "no_sync"
        flatshard.train_step(model, optimizers, micro_loss, count, accumulation=accumulation)
        return
    for micro, part in enumerate(parts):
        last = micro == count - 1
        with _micro_batch(model, system, config.accum, last):
            # The logits are not held by name: alive through backward, they would add
            # their size to the peak the plan predicts (cross_entropy keeps its own).
            loss = nn.functional.cross_entropy(
                model(part[:, :-1]).flatten(0, 1), part[:, 1:].flatten()
            )
            torch.autograd.backward(loss / count if count > 1 else loss)
    for optim in optimizers:
        optim.step()
        optim.zero_grad()


def _micro_batch(
    model: nn.Module, system: str, accum: str, last: bool
) -> contextlib.AbstractContextManager[Any]:
    """The context (or switches) of one micro-batch's backward for the other systems: no
    reduction before the last unless --accum reduce; FSDP2 keeps units gathered only while
    asked (keep)."""
    quiet = accum != "reduce" and not last
    if system == "fsdp2":
        fsdp: Any = model
        fsdp.set_requires_gradient_sync(not quiet)
        if accum == "keep":
            fsdp.set_reshard_after_backward(last)
        return contextlib.nullcontext()
    if system == "ddp" and quiet:
        return cast(nn.parallel.DistributedDataParallel, model).no_sync()
    return contextlib.nullcontext()


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on GPUs would otherwise be launch times)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _wrap(model: GPT, system: str, device: torch.device, placement: PlacementRule) -> nn.Module:
    """``model`` as ``system`` runs it; flatshard with the placement of Muon/Adafactor
    (matrices whole) and --row-sparse-tables (tables row-sparse, but flatshard-dense)."""
    options: dict[str, Any] = {"placement": placement}
    if system == "flatshard":
        return flatshard.fully_shard(model, auto_wrap_policy={GPTBlock}, **options)
    if system == "flatshard-noprefetch":
        return flatshard.fully_shard(
            model,
            auto_wrap_policy={GPTBlock},
            prefetch=flatshard.Prefetch(backward=None, forward=False),
            **options,
        )
    if system == "flatshard-debug":
        flatshard.set_checks(flatshard.Checks(debug=True))  # this system's processes only
        return flatshard.fully_shard(model, auto_wrap_policy={GPTBlock}, **options)
    if system in ("flatshard-dense", "flatshard-noep"):
        return flatshard.fully_shard(model, auto_wrap_policy={GPTBlock}, **options)
    if system == "flatshard-twin":
        sharded = flatshard.fully_shard(model, auto_wrap_policy={GPTBlock}, **options)
        flatshard.set_separate_reduce_scatter_group(sharded, True)
        return sharded
    if system in GATHER_SYSTEMS:
        policy = flatshard.MixedPrecision(gather_dtype=GATHER_SYSTEMS[system])
        return flatshard.fully_shard(
            model, auto_wrap_policy={GPTBlock}, mixed_precision=policy, **options
        )
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if system == "ddp":
        ids = None if device.type == "cpu" else [device]
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model  # floor: every rank trains alone
