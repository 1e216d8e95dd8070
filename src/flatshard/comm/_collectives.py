"""The collectives flatshard issues, as free functions with explicit groups.

Every collective flatshard issues goes through here, tagged with what it is for (``Tag``):
the watchdog records it, waits for it with a timeout and diagnoses a hang (see
[Note: diagnosing a hang] in ``_watchdog.py``); choosing an implementation per backend has
its home here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from datetime import timedelta
from enum import Enum
from functools import partial
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist

from flatshard.comm._mesh import ShardGroups
from flatshard.comm._watchdog import Tag, current_tag, watchdog

# torch 2.13 renamed the tensor collectives; older releases only have the old names.
# Module attributes looked up at call time, so that tests can delay them
# (flatshard.testing.delays).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_REDUCE = dist.all_reduce
_ALL_TO_ALL = dist.all_to_all_single


class AllGatherComm(Protocol):
    """A user's all-gather (FSDP2's ``AllGather``, whose ``allocate`` flatshard does not
    call: the buffers are the FlatParameter's own): fill ``output_tensor`` (C * F,) with
    every rank's ``input_tensor`` (C,) in rank order; a ``Work`` when ``async_op``, or None
    once done."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatterComm(Protocol):
    """A user's reduce-scatter (FSDP2's ``ReduceScatter``): ``output_tensor`` (C,) gets
    this rank's chunk of ``input_tensor`` (C * F,) reduced with ``op`` (flatshard's is
    always ``SUM``) over ``group``; a ``Work`` when ``async_op``, or None once done."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class _Done(dist.Work):
    """The work of a user's collective that returned None: done when it returned."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _custom(launch: Callable[[], dist.Work | None]) -> Callable[[], dist.Work]:
    """``launch`` of a user's collective, its None (already done) as a finished work."""

    def launched() -> dist.Work:
        work = launch()
        return _Done() if work is None else work

    return launched


class WaitClock:
    """Seconds the calling thread spent blocked on flatshard's collectives.

    On CPU backends (gloo) this is communication the compute waited for: the exposed
    communication time. On CUDA, ``Work.wait()`` only makes the compute stream wait and
    returns at once, so there it measures nothing; use a profiler trace instead.
    ``by_unit`` splits it by the unit each waited collective was for ("" for none).
    """

    seconds = 0.0
    by_unit: ClassVar[dict[str, float]] = {}

    @classmethod
    @contextmanager
    def measure(cls) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            cls.seconds += time.perf_counter() - start


class PendingReduction(NamedTuple):
    """A gradient reduction in flight.

    ``input`` is held so that its memory stays alive until the collective has read it.
    ``finish`` turns what the collective left into ``output`` once ``work`` is done (the
    all-reduce form copies this rank's chunk, the all-to-all form sums the received chunks).
    """

    work: dist.Work | None
    input: torch.Tensor  # (C * F,) the unsharded gradient
    output: torch.Tensor  # (C,) this rank's averaged shard once ``work`` is done
    finish: Callable[[], None] | None = None
    post_divide: float = 1  # the part of W divided after the sum (see split_division)
    # Hybrid: the reduce-scatter the all-reduce was chained after, held (with what its
    # side stream still reads) until this reduction is waited for.
    after: PendingReduction | None = None


_UNIT_OF_WORK: dict[int, str] = {}  # id(work) -> its tag's unit, until waited (WaitClock)


def _issue(
    group: dist.ProcessGroup,
    op: str,
    tensor: torch.Tensor,
    tag: Tag | None,
    launch: Callable[[], Any],
) -> dist.Work:
    """Record a collective with the watchdog, issue it (``launch``), and track its work."""
    tag = tag or current_tag()
    dog = watchdog()
    if dog is None:
        work: dist.Work = launch()
    else:
        record = dog.issue(group, op, tensor.numel(), str(tensor.dtype)[6:], tag)
        work = launch()
        dog.track(work, record, group)
    _UNIT_OF_WORK[id(work)] = tag.unit
    return work


def all_gather_into(
    unsharded: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, tag: Tag | None = None
) -> None:
    """Fill ``unsharded`` (C * F,) with every rank's ``shard`` (C,), in rank order; blocking."""
    wait_work(start_all_gather(unsharded, shard, group, tag))


def start_all_gather(
    unsharded: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    tag: Tag | None = None,
    comm: AllGatherComm | None = None,
) -> dist.Work:
    """``all_gather_into`` without waiting: ``wait_work`` before reading ``unsharded``.

    ``shard`` must stay alive until then (the collective reads it in the background).
    ``comm``: a user's all-gather instead of torch's (``set_custom_all_gather``).
    """
    launch = partial(comm or _ALL_GATHER, unsharded, shard, group=group, async_op=True)
    return _issue(group, "all_gather", shard, tag, _custom(launch) if comm else launch)


def exchange_rows(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    tag: Tag | None = None,
) -> None:
    """All-to-all of uneven row blocks along dim 0; blocking: this rank sends
    ``input_splits[r]`` rows to rank r and receives ``output_splits[r]`` rows from it, in
    rank order (row-sparse embedding lookups and their gradients)."""
    launch = partial(
        _ALL_TO_ALL,
        output,
        input,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=True,
    )
    wait_work(_issue(group, "all_to_all", input, tag, launch))


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    tag: Tag | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """Reduce ``tensor`` in place over ``group``; blocking.

    A CPU tensor over a group without a CPU backend (NCCL only: what
    ``init_process_group("nccl")`` makes) is reduced on the accelerator and copied back:
    with ``CPUOffload`` the norms ``clip_grad_norm_`` reduces and the scaler's found-inf
    flags live on the CPU.
    """
    sent = tensor
    if tensor.device.type == "cpu" and not has_cpu_backend(group):
        sent = tensor.to(_accelerator())
    launch = partial(_ALL_REDUCE, sent, op=op, group=group, async_op=True)
    wait_work(_issue(group, "all_reduce", sent, tag, launch))
    if sent is not tensor:
        tensor.copy_(sent)


def has_cpu_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can communicate CPU tensors (gloo can; NCCL alone cannot)."""
    try:
        group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


def chain_stream(device: torch.device) -> AbstractContextManager[Any]:
    """Where a collective chained after another is issued: a side stream of ``device``'s
    (fresh from torch's pool) on accelerators, so that the compute stream does not wait;
    nothing on CPUs. See [Note: hybrid reduction off the compute stream]."""
    if device.type in ("cpu", "meta"):
        return nullcontext()
    side = torch.Stream(device=device)
    side.wait_stream(torch.accelerator.current_stream(device))  # after what issued it
    return side  # entered: the current stream


def on_device(device: torch.device | None) -> AbstractContextManager[Any]:
    """Make ``device`` the current accelerator while inside.

    torch puts some tensors on "the current device" rather than on one it is given: object
    collectives and barriers on NCCL, and here a CPU tensor reduced over NCCL. A user who
    passes ``device=f"cuda:{local_rank}"`` without ``torch.cuda.set_device`` would send
    those to cuda:0 on every rank (NCCL: duplicate GPUs, or a hang), so every collective
    call of flatshard runs on the model's own device. Nothing for CPUs and meta.
    """
    index = getattr(torch.accelerator, "device_index", None)  # torch 2.8 and later
    if device is None or device.type in ("cpu", "meta") or device.index is None or index is None:
        return nullcontext()
    return cast(AbstractContextManager[Any], index(device.index))


def _accelerator() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise RuntimeError("flatshard: a process group without a CPU backend needs an accelerator")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def broadcast(
    tensor: torch.Tensor, group_src: int, group: dist.ProcessGroup, tag: Tag | None = None
) -> None:
    """Copy ``tensor`` of the group's rank ``group_src`` into every rank's; blocking."""
    launch = partial(dist.broadcast, tensor, group_src=group_src, group=group, async_op=True)
    wait_work(_issue(group, "broadcast", tensor, tag, launch))


def barrier(group: dist.ProcessGroup | None, tag: Tag | None = None) -> None:
    """Wait until every rank of ``group`` got here (None: a process alone, nothing to do)."""
    if group is not None:
        launch = partial(dist.barrier, group=group, async_op=True)
        wait_work(_issue(group, "barrier", torch.empty(0), tag, launch))


def all_gather_object(
    obj: object, group: dist.ProcessGroup, tag: Tag | None = None
) -> list[object]:
    """Every rank's ``obj``, in group rank order (pickled; for small objects)."""
    _record_object_collective(group, "all_gather_object", 1, tag)
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object_list(
    objects: list[object], group_src: int, group: dist.ProcessGroup, tag: Tag | None = None
) -> None:
    """Replace ``objects`` on every rank by the group's rank ``group_src``'s (pickled)."""
    _record_object_collective(group, "broadcast_object_list", len(objects), tag)
    dist.broadcast_object_list(objects, group_src=group_src, group=group)


def _record_object_collective(
    group: dist.ProcessGroup, op: str, count: int, tag: Tag | None
) -> None:
    """Object collectives block inside torch: recorded for the reports, not waited for here."""
    dog = watchdog()
    if dog is not None:
        dog.issue(group, op, count, "object", tag or current_tag())


def wait_work(work: dist.Work | None) -> None:
    """Block until ``work`` is done (on CUDA: make the current stream wait for it)."""
    if work is None:
        return
    unit = _UNIT_OF_WORK.pop(id(work), "")
    before = WaitClock.seconds
    with WaitClock.measure():
        dog = watchdog()
        if dog is None:
            work.wait()
        else:
            dog.wait(work)
    WaitClock.by_unit[unit] = WaitClock.by_unit.get(unit, 0.0) + WaitClock.seconds - before


class ReduceScatter(Enum):
    """How a reduce-scatter over a group runs; ``reduce_scatter_impl`` picks one per backend.

    All three leave the same sums in this rank's chunk (up to the order of addition).
    """

    REDUCE_SCATTER = "reduce_scatter_tensor"  # the collective itself (NCCL)
    ALL_REDUCE = "all_reduce in place + copy of own chunk"
    ALL_TO_ALL = "all_to_all_single + local sum of the received chunks"


def reduce_scatter_impl(group: dist.ProcessGroup) -> ReduceScatter:
    """The fastest reduce-scatter form measured for ``group``'s backend.

    gloo implements reduce_scatter_tensor as a full-size clone, an all-reduce and a copy.
    An all-to-all sends each rank only the chunks it sums, (F - 1) / F of the gradient,
    where an all-reduce sends twice that; the received chunks are then summed here. It
    was the fastest form in the whole training step, at every buffer size tried
    (docs/performance.md, "gloo's reduce-scatter", has the A/B runs and their commands).
    """
    backend: str = dist.get_backend(group)
    if backend == dist.Backend.FAKE:  # the planner's simulated world (``flatshard.plan``)
        backend = _SIMULATED.get()
    if backend == dist.Backend.GLOO:
        return ReduceScatter.ALL_TO_ALL
    return ReduceScatter.REDUCE_SCATTER


# The backend ``flatshard.plan`` simulates on torch's fake process group (which sends
# nothing): the reduce-scatter form is the one that backend would get.
_SIMULATED: ContextVar[str] = ContextVar("simulated_backend", default=str(dist.Backend.NCCL))


@contextmanager
def simulating(backend: str) -> Iterator[None]:
    """Collectives on torch's fake process group take ``backend``'s forms, inside."""
    token = _SIMULATED.set(backend)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


def describe(group: dist.ProcessGroup) -> str:
    """Which implementation each collective uses on ``group``'s backend (for reports)."""
    backend = dist.get_backend(group)
    reduce = reduce_scatter_impl(group).value
    return f"{backend}: all-gather all_gather_into_tensor (async); gradient reduce {reduce}"


def reduce_gradient(
    grad: torch.Tensor,
    groups: ShardGroups,
    tag: Tag | None,
    across_replicas: bool = True,
    division: tuple[float, float] | None = None,
    comm: ReduceScatterComm | None = None,
) -> PendingReduction:
    """Average ``grad`` (C * F,) over all W ranks; this rank keeps its chunk (C,).

    Reduce-scatter inside the shard group, then all-reduce of the chunk inside the
    replicate group (HYBRID_SHARD_OPTIM: a reduce-scatter there too, and this rank keeps
    its part of the chunk, C / R). Divides by part of W before the sum and the rest after
    (``split_division``), so that low-precision sums neither overflow nor underflow.
    ``across_replicas=False``: the reduce-scatter alone, still divided by all of W, so that
    a later sum across the replicas (``all_reduce``) of such chunks is the average.
    ``division``: (before, after) the sum, for a divisor other than W
    (``gradient_division``). ``comm``: a user's reduce-scatter for the one inside the
    shard group (``set_custom_reduce_scatter``).
    """
    pre, post = division or split_division(groups.world_size)
    if pre != 1:
        grad.div_(pre)
    summed = groups if across_replicas else ShardGroups(groups.shard, None)
    return _start_sum(grad, summed, tag, comm)._replace(post_divide=post)


def _start_sum(
    grad: torch.Tensor, groups: ShardGroups, tag: Tag | None, comm: ReduceScatterComm | None
) -> PendingReduction:
    """Start summing ``grad`` (C * F,) over all W ranks into this rank's chunk (C,)."""
    if groups.shard is None and groups.split_across_replicas:  # F = 1: ZeRO-2 over replicas
        assert groups.replicate is not None
        across = ShardGroups(groups.replicate, None)
        part = grad.new_empty(grad.numel() // groups.replicate_size)
        return _start_scatter_sum(part, grad, across, tag)
    if groups.shard is None:
        work = None
        if groups.replicate is not None:
            work = _start_all_reduce(grad, groups.replicate, tag)
        return PendingReduction(work=work, input=grad, output=grad)
    output = grad.new_empty(grad.numel() // groups.factor)  # (C,)
    scattered = _start_scatter_sum(output, grad, groups, tag, comm)
    if groups.replicate is None:
        return scattered
    # [Note: hybrid reduction off the compute stream]
    # The all-reduce across replicas needs the reduce-scatter's chunk. Waiting for it on
    # the compute stream (as this did) would stop the next unit's backward until the
    # reduce-scatter finished, on every unit. On an accelerator the wait and the all-reduce
    # are issued from a side stream instead: it waits for the reduce-scatter, NCCL's stream
    # waits for it, and the compute stream waits only when the reduction is waited for
    # (``wait_reduction``). The tensors the side stream touches (``output``, the
    # reduce-scatter's buffers) stay referenced here until then, and the compute stream
    # is ordered after all of it by that wait, so their memory is safe to reuse after it.
    # On gloo every wait blocks the host, here as before.
    with chain_stream(grad.device):
        wait_reduction(scattered)
        if groups.split_across_replicas:  # HYBRID_SHARD_OPTIM: this rank keeps its part
            across = ShardGroups(groups.replicate, None)
            part = output.new_empty(output.numel() // groups.replicate_size)
            inner = _start_scatter_sum(part, output, across, tag)
            return inner._replace(input=grad, after=scattered)
        work = _start_all_reduce(output, groups.replicate, tag)
    return PendingReduction(work=work, input=grad, output=output, after=scattered)


def _start_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, tag: Tag | None) -> dist.Work:
    launch = partial(_ALL_REDUCE, tensor, group=group, async_op=True)
    return _issue(group, "all_reduce", tensor, tag, launch)


def split_division(world_size: int) -> tuple[int, int]:
    """(pre, post) with pre * post = W: divide by ``pre`` before summing, ``post`` after.

    Dividing by all of W first can underflow small low-precision gradients at large W;
    not dividing first can overflow the sum. ``pre`` is the smallest power of two >=
    sqrt(W) that divides W (as FSDP does), splitting the range between the two risks.
    """
    pre = 1
    while world_size % (pre * 2) == 0 and world_size / pre > pre:
        pre *= 2
    return pre, world_size // pre


def gradient_division(world_size: int, factor: float | None) -> tuple[float, float]:
    """(before, after) the sum for dividing a gradient by ``factor`` (None: W, the
    average): a whole factor is split as W is (``split_division``), another is divided
    after the sum."""
    if factor is None:
        return split_division(world_size)
    if float(factor).is_integer():
        return split_division(int(factor))
    return 1, factor


def wait_reduction(pending: PendingReduction) -> torch.Tensor:
    """Block until the reduction is done; returns this rank's averaged shard."""
    wait_work(pending.work)
    if pending.finish is not None:
        pending.finish()
    if pending.post_divide != 1:
        pending.output.div_(pending.post_divide)
    return pending.output


def sum_reduce(grad: torch.Tensor, groups: ShardGroups, tag: Tag | None = None) -> torch.Tensor:
    """Sum ``grad`` (C * F,) over all W ranks and return this rank's chunk (C,); blocking."""
    output = grad
    if groups.shard is not None:
        output = grad.new_empty(grad.numel() // groups.factor)
        _scatter_sum(output, grad, groups, tag)
    if groups.replicate is not None:
        wait_work(_start_all_reduce(output, groups.replicate, tag))
    return output


def _start_scatter_sum(
    output: torch.Tensor,
    grad: torch.Tensor,
    groups: ShardGroups,
    tag: Tag | None,
    comm: ReduceScatterComm | None = None,
) -> PendingReduction:
    """Start summing ``grad`` (C * F,) over the shard group into ``output`` (C,), with
    ``comm`` if given (a user's reduce-scatter)."""
    assert groups.shard is not None
    group, size = groups.shard, output.numel()
    if comm is not None:
        launch = partial(comm, output, grad, group, op=dist.ReduceOp.SUM, async_op=True)
        return PendingReduction(
            _issue(group, "reduce_scatter", grad, tag, _custom(launch)), grad, output
        )
    impl = reduce_scatter_impl(group)
    if impl is ReduceScatter.ALL_TO_ALL:
        received = torch.empty_like(grad)  # (F, C): every rank's copy of this rank's chunk
        launch = partial(_ALL_TO_ALL, received, grad, group=group, async_op=True)
        work = _issue(group, "reduce_scatter", grad, tag, launch)

        def sum_received() -> None:
            torch.sum(received.view(groups.factor, size), dim=0, out=output)

        return PendingReduction(work, grad, output, sum_received)
    if impl is ReduceScatter.ALL_REDUCE:  # in place: the gradient is ours to overwrite
        work = _start_all_reduce(grad, group, tag)
        chunk = grad[groups.shard_rank * size : (groups.shard_rank + 1) * size]

        def copy_chunk() -> None:
            output.copy_(chunk)

        return PendingReduction(work, grad, output, copy_chunk)
    launch = partial(_REDUCE_SCATTER, output, grad, group=group, async_op=True)
    work = _issue(group, "reduce_scatter", grad, tag, launch)
    return PendingReduction(work, grad, output)


def _scatter_sum(
    output: torch.Tensor, grad: torch.Tensor, groups: ShardGroups, tag: Tag | None
) -> None:
    """Blocking reduce-scatter of ``grad`` (C * F,) into ``output`` (C,)."""
    pending = _start_scatter_sum(output, grad, groups, tag)
    wait_reduction(pending)
