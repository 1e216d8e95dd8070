"""The stages of ``benchmarks/gpu_check.sh``: NCCL above one rank, several ranks on one GPU.

Each stage spawns its ranks on the one GPU (each rank posing as a host of its own:
``flatshard.cli.devices.share_gpu_environment``), runs its cases, and writes one line per
case to ``<out>/<stage>.txt`` as it goes ("ok ..." or "FAILED ..."); the exit code is 1 if
any case failed. ``--device cpu`` rehearses every stage on gloo (what CI's machines can do),
so the script itself is tested before a GPU runs it.

    python benchmarks/gpu_check.py smoke|parity|four|audit [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flatshard
from flatshard.cli.devices import share_gpu_environment
from flatshard.testing.delays import gpu_lag
from flatshard.testing.internals import comm_agreement, forget_hybrid_groups
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    RunResult,
    assert_same,
    batches,
    run_flatshard,
    run_mixed_reference,
    run_reference,
    slice_batch,
)

RTOL = 1e-4  # CUDA's atomically accumulated gradients (embeddings) change summation order
LOW_RTOL = 4 * 2**-7  # bf16 and fp16, as tests/test_mixed_precision.py

# (world size, what) per stage
STAGES = {"smoke": 2, "parity": 2, "four": 4, "audit": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", default="", help="nccl or gloo (default: by device)")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    args = parser.parse_args()
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = STAGES[args.stage]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _rank_main,
            args=(args.stage, world, backend, args.device, f"file://{tmp}/store", str(out)),
            nprocs=world,
        )
    lines = (out / f"{args.stage}.txt").read_text().splitlines()
    print("\n".join(lines))
    return 1 if any(line.startswith("FAILED") for line in lines) or not lines else 0


def _rank_main(
    rank: int, stage: str, world: int, backend: str, device: str, store: str, out: str
) -> None:
    if device == "cuda":
        share_gpu_environment(rank)
        torch.cuda.set_device(0)
    bound = torch.device("cuda", 0) if backend == "nccl" else None
    dist.init_process_group(
        backend, init_method=store, rank=rank, world_size=world, device_id=bound
    )
    report = _Report(Path(out) / f"{stage}.txt", rank)
    try:
        CASES[stage](report, torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    finally:
        dist.destroy_process_group()


class _Report:
    """Rank 0 writes each case's line as it ends (the file survives a stage cut short)."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank
        if rank == 0:
            path.write_text("")

    def case(self, name: str, run: Callable[[], str | None]) -> None:
        try:
            detail = run()
            line = f"ok {name}" + (f": {detail}" if detail else "")
        except Exception as error:
            line = f"FAILED {name}: {error!r}"[:3000]
            traceback.print_exc()
        if self.rank == 0:
            with self.path.open("a") as f:
                f.write(line + "\n")


# ---------------------------------------------------------------- stage 0: smoke
def smoke(report: _Report, device: torch.device) -> None:
    """The collectives flatshard uses, with their values checked."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def gathers() -> str:
        mine = torch.full((3,), float(rank + 1), device=device)
        full = torch.empty(3 * world, device=device)
        dist.all_gather_into_tensor(full, mine)
        expected = torch.arange(1, world + 1, device=device, dtype=torch.float).repeat_interleave(3)
        torch.testing.assert_close(full, expected)
        shard = torch.empty(3, device=device)
        dist.reduce_scatter_tensor(shard, torch.ones(3 * world, device=device))
        torch.testing.assert_close(shard, torch.full((3,), float(world), device=device))
        total = torch.tensor([float(rank)], device=device)
        dist.all_reduce(total)
        assert total.item() == sum(range(world)), total
        return dist.get_backend()

    def objects() -> None:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, {"rank": rank})
        assert every == [{"rank": r} for r in range(world)], every
        sent = [f"from {rank}"]
        dist.broadcast_object_list(sent, src=0)
        assert sent == ["from 0"], sent

    report.case("all-gather, reduce-scatter, all-reduce", gathers)
    report.case("object collectives", objects)


# ---------------------------------------------------------------- stage 1: parity at 2
PARITY = [
    ParityConfig("gpt", 2, steps=3),
    ParityConfig("gpt", 2, steps=3, strategy="NO_SHARD"),
    ParityConfig("gpt", 2, steps=3, clip=0.5),
    ParityConfig("gpt", 2, steps=3, clip=0.5, norm_type=float("inf")),
    ParityConfig("gpt", 2, steps=3, comm_hook="bf16"),
    ParityConfig("gpt", 2, steps=3, micro_batches=2, no_sync=True),
    ParityConfig("gpt", 2, steps=3, checkpoint="inside"),
    ParityConfig("gpt", 2, steps=3, offload=True),
    ParityConfig("gpt", 2, steps=3, param_dtype="bfloat16"),
    ParityConfig("gpt", 2, steps=3, forward_prefetch=True, limit_all_gathers=False),
]


def _lagged_parity(config: ParityConfig, group: dist.ProcessGroup) -> str:
    """flatshard as is and under GPU lag: bitwise equal; rank 0 against the reference."""
    plain = run_flatshard(config, group)
    with gpu_lag():
        lagged = run_flatshard(config, group)
    assert lagged.losses == plain.losses, (lagged.losses, plain.losses)
    for name, value in plain.params.items():
        assert torch.equal(lagged.params[name], value), f"{name} differs under GPU lag"
    if dist.get_rank() == 0:
        if config.param_dtype is not None or config.comm_hook is not None:
            reference = run_mixed_reference(config) if config.param_dtype else run_reference(config)
            assert_same(reference, RunResult(plain.losses, plain.params), LOW_RTOL)
        else:
            assert_same(run_reference(config), plain, rtol=RTOL)
    return f"losses {[round(x, 5) for x in plain.losses]}"


def _name(config: ParityConfig) -> str:
    defaults = ParityConfig(config.model, config.world_size, steps=config.steps)
    changed = {k: v for k, v in vars(config).items() if getattr(defaults, k) != v and k != "device"}
    return f"{config.model} x{config.world_size} {changed or 'defaults'}"


def parity(report: _Report, device: torch.device) -> None:
    group = dist.group.WORLD
    assert group is not None
    for config in PARITY:
        config = replace(config, device=device.type)  # "cuda": no index (issue 31, item 4)
        report.case(_name(config), lambda c=config: _lagged_parity(c, group))
    report.case("fp16 with ShardedGradScaler, under lag", lambda: _fp16_scaler(device))
    report.case("summon and full state dict round trips", lambda: _round_trips(device))


def _fp16_scaler(device: torch.device) -> str:
    """Three fp16 steps with the scaler, as is and under lag: the same losses, finite."""

    def run() -> list[float]:
        torch.manual_seed(0)
        model: Any = build("gpt").to(device)
        flatshard.fully_shard(
            model,
            auto_wrap_policy=set(model.UNIT_CLASSES),
            mixed_precision=flatshard.MixedPrecision(param_dtype=torch.float16),
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = flatshard.ShardedGradScaler(device.type)
        losses = []
        for batch in batches(model, 3, device.type):
            loss = model.loss(slice_batch(batch, dist.get_rank(), dist.get_world_size()))
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            flatshard.clip_grad_norm_(model, 1.0)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            losses.append(loss.item())
        return losses

    plain = run()
    with gpu_lag():
        lagged = run()
    assert plain == lagged and all(torch.isfinite(torch.tensor(plain))), (plain, lagged)
    return f"losses {[round(x, 4) for x in plain]}"


def _round_trips(device: torch.device) -> None:
    """summon writes back; a full state dict loads into a fresh sharded model."""
    torch.manual_seed(0)
    model: Any = build("gpt").to(device)
    flatshard.fully_shard(model, auto_wrap_policy=set(model.UNIT_CLASSES))
    with flatshard.summon_full_params(model):
        model.tok.weight.data.mul_(2)
    full = flatshard.full_state_dict(model, rank0_only=False)
    torch.manual_seed(1)
    fresh: Any = build("gpt").to(device)
    flatshard.fully_shard(fresh, auto_wrap_policy=set(fresh.UNIT_CLASSES))
    flatshard.load_state_dict(fresh, full)
    again = flatshard.full_state_dict(fresh, rank0_only=False)
    for name, value in full.items():
        assert torch.equal(value, again[name]), name


# ---------------------------------------------------------------- stage 2: four ranks
def four(report: _Report, device: torch.device) -> None:
    group = dist.group.WORLD
    assert group is not None
    hybrid = [
        ParityConfig("gpt", 4, steps=3, strategy="HYBRID_SHARD", sharding_factor=2),
        ParityConfig("gpt", 4, steps=3, strategy="HYBRID_SHARD_ZERO2", sharding_factor=2),
        # the last unit kept gathered: in HYBRID_SHARD_ZERO2, beside HYBRID_SHARD units
        ParityConfig(
            "gpt", 4, steps=3, strategy="HYBRID_SHARD", sharding_factor=2, keep_gathered=1
        ),
    ]
    for config in hybrid:
        config = replace(config, device=device.type)
        report.case(_name(config), lambda c=config: _lagged_parity(c, group))
    report.case("per-block hybrid: communicators made", lambda: _per_block_groups(device))
    report.case("dp 2 x tp 2 on one mesh", lambda: _dp_tp(device))
    report.case("experts: EP 2 x data 2 (token all-to-alls)", lambda: _experts(device))
    report.case("checkpoint round trip (DCP)", lambda: _checkpoint(device))


def _per_block_groups(device: torch.device) -> str:
    """Per-block hybrid fully_shard calls share one shard and one replicate group."""
    forget_hybrid_groups()
    made = Counter[str]()
    real = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made["groups"] += 1
        return real(*args, **kwargs)

    with mock.patch.object(dist, "new_group", counted):
        torch.manual_seed(0)
        model: Any = build("gpt").to(device)
        for block in model.blocks:
            flatshard.fully_shard(block, strategy="HYBRID_SHARD", sharding_factor=2)
        flatshard.fully_shard(model, strategy="HYBRID_SHARD", sharding_factor=2)
    batch = slice_batch(next(batches(model, 1, device.type)), dist.get_rank(), 4)
    model.loss(batch).backward()
    assert made["groups"] <= 4, made  # (2 shard + 2 replicate groups at 2 x 2, once)
    return f"{made['groups']} groups for {len(model.blocks) + 1} calls"


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def _dp_tp(device: torch.device) -> str:
    """Megatron's MLP split over "tp", sharded over "dp": the plain model's losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    plain = _MLP().to(device)
    model = _MLP().to(device)
    model.load_state_dict(plain.state_dict())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    flatshard.fully_shard(model, process_group=mesh["dp"])
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    gen = torch.Generator().manual_seed(0)
    dp = mesh["dp"].get_local_rank()
    for _ in range(3):
        x = torch.randn(8, 8, generator=gen).to(device)  # the global batch, every rank
        mine = model(x[dp * 4 : (dp + 1) * 4]).pow(2).mean()
        mine.backward()
        plain(x).pow(2).mean().backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    return _same_as(plain, model, device)


def _experts(device: torch.device) -> str:
    """TinyMoE's experts split over EP groups of 2 (Experts(2)), each rank its own batch:
    the unsharded model trained with DDP's semantics."""
    from flatshard.testing.models import MoEBlock, TinyMoE, experts_of

    torch.manual_seed(0)
    plain = TinyMoE().to(device)
    model = TinyMoE().to(device)
    model.load_state_dict(plain.state_dict())
    flatshard.fully_shard(
        model,
        auto_wrap_policy={MoEBlock},
        placement=lambda name, p: flatshard.Experts(2) if experts_of(name, p) else None,
    )
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    gen = torch.Generator().manual_seed(0)
    me, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        x, y = (torch.randn(8, 8, generator=gen).to(device) for _ in range(2))
        rows = 8 // world
        model.loss((x[me * rows :][:rows], y[me * rows :][:rows])).backward()
        for r in range(world):  # DDP: each rank's loss, the gradients averaged
            (plain.loss((x[r * rows :][:rows], y[r * rows :][:rows])) / world).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    return _same_as(plain, model, device)


def _same_as(plain: nn.Module, model: nn.Module, device: torch.device) -> str:
    """The sharded model's full parameters against the plain model's."""
    full = flatshard.full_state_dict(model, rank0_only=False)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(full[name].to(device), value, rtol=RTOL, atol=1e-6)
    return "parameters equal after 3 steps"


def _checkpoint(device: torch.device) -> None:
    torch.manual_seed(0)
    model: Any = build("gpt").to(device)
    flatshard.fully_shard(model, auto_wrap_policy=set(model.UNIT_CLASSES))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in batches(model, 2, device.type):
        model.loss(slice_batch(batch, dist.get_rank(), 4)).backward()
        optim.step()
        optim.zero_grad()
    path = Path(tempfile.gettempdir()) / "flatshard-gpu-check-ckpt"
    holder = [str(path)]
    dist.broadcast_object_list(holder, src=0)
    flatshard.save_checkpoint(holder[0], model, optim)
    torch.manual_seed(1)
    fresh: Any = build("gpt").to(device)
    flatshard.fully_shard(fresh, auto_wrap_policy=set(fresh.UNIT_CLASSES))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    flatshard.load_checkpoint(holder[0], fresh, fresh_optim)
    a, b = flatshard.full_state_dict(model), flatshard.full_state_dict(fresh)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


# ---------------------------------------------------------------- stage 3: sync audit
@contextlib.contextmanager
def _count_syncs(counts: Counter[str]) -> Iterator[None]:
    """Count host reads of device values made by flatshard's code (not torch's, not ours)."""
    points: list[tuple[Any, str]] = [
        (torch.Tensor, "item"),
        (torch.Tensor, "__bool__"),
        (torch.Tensor, "tolist"),
        (torch.accelerator, "synchronize"),
        (torch, "Event"),
    ]
    if torch.cuda.is_available():
        points.append((torch.cuda, "synchronize"))

    def counted(owner: Any, name: str) -> Any:
        real = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            code = sys._getframe(1).f_code
            if "/flatshard/" in code.co_filename and "/testing/" not in code.co_filename:
                counts[f"{getattr(owner, '__name__', owner)}.{name} in {code.co_name}"] += 1
            return real(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for owner, name in points:
            stack.enter_context(mock.patch.object(owner, name, counted(owner, name)))
        yield


def audit(report: _Report, device: torch.device) -> None:
    # A CPU rehearsal takes the accelerators' digest path (gloo compares at once otherwise).
    rehearsal = mock.patch.object(comm_agreement, "defers_digest", lambda d: True)
    with rehearsal if device.type == "cpu" else contextlib.nullcontext():
        for option in ("defaults", "clip", "offload"):
            report.case(f"host syncs per step, {option}", lambda o=option: _audit(o, device))


def _audit(option: str, device: torch.device) -> str:
    torch.manual_seed(0)
    model: Any = build("gpt").to(device)
    extra = {"cpu_offload": flatshard.CPUOffload()} if option == "offload" else {}
    flatshard.fully_shard(model, auto_wrap_policy=set(model.UNIT_CLASSES), **extra)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts: Counter[str] = Counter()
    steps = list(batches(model, 6, device.type))
    for index, batch in enumerate(steps):
        with _count_syncs(counts) if index >= 2 else contextlib.nullcontext():
            model.loss(slice_batch(batch, dist.get_rank(), 2)).backward()
            if option == "clip":
                flatshard.clip_grad_norm_(model, 1.0)
            optim.step()
            optim.zero_grad()
    per_step = {k: v / (len(steps) - 2) for k, v in counts.items()}
    allowed = 1 if option == "offload" else 0  # wait_host_copies: its event, once a step
    # settle reads the pinned host copy of the last step's digests behind a completed
    # event, and _gather_later records that event: neither waits for the device.
    exempt = ("in settle", "in _gather_later")
    host_reads = sum(v for k, v in per_step.items() if not k.endswith(exempt))
    assert host_reads <= allowed, per_step
    return f"{per_step or 'none'}"


CASES: dict[str, Callable[[_Report, torch.device], None]] = {
    "smoke": smoke,
    "parity": parity,
    "four": four,
    "audit": audit,
}


if __name__ == "__main__":
    sys.exit(main())
