"""Parity runs: one training loop for a non-sharded reference, flatshard and FSDP2.

Every rank builds the same model from the same seed. The reference trains on the whole
global batch in one process; sharded runs give each rank its own slice of that batch and
average gradients, so per-step losses and final parameters must agree to float tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatshard
from flatshard.testing.models import Batch, build
from flatshard.testing.workers import WorkerContext

GLOBAL_BATCH = 6  # divisible by world sizes 1, 2 and 3


@dataclass(frozen=True)
class ParityConfig:
    """One parity scenario."""

    model: str  # a name in flatshard.testing.models.MODELS
    world_size: int
    policy: str = "classes"  # classes | callable | size | none | bottom_up
    steps: int = 5
    micro_batches: int = 1  # backward passes per step, grads accumulated (no zeroing)
    forwards_per_backward: int = 1  # forwards whose losses are summed before one backward
    checkpoint: str = ""  # "" | "inside" (a unit's forward body) | "around" (the unit call)
    lr: float = 1e-3
    optimizer: str = "adamw"  # adamw | sgd (SGD exposes gradient-scale errors Adam hides)

    def __post_init__(self) -> None:
        if self.checkpoint not in ("", "inside", "around"):
            raise ValueError(
                f"checkpoint must be '', 'inside' or 'around', got {self.checkpoint!r}"
            )
        if GLOBAL_BATCH % (self.world_size * self.micro_batches * self.forwards_per_backward):
            raise ValueError(f"{self} does not split the global batch of {GLOBAL_BATCH}")


@dataclass
class RunResult:
    """Global (rank-averaged) loss per step and the final full parameters by name."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def make_optimizer(model: nn.Module, lr: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """Weight decay by name and ndim, as training scripts usually do; AdamW or SGD."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        wants_decay = param.dim() >= 2 and "norm" not in name and "ln" not in name
        (decay if wants_decay else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr * 100, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def batches(model: nn.Module, steps: int) -> Iterator[Batch]:
    """The global batch of each step; identical on every rank."""
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        yield cast(Any, model).make_batch(gen, GLOBAL_BATCH)


def slice_batch(batch: Batch, index: int, parts: int) -> Batch:
    size = batch[0].shape[0] // parts
    return (
        batch[0][index * size : (index + 1) * size],
        batch[1][index * size : (index + 1) * size],
    )


def train(
    model: nn.Module,
    config: ParityConfig,
    shard_index: int,
    shard_count: int,
    group: dist.ProcessGroup | None,
) -> list[float]:
    """Train ``config.steps`` steps on this rank's slice; returns the global loss per step."""
    optim = make_optimizer(model, config.lr, config.optimizer)
    loss_fn = cast(Callable[[Batch], torch.Tensor], cast(Any, model).loss)
    losses = []
    for global_batch in batches(model, config.steps):
        local = slice_batch(global_batch, shard_index, shard_count)
        step_loss = torch.zeros(())
        for micro in range(config.micro_batches):
            part = slice_batch(local, micro, config.micro_batches)
            chunks = [
                slice_batch(part, f, config.forwards_per_backward)
                for f in range(config.forwards_per_backward)
            ]
            loss = sum(loss_fn(chunk) for chunk in chunks) / (
                config.forwards_per_backward * config.micro_batches
            )
            torch.autograd.backward(cast(torch.Tensor, loss))
            step_loss += cast(torch.Tensor, loss).detach()
        optim.step()
        optim.zero_grad()
        if group is not None and shard_count > 1:
            dist.all_reduce(step_loss, group=group)
        losses.append(step_loss.item() / shard_count)
    return losses


def build_model(config: ParityConfig) -> nn.Module:
    """The scenario's model with its activation checkpointing applied."""
    model = build(config.model)
    if config.checkpoint == "inside":
        checkpoint_unit_bodies(model)
    elif config.checkpoint == "around":
        if not hasattr(model, "checkpoint_blocks"):
            raise ValueError(f"model {config.model!r} cannot checkpoint around its units")
        setattr(model, "checkpoint_blocks", True)  # noqa: B010 - the attribute is Tensor | Module to mypy
    return model


def checkpoint_unit_bodies(model: nn.Module) -> None:
    """Recompute each unit-class module's forward in backward (non-reentrant).

    The unit's hooks stay outside the checkpointed region, so recomputation reads the
    parameters the module holds at backward time.
    """
    classes = tuple(cast(Any, model).UNIT_CLASSES)
    for module in model.modules():
        if isinstance(module, classes):
            inner = module.forward
            setattr(module, "forward", partial(checkpoint, inner, use_reentrant=False))  # noqa: B010


def shard_with_flatshard(model: nn.Module, config: ParityConfig, group: dist.ProcessGroup) -> None:
    classes = set(cast(Any, model).UNIT_CLASSES)
    if config.policy == "classes":
        flatshard.fully_shard(model, auto_wrap_policy=classes, process_group=group)
    elif config.policy == "callable":
        flatshard.fully_shard(
            model, auto_wrap_policy=lambda m, name: type(m) in classes, process_group=group
        )
    elif config.policy == "size":
        flatshard.fully_shard(
            model, auto_wrap_policy=flatshard.SizePolicy(min_params=200), process_group=group
        )
    elif config.policy == "none":
        flatshard.fully_shard(model, process_group=group)
    elif config.policy == "bottom_up":
        units = [m for m in model.modules() if type(m) in classes]
        for module in reversed(units):  # innermost first
            flatshard.fully_shard(module, process_group=group)
        flatshard.fully_shard(model, process_group=group)
    else:
        raise ValueError(f"unknown policy {config.policy!r}")


def shard_with_fsdp2(model: nn.Module, group: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    classes = tuple(cast(Any, model).UNIT_CLASSES)
    for module in reversed(list(model.modules())):  # innermost first
        if isinstance(module, classes):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_reference(config: ParityConfig) -> RunResult:
    """The non-sharded model trained on the whole global batch in this process."""
    model = build_model(config)
    # One process sees the whole batch: micro-batching must match the ranks' split.
    single = replace(config, world_size=1)
    losses = train(model, single, 0, 1, None)
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def run_flatshard(config: ParityConfig, group: dist.ProcessGroup) -> RunResult:
    model = build_model(config)
    shard_with_flatshard(model, config, group)
    rank = dist.get_rank(group)
    losses = train(model, config, rank, config.world_size, group)
    with flatshard.summon_full_params(model, writeback=False):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return RunResult(losses, params)


def run_fsdp2(config: ParityConfig, group: dist.ProcessGroup) -> list[float]:
    model = build_model(config)
    shard_with_fsdp2(model, group)
    return train(model, config, dist.get_rank(group), config.world_size, group)


def assert_same(expected: RunResult, actual: RunResult, rtol: float = 1e-5) -> None:
    """Losses and parameters match the reference (fp32 tolerances)."""
    torch.testing.assert_close(
        torch.tensor(actual.losses), torch.tensor(expected.losses), rtol=rtol, atol=1e-6
    )
    assert list(actual.params) == list(expected.params), "parameter names differ"
    for name, value in expected.params.items():
        try:
            torch.testing.assert_close(actual.params[name], value, rtol=rtol, atol=1e-6)
        except AssertionError as error:
            raise AssertionError(f"parameter '{name}': {error}") from None


def parity_job(ctx: WorkerContext, config: ParityConfig, against_fsdp2: bool) -> RunResult | None:
    """Pool job: flatshard (and FSDP2) on the ranks of ``config.world_size``; rank 0 checks.

    All collectives finish before rank 0 compares, so a mismatch fails the job on rank 0
    without leaving the other ranks waiting.
    """
    group = ctx.group(config.world_size)
    if group is None:
        return None
    ours = run_flatshard(config, group)
    fsdp2_losses = run_fsdp2(config, group) if against_fsdp2 else None
    if ctx.rank == 0:
        assert_same(run_reference(config), ours)
        if fsdp2_losses is not None:
            torch.testing.assert_close(
                torch.tensor(ours.losses), torch.tensor(fsdp2_losses), rtol=1e-5, atol=1e-6
            )
    return ours
