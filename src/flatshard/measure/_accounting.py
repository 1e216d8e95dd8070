"""What measuring tools see of flatshard's work: which collectives ran and what storage
they left alive, counted exactly on CPU, and the profiler ranges the runtime's work runs in.

The counts work at the dispatcher, below flatshard, so they count what really happened
rather than what flatshard believes it did.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
SEND = "send"  # point to point (pipeline stages: activations forward, gradients back)
RECV = "recv"
# The end-of-step check (flatshard/comm/_agreement.py): one all-gather of an 8-byte digest per
# rank at the end of every backward pass and of every forward without backward.
STEP_CHECK = 1  # all-gathers per check
STEP_CHECK_BYTES = 8  # bytes each rank contributes

_KINDS = {
    "c10d._allgather_base_": ALL_GATHER,
    "c10d.allgather_": ALL_GATHER,
    "c10d._reduce_scatter_base_": REDUCE_SCATTER,
    "c10d.reduce_scatter_": REDUCE_SCATTER,
    "c10d.allreduce_": ALL_REDUCE,
    "c10d.alltoall_base_": ALL_TO_ALL,
    "c10d.send": SEND,
    "c10d.recv_": RECV,
}


# torch ships TorchDispatchMode without annotations; subclassing it is an untyped call.
class CollectiveTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts collectives by kind and watches the storage every all-gather writes.

    ``peak_gathered_bytes`` is the most bytes that all-gather outputs held at once, sampled
    right after each all-gather: the unsharded-parameter peak.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()  # bytes each kind of collective produced
        self.sent: Counter[str] = Counter()  # bytes this rank sends, at the least (see _sent)
        self._gathered: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak_gathered_bytes = 0
        self._reduced: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak_reduce_input_bytes = 0  # most bytes of reduction inputs alive at once
        self.timeline: list[tuple[str, int]] = []  # (kind, gathered bytes after it)
        self.ops: list[tuple[str, int]] = []  # (kind, bytes it produced), in issue order

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(str(func.overloadpacket))
        if kind is not None:
            self.counts[kind] += 1
            target = args[0]
            produced = 0
            for t in target if isinstance(target, list | tuple) else [target]:
                for x in t if isinstance(t, list) else [t]:
                    produced += x.numel() * x.element_size()
            self.bytes[kind] += produced
            self.ops.append((kind, produced))
            self.sent[kind] += _sent(kind, args)
        if kind in (REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL):
            source = args[0] if kind == ALL_REDUCE else args[1]
            for t in source if isinstance(source, list | tuple) else [source]:
                for x in t if isinstance(t, list) else [t]:
                    storage = x.untyped_storage()
                    self._reduced[id(storage)] = weakref.ref(storage)
            self.peak_reduce_input_bytes = max(
                self.peak_reduce_input_bytes, _alive_bytes(self._reduced)
            )
        if kind == ALL_GATHER:
            target = args[0]
            tensors = target if isinstance(target, list | tuple) else [target]
            for tensor in tensors:
                for t in tensor if isinstance(tensor, list) else [tensor]:
                    storage = t.untyped_storage()
                    # Keyed by the storage object: a resized storage changes its data_ptr.
                    self._gathered[id(storage)] = weakref.ref(storage)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        if kind is not None:
            self.timeline.append((kind, self.gathered_bytes()))
        return out

    def sent_bytes(self) -> int:
        return sum(self.sent.values())

    def gathered_bytes(self) -> int:
        """Bytes still held by storages that all-gathers wrote into."""
        return _alive_bytes(self._gathered)


def _alive_bytes(storages: dict[int, weakref.ref[torch.UntypedStorage]]) -> int:
    total = 0
    for ref in storages.values():
        storage = ref()
        if storage is not None:
            total += storage.nbytes()
    return total


def distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakStorage(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The most bytes that storages created inside the mode held alive at once.

    Counts every storage an op returns that none of its inputs had (views are not new
    memory), so the peak covers temporaries, not just collective outputs. Meta is free.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0

    def reset_peak(self) -> None:
        """From now on, the peak counts from the bytes alive now (still tracked)."""
        self.peak = _alive_bytes(self._live)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in [*args, *(kwargs or {}).values()]
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in out if isinstance(out, list | tuple) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if id(storage) not in inputs:  # a view of an input is not new memory
                    self._live[id(storage)] = weakref.ref(storage)
        self.peak = max(self.peak, _alive_bytes(self._live))
        return out


# [Note: resizes the dispatcher does not see]
# ``UntypedStorage.resize_`` changes a storage's bytes without any op passing the
# dispatcher, so a mode that counts storage there sees a resize only by reading every
# storage again after each op (``PeakStorage`` does: exact, and slow on large models).
# flatshard frees and refills each unit's unsharded buffer that way, twice a step per unit;
# it resizes through ``resize_storage``, which tells the modes that asked
# (``watching_resizes``: the planner's recorder) which storage changed, so they can keep
# a running total instead of reading every storage after every op.
_RESIZE_WATCHERS: list[Callable[[torch.UntypedStorage], None]] = []


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """``storage.resize_(nbytes)``, told to the modes watching resizes."""
    storage.resize_(nbytes)
    for watch in _RESIZE_WATCHERS:
        watch(storage)


@contextlib.contextmanager
def watching_resizes(watch: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """``watch(storage)`` after every ``resize_storage`` inside the block."""
    _RESIZE_WATCHERS.append(watch)
    try:
        yield
    finally:
        _RESIZE_WATCHERS.remove(watch)


def _sent(kind: str, args: tuple[Any, ...]) -> int:
    """[Note: bytes sent, not bytes produced]
    The bytes a rank of a W-rank group sends in a collective, at the least any algorithm
    needs: an all-gather sends this rank's shard to the W - 1 others ((W - 1) / W of its
    output, ring-forwarded), a reduce-scatter (W - 1) / W of its input, an all-reduce
    twice that, an all-to-all its input but the chunk it keeps. Bytes produced (outputs)
    compare badly across forms of one reduction: gloo's reduce-scatter as an all-to-all
    (``comm/_collectives.py``) outputs every rank's chunk, W times a reduce-scatter's
    output, yet sends the same bytes."""
    if kind in (SEND, RECV):  # (tensors, group, peer, tag): a send sends them whole
        return sum(int(t.numel() * t.element_size()) for t in args[0]) if kind == SEND else 0
    boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    if boxed is None:
        return 0
    group = dist.ProcessGroup.unbox(boxed)
    world = int(group.size())
    source = args[0] if kind in (ALL_GATHER, ALL_REDUCE) else args[1]
    total: int = sum(
        int(x.numel() * x.element_size())
        for t in (source if isinstance(source, list | tuple) else [source])
        for x in (t if isinstance(t, list) else [t])
    )
    if world == 1:
        return 0
    if kind == ALL_TO_ALL and args[4]:  # (output, input, group, out splits, in splits)
        splits: list[int] = list(args[4])
        row = total // max(1, sum(splits))
        return row * (sum(splits) - splits[int(group.rank())])
    share = total * (world - 1) // world
    return 2 * share if kind == ALL_REDUCE else share


# Whether a profiler is recording (torch exposes no public query; without this private
# one, ranges are always entered).
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


class Ranges:
    """Where profiler ranges are opened; ``flatshard.testing.internals`` swaps ``open`` to
    count them."""

    open: Callable[[str], AbstractContextManager[object]] = record_function


def traced(what: str) -> AbstractContextManager[object]:
    """A profiler range ``flatshard::<what>`` (``<phase> <unit>``) while a profiler records,
    else nothing.

    Entering a range costs CPU time even when nothing records, and a step enters several
    per unit: on a GPU, launch time the device may wait for.
    """
    return Ranges.open(f"flatshard::{what}") if _profiling() else nullcontext()
