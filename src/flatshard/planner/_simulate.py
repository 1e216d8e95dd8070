"""Run one rank's training steps on the meta device in a simulated world (see _recorder.py).

Two steps run, as ``flatshard train`` runs them: micro-batches (all but the last under
``no_sync`` when accumulating), loss, backward, ``clip_grad_norm_``, the optimizer's step
and ``zero_grad``. The first makes the gradients and optimizer state; the peak and the ops
of the second are the steady state, which is what ``flatshard bench`` and the tests
measure.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flatshard.comm._collectives import simulating
from flatshard.comm._mesh import ShardingStrategy
from flatshard.flat._mixed_precision import CPUOffload, MixedPrecision
from flatshard.flat._partition import AutoWrapPolicy, SublayerPolicy
from flatshard.flat._placement import ShardPlacement, placement_rule
from flatshard.measure import PeakStorage
from flatshard.planner import _recorder as tags
from flatshard.planner._attention import fused_attention
from flatshard.planner._pipeline import Pipeline
from flatshard.planner._recorder import Recorder
from flatshard.runtime._optimizer_steps import muon_matrices
from flatshard.runtime._prefetch import Prefetch
from flatshard.runtime._step_loop import StepObserver, train_step
from flatshard.runtime._summary import sharding_summary
from flatshard.runtime._switches import (
    set_reshard_after_forward,
    set_separate_reduce_scatter_group,
    set_unshard_in_backward,
)
from flatshard.sharding._keep_gathered import shard_keeping_last

Inputs = Callable[[], tuple[torch.Tensor, ...]]
"""Makes one micro-batch of one rank (called under the meta device)."""
Loss = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
"""(model, micro-batch) -> the scalar loss of its forward."""

OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd")


@dataclass(frozen=True)
class Setup:
    """How the model is sharded and trained: ``fully_shard``'s and the step's options."""

    world_size: int = 1
    auto_wrap_policy: AutoWrapPolicy = None
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    sharding_factor: int | None = None
    param_dtype: torch.dtype | None = None  # mixed precision: compute and all-gather dtype
    gather_dtype: torch.dtype | None = None  # MixedPrecision(gather_dtype=...)
    prefetch: Prefetch | None = None
    grad_accum: int = 1
    # Micro-batches but the last: "no_sync" (no reduction, unsharded gradients kept) or
    # "reduce" (a reduction each; hybrid: the reduce-scatter alone, set_requires_all_reduce).
    accumulation: str = "no_sync"
    optimizer: str = "adamw"
    clip: bool = True
    backend: str = "nccl"  # whose reduce-scatter form: "nccl" or "gloo"
    # The optimizer's multi-tensor form (torch's default on accelerators, not on CPU):
    # it allocates temporaries the size of all its tensors at once.
    foreach: bool = False
    # The last N units keep their parameters gathered from forward to backward (the
    # strategy's ZeRO-2 form): no all-gather when backward reaches them, more memory.
    kept_gathered: int = 0
    # CPUOffload: shards, gradients and the optimizer (its state and its step) on the host.
    cpu_offload: bool = False
    # Tensor parallel degree T: the world is a (W / T, T) mesh ("dp", "tp"), the model is
    # built by ``build(mesh["tp"])`` and sharded over "dp".
    tensor_parallel: int = 1
    # fully_shard's placement for every parameter it serves (RowSparse(): lookups and
    # their gradients priced for distinct token ids, [Note: row-sparse tables in a plan]).
    placement: ShardPlacement | None = None
    # set_reshard_after_forward(model, value) after sharding (an int N: backward gathers
    # inside groups of N ranks); None: as the strategy says.
    reshard_after_forward: bool | int | None = None
    # set_separate_reduce_scatter_group(model, True): reductions on a group of their own.
    separate_reduce_scatter_group: bool = False
    # Units (module names) set_unshard_in_backward(unit, False): backward gathers them not.
    no_unshard_in_backward: tuple[str, ...] = ()
    # Pipeline stages: the world as (P, W / P), each stage sharded over its W / P ranks
    # and run by a schedule (planned stage by stage: [Note: planning pipeline stages]).
    pipeline: Pipeline | None = None


@dataclass
class Simulated:
    """What the recorder saw in the steady-state step."""

    recorder: Recorder
    params: int  # parameters of the whole model
    trainable: int
    units: int
    host: frozenset[int] = frozenset()  # serials of the storages on the host (CPU offload)


def simulate(
    build: Callable[..., nn.Module],
    inputs: Inputs,
    loss: Loss,
    setup: Setup,
    ranks_per_host: int = 1,
) -> Simulated:
    """Rank 0's steady-state step of ``setup`` (see the module docstring)."""
    assert setup.pipeline is None, "a pipeline is planned stage by stage (_plan.py)"
    device = "cpu" if setup.backend == "gloo" else "cuda"
    for read_every_op in (False, True):  # [Note: a running total of live bytes]
        with (
            _fake_world(setup.world_size, setup.backend),
            fused_attention(device),
            Recorder(read_every_op) as recorder,
        ):
            simulated = _simulate(build, inputs, loss, setup, ranks_per_host, recorder)
        if not recorder.drifted:
            break
    return simulated


def _simulate(
    build: Callable[..., nn.Module],
    inputs: Inputs,
    loss: Loss,
    setup: Setup,
    ranks_per_host: int,
    recorder: Recorder,
) -> Simulated:
    recorder.ranks_per_host = ranks_per_host
    mesh = _mesh(setup)
    with torch.device("meta"):
        model = _built(build, mesh)
    params = sum(p.numel() for p in model.parameters())  # a DTensor's: its global shape's
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # [Note: simulated offload]
    # With CPUOffload the shards live on the CPU. A simulation keeps them on the meta device
    # (the host of a model on meta, ``host_of``: real CPU tensors would allocate the model),
    # and the runtime copies between host and device whenever it offloads, whatever the
    # devices (``GroupSpec.offload``): so the recorder sees every copy a GPU run makes (the
    # shard before its all-gather, the reduced gradient after its reduction). Which
    # storages are the host's is known afterwards (``_offloaded``), and the recorder splits
    # the step's bytes into the two memories.
    model = shard(model, setup, device="meta", param_init_fn=_shapes_only, **_dp(mesh))
    optim = make_optimizer(model, setup)
    for step in range(2):
        if step == 1:
            recorder.start_recording()
        training_step(model, optim, inputs, loss, setup, torch.device("meta"), recorder)
    recorder.settle()
    summary = sharding_summary(model)
    units = len({f.unit for f in summary.flat_params})
    host = _offloaded(model, recorder) if setup.cpu_offload else frozenset()
    return Simulated(recorder, params, trainable, units, host)


def _offloaded(model: nn.Module, recorder: Recorder) -> frozenset[int]:
    """The storages CPUOffload keeps on the host: the shards, the gradients (the copies
    the reduction makes) and the optimizer's state and temporaries."""
    shards = [p.untyped_storage() for p in model.parameters()]
    host = {serial for serial in map(recorder.serial, shards) if serial is not None}
    on_host = (tags.GRADIENTS, tags.OPTIMIZER, tags.OPTIMIZER_TEMPORARIES)
    host |= {serial for serial, tag in recorder.tags.items() if tag in on_host}
    return frozenset(host)


def measure(
    build: Callable[..., nn.Module],
    inputs: Inputs,
    loss: Loss,
    setup: Setup,
    group: dist.ProcessGroup,
) -> int:
    """The same steps run for real on ``group`` (CPU): this rank's steady-state peak of
    live tensor storage, tracked at the dispatcher (what the plan predicts)."""
    mesh = _mesh(setup)
    with PeakStorage() as tracker:
        model = shard(_built(build, mesh), setup, **(_dp(mesh) or {"process_group": group}))
        optim = make_optimizer(model, setup)
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            training_step(model, optim, inputs, loss, setup, torch.device("cpu"))
    peak: int = tracker.peak
    return peak


def measure_step_seconds(
    build: Callable[..., nn.Module],
    inputs: Inputs,
    loss: Loss,
    setup: Setup,
    group: dist.ProcessGroup,
    steps: int = 5,
) -> float:
    """The same steps run for real on ``group`` (CPU): the median seconds of ``steps``
    steps after two warm-up steps (what the plan's step time predicts)."""
    mesh = _mesh(setup)
    model = shard(_built(build, mesh), setup, **(_dp(mesh) or {"process_group": group}))
    optim = make_optimizer(model, setup)
    times = []
    for step in range(2 + steps):
        dist.barrier(group)
        start = time.perf_counter()
        training_step(model, optim, inputs, loss, setup, torch.device("cpu"))
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mesh(setup: Setup) -> DeviceMesh | None:
    """Tensor parallel: the world as a ("dp", "tp") mesh (None without)."""
    if setup.tensor_parallel == 1:
        return None
    shape = (setup.world_size // setup.tensor_parallel, setup.tensor_parallel)
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def _built(build: Callable[..., nn.Module], mesh: DeviceMesh | None) -> nn.Module:
    return build() if mesh is None else build(mesh["tp"])


def _dp(mesh: DeviceMesh | None) -> dict[str, Any]:
    """``fully_shard``'s group under tensor parallel: the mesh's "dp" dimension."""
    return {} if mesh is None else {"process_group": mesh["dp"]}


def _shapes_only(module: nn.Module) -> None:
    """The param_init_fn of a simulation: meta tensors have no values to initialize (an
    in-place op marks them as written)."""
    for tensor in [*module._parameters.values(), *module._buffers.values()]:
        if tensor is not None:
            with torch.no_grad():
                tensor.zero_()


def shard(model: nn.Module, setup: Setup, **extra: Any) -> nn.Module:
    """``fully_shard`` as ``setup`` says (see ``shard_keeping_last``); Muon's matrices whole."""
    options = shard_options(setup) | extra
    if setup.optimizer == "muon":
        matrices = muon_matrices(model, _blocks(setup.auto_wrap_policy))
        whole = lambda name, param: id(param) in matrices  # noqa: E731
        options["placement"] = placement_rule(model, whole, setup.placement)
    sharded = shard_keeping_last(model, setup.kept_gathered, **options)
    if setup.reshard_after_forward is not None:
        set_reshard_after_forward(sharded, setup.reshard_after_forward)
    if setup.separate_reduce_scatter_group:
        set_separate_reduce_scatter_group(sharded, True)
    for name in setup.no_unshard_in_backward:
        set_unshard_in_backward(sharded.get_submodule(name), False)
    return sharded


def _blocks(policy: AutoWrapPolicy) -> set[type[nn.Module]] | None:
    """The block classes of a unit policy given as classes (None for other policies)."""
    if isinstance(policy, SublayerPolicy):
        policy = policy.blocks
    if isinstance(policy, (set, frozenset)) and all(isinstance(c, type) for c in policy):
        return set(policy)
    return None


def shard_options(setup: Setup) -> dict[str, Any]:
    options: dict[str, Any] = {
        "auto_wrap_policy": setup.auto_wrap_policy,
        "strategy": setup.strategy,
        "prefetch": setup.prefetch,
        "placement": setup.placement,
    }
    if setup.sharding_factor:
        options["sharding_factor"] = setup.sharding_factor
    if setup.param_dtype is not None or setup.gather_dtype is not None:
        reduce = None if setup.param_dtype is None else torch.float32
        options["mixed_precision"] = MixedPrecision(
            setup.param_dtype, reduce, gather_dtype=setup.gather_dtype
        )
    if setup.cpu_offload:
        options["cpu_offload"] = CPUOffload()
    return options


def training_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    inputs: Inputs,
    loss: Loss,
    setup: Setup,
    device: torch.device,
    recorder: Recorder | None = None,
) -> None:
    """One optimizer step as ``flatshard train`` takes it: the same loop
    (``runtime/_step_loop.py``), the recorder told what each part of it makes."""
    say = recorder or Recorder()  # a recorder not entered only keeps notes

    def micro_loss(micro: int) -> torch.Tensor:
        say.phase, say.backward = tags.BATCH, False
        with device:
            batch = inputs()
        say.phase = tags.ACTIVATIONS
        value = loss(model, batch)
        say.backward = True
        return value

    train_step(
        model,
        optimizers,
        micro_loss,
        setup.grad_accum,
        accumulation=setup.accumulation,
        clip=1.0 if setup.clip else None,
        observer=_Phases(model, say),
    )


class _Phases(StepObserver):
    """Tags the gradients when backward is done, and what the optimizer makes."""

    def __init__(self, model: nn.Module, recorder: Recorder) -> None:
        self.model, self.recorder = model, recorder

    def gradients_done(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.recorder.retag(grads, tags.GRADIENTS)

    def optimizer_starts(self) -> None:
        self.recorder.phase, self.recorder.backward = tags.OPTIMIZER, False


def make_optimizer(model: nn.Module, setup: Setup) -> list[torch.optim.Optimizer]:
    """The planned run's optimizers: Muon's matrices (kept whole by ``shard``) and AdamW
    for the rest, or one optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = setup.optimizer
    if name == "muon":
        matrices = muon_matrices(model, _blocks(setup.auto_wrap_policy))
        rest = [p for p in params if id(p) not in matrices]
        muon = torch.optim.Muon([p for p in params if id(p) in matrices])
        return [muon, torch.optim.AdamW(rest, weight_decay=0.1, foreach=setup.foreach)]
    if name in ("adamw", "adam"):
        decay = 0.1 if name == "adamw" else 0.0
        return [torch.optim.AdamW(params, weight_decay=decay, foreach=setup.foreach)]
    momentum = 0.9 if name == "sgd-momentum" else 0.0
    return [torch.optim.SGD(params, lr=0.1, momentum=momentum, foreach=setup.foreach)]


@contextlib.contextmanager
def _fake_world(world: int, backend: str) -> Iterator[None]:
    """Rank 0 of ``world`` on torch's fake process group: collectives send nothing."""
    # Registers the "fake" backend (torch does the same when it is asked for one).
    importlib.import_module("torch.testing._internal.distributed.fake_pg")
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported, not in __all__
    dist.init_process_group("fake", rank=0, world_size=world, store=store)
    try:
        with simulating(backend):
            yield
    finally:
        dist.destroy_process_group()
