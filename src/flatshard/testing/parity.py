"""Parity runs: one training loop for a non-sharded reference, flatshard and FSDP2.

Every rank builds the same model from the same seed. The reference trains on the whole
global batch in one process; sharded runs give each rank its own slice of that batch and
average gradients, so per-step losses and final parameters must agree to float tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatshard
from flatshard import comm_hooks
from flatshard.sharding._keep_gathered import shard_keeping_last
from flatshard.testing.models import Batch, build
from flatshard.testing.workers import WorkerContext

GLOBAL_BATCH = 24  # divisible by world sizes 1 to 4 times micro-batches


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
    strategy: str = "FULL_SHARD"  # a flatshard.ShardingStrategy name, for every unit
    sharding_factor: int | None = None  # F for the hybrid strategies
    hybrid_from: str = "factor"  # factor | groups | mesh: how the hybrid F is given
    root_strategy: str | None = None  # another strategy for the root (units sharded first)
    keep_gathered: int = 0  # the last N units in the strategy's ZeRO-2 form (flatshard train)
    no_sync: bool = False  # all micro-batches but the last under flatshard.no_sync
    # How no_sync is asked for: the context manager, or set_requires_gradient_sync ("switch",
    # which FSDP2 has too).
    accumulate_with: str = "no_sync"
    reshard_after_backward: bool = True  # False: set_reshard_after_backward(model, False)
    # set_reshard_after_forward(model, value) (FSDP2: the same method; an int N: FSDP2's
    # fully_shard(reshard_after_forward=N)); None: not called
    reshard_after_forward: bool | int | None = None
    # set_gradient_divide_factor (FSDP2: the same method on each module); None: W. The
    # reference scales its loss by W / factor, which the factor does to the gradients.
    gradient_divide_factor: float | None = None
    gradient_scale: float = 1.0  # (set by run_reference from the factor)
    # set_custom_all_gather / set_custom_reduce_scatter on every unit (FSDP2: the same
    # methods) with TorchAllGather / TorchReduceScatter: torch's collectives, counted
    custom_comms: bool = False
    # set_separate_reduce_scatter_group(model, True) (FSDP2: the same method)
    separate_reduce_scatter_group: bool = False
    # Parameters (names) flatshard leaves alone, Unmanaged() (FSDP2: ignored_params); the
    # runs average their gradients by hand before each step, as their users must
    unmanaged: tuple[str, ...] = ()
    # Units (module names) set_unshard_in_backward(module, False) (FSDP2: the same method)
    no_unshard_in_backward: tuple[str, ...] = ()
    # Hybrid: set_requires_all_reduce(False) for all micro-batches but the last (flatshard
    # and FSDP2 alike): reduce-scatters only, the replicas' all-reduce once per step.
    all_reduce_last: bool = False
    clip: float | None = None  # clip_grad_norm_ to this each step
    norm_type: float = 2.0
    # How flatshard's runs clip: flatshard.clip_grad_norm_, torch.nn.utils.clip_grad_norm_
    # ("torch"), torch's get_total_norm then clip_grads_with_norm_ ("torch-split", as
    # accelerate and the Hugging Face Trainer clip), or torch.nn.utils.clip_grad_value_
    # ("value", every run alike).
    clip_with: str = "flatshard"
    comm_hook: str | None = None  # None | "bf16" | "fp16"
    param_dtype: str | None = None  # mixed precision: "bfloat16" | "float16"
    output_dtype: str | None = None  # MixedPrecision / MixedPrecisionPolicy output_dtype
    reduce_dtype: str | None = None  # None: float32 when param_dtype is set
    offload: bool = False  # CPUOffload(params=True)
    backward_prefetch: str | None = "BACKWARD_PRE"  # a flatshard.BackwardPrefetch name
    forward_prefetch: bool = False
    limit_all_gathers: bool = True  # the rate limiter
    device: str = "cpu"  # where models and batches live ("cuda": tests/test_gpu.py)
    sparse_embeddings: bool = False  # fully_shard(placement=flatshard.RowSparse())
    # MixedPrecision(gather_dtype=...): "int8" | "float8_e4m3fn" | "bfloat16" | ...; the
    # reference computes with its weights quantized and dequantized the same way
    # (``quantized_weights``), from before the step's first forward to its last backward
    gather_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.accumulate_with not in ("no_sync", "switch"):
            raise ValueError(
                f"accumulate_with must be 'no_sync' or 'switch', got {self.accumulate_with!r}"
            )
        if self.clip_with not in ("flatshard", "torch", "torch-split", "value"):
            raise ValueError(
                "clip_with must be 'flatshard', 'torch', 'torch-split' or 'value', got "
                f"{self.clip_with!r}"
            )
        if self.checkpoint not in ("", "inside", "around"):
            raise ValueError(
                f"checkpoint must be '', 'inside' or 'around', got {self.checkpoint!r}"
            )
        if GLOBAL_BATCH % (self.world_size * self.micro_batches * self.forwards_per_backward):
            raise ValueError(f"{self} does not split the global batch of {GLOBAL_BATCH}")
        if self.unmanaged and self.sparse_embeddings:
            raise ValueError("unmanaged and sparse_embeddings are one placement rule each")
        for name in (self.strategy, self.root_strategy or self.strategy):
            flatshard.ShardingStrategy[name]  # an unknown name fails here


@dataclass
class RunResult:
    """Global (rank-averaged) loss per step and the final full parameters by name."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)  # clip_grad_norm_'s result per step


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
        # eps above fp32 rounding noise: an element whose gradient nearly cancels (sum of
        # large terms ~ 1e-9) would otherwise take a full-size step whose sign depends on
        # summation order, which differs between any two reductions.
        return torch.optim.AdamW(groups, lr=lr, eps=1e-5)
    raise ValueError(f"unknown optimizer {kind!r}")


def batches(model: nn.Module, steps: int, device: str = "cpu") -> Iterator[Batch]:
    """The global batch of each step; identical on every rank (made on the CPU)."""
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        inputs, targets = cast(Any, model).make_batch(gen, GLOBAL_BATCH)
        yield inputs.to(device), targets.to(device)


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
    kind: str,
) -> RunResult:
    """Train ``config.steps`` steps on this rank's slice; ``kind`` is reference, flatshard
    or fsdp2. Returns the global loss (and gradient norm, when clipping) per step."""
    optim = make_optimizer(model, config.lr, config.optimizer)
    if not config.reshard_after_backward and kind == "flatshard":
        flatshard.set_reshard_after_backward(model, False)
    if config.gradient_divide_factor is not None and kind == "flatshard":
        flatshard.set_gradient_divide_factor(model, config.gradient_divide_factor)
    if config.gradient_divide_factor is not None and kind == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):  # (gloo has no PREMUL_SUM: sums only)
                module.set_gradient_divide_factor(config.gradient_divide_factor)
                module.set_force_sum_reduction_for_comms(True)
    if config.reshard_after_forward is not None and kind == "flatshard":
        flatshard.set_reshard_after_forward(model, config.reshard_after_forward)
    if config.custom_comms and kind != "reference":
        install_custom_comms(model, kind)
    if config.separate_reduce_scatter_group and kind == "flatshard":
        flatshard.set_separate_reduce_scatter_group(model, True)
    if config.separate_reduce_scatter_group and kind == "fsdp2":
        cast(Any, model).set_separate_reduce_scatter_group(True)
    for name in config.no_unshard_in_backward if kind != "reference" else ():
        module = model.get_submodule(name)
        if kind == "flatshard":
            flatshard.set_unshard_in_backward(module, False)
        else:
            cast(Any, module).set_unshard_in_backward(False)
    if isinstance(config.reshard_after_forward, bool) and kind == "fsdp2":
        cast(Any, model).set_reshard_after_forward(config.reshard_after_forward)
    loss_fn = cast(Callable[[Batch], torch.Tensor], cast(Any, model).loss)
    result = RunResult()
    loop = _library_loop(config, kind)
    for global_batch in batches(model, config.steps, config.device):
        local = slice_batch(global_batch, shard_index, shard_count)
        step_loss = torch.zeros((), device=config.device)
        if loop is not None:  # flatshard's own step loop, checked against the reference
            loop(model, optim, local, step_loss, result)
            if group is not None and shard_count > 1:
                dist.all_reduce(step_loss, group=group)
            result.losses.append(step_loss.item() / shard_count)
            continue
        for micro in range(config.micro_batches):
            part = slice_batch(local, micro, config.micro_batches)
            chunks = [
                slice_batch(part, f, config.forwards_per_backward)
                for f in range(config.forwards_per_backward)
            ]
            keep_local = config.no_sync and micro < config.micro_batches - 1
            if not config.reshard_after_backward and kind == "fsdp2":
                # FSDP2 never gathers a unit kept across optimizer.step() again: its docs
                # keep units gathered for all micro-batches but the last.
                last = micro == config.micro_batches - 1
                cast(Any, model).set_reshard_after_backward(last)
            if config.all_reduce_last and kind != "reference":
                last = micro == config.micro_batches - 1
                if kind == "flatshard":
                    flatshard.set_requires_all_reduce(model, last)
                else:
                    cast(Any, model).set_requires_all_reduce(last)
            quantized = quantized_weights(model, config) if kind == "reference" else nullcontext()
            with _accumulation(model, kind, keep_local, config.accumulate_with), quantized:
                loss = sum(loss_fn(chunk) for chunk in chunks) / (
                    config.forwards_per_backward * config.micro_batches
                )
                torch.autograd.backward(cast(torch.Tensor, loss) * config.gradient_scale)
            step_loss += cast(torch.Tensor, loss).detach()
        if config.unmanaged and group is not None and kind != "reference":
            _average_by_hand(model, config.unmanaged, group)
        if config.clip is not None:
            result.norms.append(_clip(model, kind, config))
        optim.step()
        optim.zero_grad()
        if group is not None and shard_count > 1:
            dist.all_reduce(step_loss, group=group)
        result.losses.append(step_loss.item() / shard_count)
    return result


class TorchAllGather:
    """A user's all-gather in FSDP2's form (``AllGather``): torch's, counting its calls."""

    def __init__(self, blocking: bool = False) -> None:
        self.calls = 0
        self.groups: set[str] = set()  # the names of the groups it was called on
        self.blocking = blocking  # done on return, returning None (async_op ignored)

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        self.groups.add(group.group_name)
        work: dist.Work | None = dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op and not self.blocking
        )
        return work


class TorchReduceScatter(TorchAllGather):
    """A user's reduce-scatter in FSDP2's form (``ReduceScatter``): torch's
    ``reduce_scatter_tensor`` (gloo's: an all-reduce and a copy), counting its calls."""

    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        self.groups.add(group.group_name)
        work: dist.Work | None = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op and not self.blocking
        )
        return work


def install_custom_comms(
    model: nn.Module, kind: str, blocking: bool = False
) -> tuple[TorchAllGather, TorchReduceScatter]:
    """One counting all-gather and reduce-scatter on every unit of ``model`` (flatshard's
    units, or FSDP2's modules); ``blocking``: each done on return, returning None."""
    gather, scatter = TorchAllGather(blocking), TorchReduceScatter(blocking)
    if kind == "flatshard":
        for _, module in flatshard.unit_modules(model):
            flatshard.set_custom_all_gather(module, gather)
            flatshard.set_custom_reduce_scatter(module, scatter)
        return gather, scatter
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(cast(Any, gather))
            module.set_custom_reduce_scatter(cast(Any, scatter))
    return gather, scatter


def _average_by_hand(model: nn.Module, names: tuple[str, ...], group: dist.ProcessGroup) -> None:
    """What a user of Unmanaged() (FSDP2's ignored_params) does before the step if the
    ranks are to agree: average those gradients across the ranks."""
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            dist.all_reduce(grad, group=group)
            grad.div_(dist.get_world_size(group))


StepLoop = Callable[[nn.Module, torch.optim.Optimizer, Batch, torch.Tensor, RunResult], None]


def _library_loop(config: ParityConfig, kind: str) -> StepLoop | None:
    """``flatshard.train_step`` for the flatshard runs it can express (its switches, its
    clip), so that the loop ``flatshard train`` and the planner run is itself held to the
    reference; None where a run asks for another way (the gradient-sync switch, torch's
    clip, a replica all-reduce per micro-batch, units kept gathered)."""
    if kind != "flatshard" or config.accumulate_with != "no_sync" or config.unmanaged:
        return None
    if config.clip is not None and (config.clip_with != "flatshard" or config.norm_type != 2.0):
        return None
    if not config.reshard_after_backward or (
        config.micro_batches > 1 and config.no_sync == config.all_reduce_last
    ):  # (no_sync meeting the replicas' switch stays on the harness's own loop)
        return None
    accumulation = "no_sync" if config.no_sync else "reduce"

    def loop(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        local: Batch,
        total: torch.Tensor,
        result: RunResult,
    ) -> None:
        loss_fn = cast(Callable[[Batch], torch.Tensor], cast(Any, model).loss)

        def micro_loss(micro: int) -> torch.Tensor:
            part = slice_batch(local, micro, config.micro_batches)
            chunks = [
                slice_batch(part, f, config.forwards_per_backward)
                for f in range(config.forwards_per_backward)
            ]
            return (
                cast(torch.Tensor, sum(loss_fn(c) for c in chunks)) / config.forwards_per_backward
            )

        norm = flatshard.train_step(
            model,
            [optim],
            micro_loss,
            config.micro_batches,
            accumulation=accumulation,
            clip=config.clip,
            observer=_Summed(total),
        )
        if norm is not None:
            result.norms.append(norm.item())

    return loop


class _Summed(flatshard.StepObserver):
    def __init__(self, total: torch.Tensor) -> None:
        self.total = total

    def backward_done(self, loss: torch.Tensor) -> None:
        self.total += loss.detach()


def _accumulation(
    model: nn.Module, kind: str, keep_local: bool, accumulate_with: str
) -> AbstractContextManager[Any]:
    """The context a micro-batch's backward runs in: no_sync where asked (flatshard), or
    the gradient-sync switch set for it (flatshard and FSDP2)."""
    if accumulate_with == "switch" and kind == "flatshard":
        flatshard.set_requires_gradient_sync(model, not keep_local)
        return nullcontext()
    if accumulate_with == "switch" and kind == "fsdp2":
        cast(Any, model).set_requires_gradient_sync(not keep_local)
        return nullcontext()
    if keep_local and kind == "flatshard":
        return flatshard.no_sync(model)
    if keep_local and kind == "fsdp2":
        raise ValueError("the FSDP2 runs do not model no_sync")
    return nullcontext()


def _clip(model: nn.Module, kind: str, config: ParityConfig) -> float:
    max_norm, norm_type = cast(float, config.clip), config.norm_type
    if config.clip_with == "value":
        torch.nn.utils.clip_grad_value_(model.parameters(), max_norm)
        return 0.0
    if kind == "flatshard" and config.clip_with == "flatshard":
        return flatshard.clip_grad_norm_(model, max_norm, norm_type).item()
    if kind == "flatshard" and config.clip_with == "torch-split":
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm  # at the call: ours

        params = [p for p in model.parameters() if p.grad is not None]
        total = get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
        clip_grads_with_norm_(params, max_norm, total)
        return float(total)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def build_model(config: ParityConfig) -> nn.Module:
    """The scenario's model with its activation checkpointing applied."""
    model = build(config.model).to(config.device)
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
    strategy = flatshard.ShardingStrategy[config.strategy]
    options: dict[str, Any] = {"process_group": group, "strategy": strategy}
    param_dtype, reduce_dtype = _dtypes(config)
    gather = getattr(torch, config.gather_dtype) if config.gather_dtype else None
    if param_dtype is not None or gather is not None:
        output = getattr(torch, config.output_dtype) if config.output_dtype else None
        options["mixed_precision"] = flatshard.MixedPrecision(
            param_dtype, reduce_dtype, output_dtype=output, gather_dtype=gather
        )
    if config.offload:
        options["cpu_offload"] = flatshard.CPUOffload()
    if config.sparse_embeddings:
        options["placement"] = flatshard.RowSparse()
    if config.unmanaged:
        left = {id(model.get_parameter(name)) for name in config.unmanaged}
        options["placement"] = lambda name, p: flatshard.Unmanaged() if id(p) in left else None
    backward = config.backward_prefetch
    options["prefetch"] = flatshard.Prefetch(
        backward=None if backward is None else flatshard.BackwardPrefetch[backward],
        forward=config.forward_prefetch,
        limit_all_gathers=config.limit_all_gathers,
    )
    if strategy.is_hybrid:
        options.update(_hybrid_options(config, group))
    policies: dict[str, Any] = {
        "classes": classes,
        "callable": lambda m, name: type(m) in classes,
        "size": flatshard.SizePolicy(min_params=200),
        "sublayers": flatshard.SublayerPolicy(classes),
        "none": None,
    }
    if config.policy == "bottom_up" or config.root_strategy is not None:
        units = [m for m in model.modules() if type(m) in classes]
        for module in reversed(units):  # innermost first
            flatshard.fully_shard(module, **options)
        root = flatshard.ShardingStrategy[config.root_strategy or config.strategy]
        root_options = {**options, "strategy": root}
        if not root.is_hybrid:
            root_options.pop("sharding_factor", None)
            root_options["process_group"] = group  # not a 2-D mesh
        flatshard.fully_shard(model, **root_options)
    elif config.policy in policies:
        policy = policies[config.policy]
        shard_keeping_last(model, config.keep_gathered, auto_wrap_policy=policy, **options)
    else:
        raise ValueError(f"unknown policy {config.policy!r}")
    if config.comm_hook is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[config.comm_hook]
        comm_hooks.register_comm_hook(model, comm_hooks.LowPrecisionHook(dtype))


def _dtypes(config: ParityConfig) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of the scenario; reduction in fp32 unless told."""
    if config.param_dtype is None:
        return None, None
    reduce = getattr(torch, config.reduce_dtype or "float32")
    return getattr(torch, config.param_dtype), reduce


def _hybrid_options(config: ParityConfig, group: dist.ProcessGroup) -> dict[str, Any]:
    """The hybrid factor as the config asks: a number, or a 2-D (replicate, shard) mesh
    made by torch (``mesh``) or from (replicate, shard) groups made here (``groups``)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if config.hybrid_from == "factor":
        return {"sharding_factor": config.sharding_factor}
    factor = config.sharding_factor or config.world_size
    if config.world_size != dist.get_world_size():
        raise ValueError("explicit hybrid groups need the whole world")
    if config.hybrid_from == "mesh":
        mesh = init_device_mesh("cpu", (config.world_size // factor, factor))
        return {"process_group": mesh}
    me, world = dist.get_rank(), config.world_size
    shard = replicate = None
    for start in range(0, world, factor):  # every rank creates every group, same order
        made = dist.new_group(list(range(start, start + factor)))
        shard = made if start <= me < start + factor else shard
    for offset in range(factor):
        made = dist.new_group(list(range(offset, world, factor)))
        replicate = made if me % factor == offset else replicate
    if shard is None or replicate is None:
        raise ValueError(f"rank {me} is in no hybrid group of {config}")
    grid = torch.arange(world).view(world // factor, factor)
    mesh = DeviceMesh.from_group(
        [replicate, shard], "cpu", mesh=grid, mesh_dim_names=("replicate", "shard")
    )
    return {"process_group": mesh}


def shard_with_fsdp2(model: nn.Module, config: ParityConfig, group: dist.ProcessGroup) -> None:
    """FSDP2 with the matching options: FULL_SHARD / SHARD_GRAD_OP only."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if config.strategy not in ("FULL_SHARD", "SHARD_GRAD_OP") or config.root_strategy:
        raise ValueError(f"no FSDP2 counterpart for {config}")

    reshard: bool | int = config.strategy == "FULL_SHARD"
    if not isinstance(config.reshard_after_forward, bool | None):  # an int: at fully_shard
        reshard = config.reshard_after_forward
    mesh = DeviceMesh.from_group(group, torch.device(config.device).type)
    param_dtype, reduce_dtype = _dtypes(config)
    output = getattr(torch, config.output_dtype) if config.output_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root_policy = MixedPrecisionPolicy(  # output_dtype: the model's outputs, as flatshard
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output
    )
    classes = tuple(cast(Any, model).UNIT_CLASSES)
    units = [m for m in reversed(list(model.modules())) if isinstance(m, classes)]
    ignored = {model.get_parameter(name) for name in config.unmanaged} or None
    for module in units:  # innermost first
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            ignored_params=ignored,
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=reshard,
        mp_policy=root_policy,
        ignored_params=ignored,
    )


def run_reference(config: ParityConfig) -> RunResult:
    """The non-sharded model trained on the whole global batch in this process."""
    model = build_model(config)
    # One process sees the whole batch: micro-batching must match the ranks' split.
    factor = config.gradient_divide_factor
    scale = 1.0 if factor is None else config.world_size / factor
    result = train(
        model, replace(config, world_size=1, gradient_scale=scale), 0, 1, None, "reference"
    )
    result.params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return result


def run_mixed_reference(config: ParityConfig) -> RunResult:
    """What mixed precision promises, in one process: fp32 master parameters, a compute
    copy cast to ``param_dtype`` once per step, gradients cast to ``reduce_dtype`` and back
    to fp32 for the optimizer."""
    param_dtype, reduce_dtype = _dtypes(config)
    assert param_dtype is not None and reduce_dtype is not None
    master = build_model(config)
    compute = copy.deepcopy(master).to(param_dtype)
    optim = make_optimizer(master, config.lr, config.optimizer)
    loss_fn = cast(Callable[[Batch], torch.Tensor], cast(Any, compute).loss)
    result = RunResult()
    pairs = list(zip(compute.parameters(), master.parameters(), strict=True))
    skip = _ungathered(master, config)
    for batch in batches(master, config.steps, config.device):
        with torch.no_grad():
            for low, full in pairs:
                low.copy_(full if id(full) in skip else _quantized(full, config))
        loss = loss_fn(batch)
        torch.autograd.backward(loss)
        for low, full in pairs:
            if low.grad is not None:
                full.grad = low.grad.to(reduce_dtype).to(full.dtype)
                low.grad = None
        optim.step()
        optim.zero_grad()
        result.losses.append(loss.item())
    result.params = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    return result


def _ungathered(model: nn.Module, config: ParityConfig) -> set[int]:
    """Ids of the parameters flatshard never gathers in this scenario's gather dtype: those
    left alone, the row-sparse tables, and under a one-byte gather dtype the embedding
    tables (a tied table is the head's weight too)."""
    ids = {id(model.get_parameter(name)) for name in config.unmanaged}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if config.sparse_embeddings:
        ids |= tables
    if config.gather_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
        ids |= tables  # gathered in the compute dtype ([Note: embedding tables gathered exact])
    return ids


def _quantized(weight: torch.Tensor, config: ParityConfig) -> torch.Tensor:
    if config.gather_dtype is None:
        return weight
    return quantized_by_formula(weight, getattr(torch, config.gather_dtype))


def quantized_by_formula(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as a gather in ``dtype`` delivers it, computed here on its own from the
    formula of [Note: row-wise quantized all-gather] (not by flatshard's codec): a scale
    per row of a matrix (NaN for a row holding a non-finite value), a cast of everything
    for a float dtype."""
    if dtype.is_floating_point and dtype.itemsize > 1:
        return weight.to(dtype).to(weight.dtype)
    if weight.dim() < 2:
        return weight
    limit = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    rows = weight.detach().reshape(weight.shape[0], -1).float()
    scale = rows.abs().amax(dim=1) / limit
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    q = rows / scale[:, None]
    if dtype == torch.int8:
        q = q.round()
    sent = q.clamp(-limit, limit).to(dtype)
    return (sent.float() * scale[:, None]).to(weight.dtype).reshape(weight.shape)


@contextmanager
def quantized_weights(model: nn.Module, config: ParityConfig) -> Iterator[None]:
    """The reference's weights quantized and dequantized as ``config.gather_dtype``
    gathers them, while inside (forward and backward: autograd reads the weights it saved);
    the master weights again after, for the optimizer (straight-through gradients)."""
    if config.gather_dtype is None:
        yield
        return
    skip = _ungathered(model, config)
    masters = [(p, p.data) for p in model.parameters()]
    for param in model.parameters():
        if id(param) not in skip:
            param.data = _quantized(param.data, config)
    try:
        yield
    finally:
        for param, data in masters:
            param.data = data


def run_on_time_and_late(config: ParityConfig, group: dist.ProcessGroup) -> RunResult:
    """flatshard twice: as is, and with every collective late (``testing.delays``).

    Asserts that both give bitwise the same losses and parameters (reading a buffer before
    its collective is waited for would read stale data in the late run); returns the late.
    """
    from flatshard.testing.delays import delayed_collectives

    on_time = run_flatshard(config, group)
    with delayed_collectives(0.002):
        late = run_flatshard(config, group)
    assert late.losses == on_time.losses, (late.losses, on_time.losses)
    for name, value in on_time.params.items():
        assert torch.equal(late.params[name], value), name
    return late


def run_flatshard(config: ParityConfig, group: dist.ProcessGroup) -> RunResult:
    model = build_model(config)
    shard_with_flatshard(model, config, group)
    result = train(model, config, dist.get_rank(group), config.world_size, group, "flatshard")
    with flatshard.summon_full_params(model, writeback=False):
        result.params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return result


def run_fsdp2(config: ParityConfig, group: dist.ProcessGroup) -> RunResult:
    model = build_model(config)
    shard_with_fsdp2(model, config, group)
    return train(model, config, dist.get_rank(group), config.world_size, group, "fsdp2")


def assert_same(expected: RunResult, actual: RunResult, rtol: float = 1e-5) -> None:
    """Losses, gradient norms and parameters match the reference."""
    atol = rtol / 10
    torch.testing.assert_close(
        torch.tensor(actual.losses), torch.tensor(expected.losses), rtol=rtol, atol=atol
    )
    torch.testing.assert_close(
        torch.tensor(actual.norms), torch.tensor(expected.norms), rtol=rtol, atol=atol
    )
    assert list(actual.params) == list(expected.params), "parameter names differ"
    for name, value in expected.params.items():
        try:
            torch.testing.assert_close(actual.params[name], value, rtol=rtol, atol=atol)
        except AssertionError as error:
            raise AssertionError(f"parameter '{name}': {error}") from None


def parity_job(ctx: WorkerContext, config: ParityConfig, against_fsdp2: bool) -> RunResult | None:
    """Pool job: flatshard (and FSDP2) on the ranks of ``config.world_size``; rank 0 checks.

    All collectives finish before rank 0 compares, so a mismatch fails the job on rank 0
    without leaving the other ranks waiting. Low-precision communication hooks are checked
    at bf16/fp16 tolerances.
    """
    group = ctx.group(config.world_size)
    if group is None:
        return None
    ours = run_flatshard(config, group)
    fsdp2 = run_fsdp2(config, group) if against_fsdp2 else None
    if ctx.rank == 0:
        assert_same(run_reference(config), ours, rtol=1e-5 if config.comm_hook is None else 2e-2)
        if fsdp2 is not None:
            assert_same(fsdp2, replace(ours, params=fsdp2.params))
    return ours
