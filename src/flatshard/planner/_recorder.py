"""What one simulated step did, op by op: memory alive at each op, FLOPs, bytes and collectives.

[Note: simulated step]
The planner does not model flatshard from the outside: it runs flatshard itself. The model
is built on the meta device (shapes, no data), ``fully_shard`` runs in a world of W ranks
made of torch's fake process group (collectives return at once and send nothing) and a
real training step runs on it. Every op below autograd passes this dispatch mode, which
sees what a rank would allocate (meta tensors have sizes, not memory): the same storage
accounting the tests do on CPU at the dispatcher (``testing.accounting.PeakStorage``),
so the predicted peak is the measured peak's definition, not a formula that could drift
from the runtime. Each op's FLOPs (torch's own formulas) and bytes read and written feed
the step-time model (``_timing.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from flatshard.comm._mesh import is_reduction_group
from flatshard.measure._accounting import watching_resizes
from flatshard.planner._meta_ops import REMEMBERED, tensors

# What a storage holds, by when and by which op it was made (see ``Recorder.tag_of``).
PARAMETERS = "sharded parameters and buffers"
BATCH = "input batch"
UNSHARDED = "unsharded parameters (gathered units)"
GRADIENTS = "gradient shards"
UNSHARDED_GRADIENTS = "unsharded gradients (being reduced)"
BUFFERS = "communication buffers"
OPTIMIZER = "optimizer state"
# made by the optimizer's step and freed by its end (foreach's intermediates, Muon's
# orthogonalization): counted apart, so that "optimizer state" is the same in every plan of
# a model, the peak inside the step or not (see ``Recorder.settle``)
OPTIMIZER_TEMPORARIES = "optimizer step temporaries"
ACTIVATIONS = "activations and temporaries"

COLLECTIVES = {
    "c10d._allgather_base_": "all_gather",
    "c10d.allgather_": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.allreduce_": "all_reduce",
    "c10d.alltoall_base_": "all_to_all",
    "c10d.broadcast_": "broadcast",
}
# Out of place, on a group named by its last argument: DTensor's (tensor parallel).
FUNCTIONAL_COLLECTIVES = {
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class Op:
    """One op of the simulated step, as the step-time model needs it."""

    name: str
    flops: float
    io_bytes: int  # bytes of the tensors it reads and writes
    collective: str | None  # its kind, or None for compute
    group_size: int  # ranks of the collective's group (1 for compute)
    reads: tuple[int, ...]  # storage serials it reads
    writes: tuple[int, ...]  # storage serials it writes or creates
    backward: bool
    dtype: torch.dtype | None = None  # compute: of its first output
    hosts: int = 1  # collective: hosts its group spans (see ``Recorder.ranks_per_host``)
    # collective: on a process group of the reductions' own (set_separate_reduce_scatter_group)
    own_group: bool = False
    read_bytes: tuple[int, ...] = ()  # compute: bytes it reads of each of ``reads``


@dataclass
class MemoryView:
    """One memory's share of the recorded step (see ``Recorder.split``)."""

    total: int = 0  # bytes alive now, while replaying
    peak: int = 0
    peak_op: int = 0  # ops recorded before the peak
    at_peak: dict[int, int] = field(default_factory=dict)  # serial -> bytes at the peak
    timeline: list[int] = field(default_factory=list)  # bytes after each op (and at start)


def _guessed_scalar(t: torch.Tensor) -> bool | int | float:
    """``.item()`` of a meta tensor has no value; model code asks for one in checks like
    transformers' "are these sequences packed?" (``(mask == 0).all()``). A plan answers
    True for a flag (the check passed: the common, fast path) and 0 for a number."""
    if t.dtype == torch.bool:
        return True
    return 0.0 if t.dtype.is_floating_point else 0


def _grouped_mm_in_any_dtype(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """``aten._grouped_mm`` of float inputs other than bf16 on the meta device: a new
    meta tensor of its output, or None for any other call.

    torch's meta kernel of ``_grouped_mm`` repeats a CUDA kernel's check (bf16 inputs
    only) that its CPU kernel does not make: the CPU multiplies float32 groups. Hugging
    Face's mixture-of-experts blocks (Mixtral, Qwen3-MoE) call it in the model's dtype,
    so a float32 plan of them stopped at the first expert with torch's "Expected inputs
    of BF16 type". The output's sizes and strides are the meta kernel's on bf16 inputs;
    its dtype is the one asked for, or the inputs'.
    """
    if func is not torch.ops.aten._grouped_mm.default:
        return None
    a, b = args[0], args[1]
    if not (a.is_meta and a.dtype.is_floating_point) or a.dtype == torch.bfloat16:
        return None
    shaped = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
    dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
    return torch.empty_strided(shaped.shape, shaped.stride(), dtype=dtype, device="meta")


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *_: Any, **__: Any) -> int:
    """Multiply-adds of ``aten._grouped_mm`` (torch's FLOP counter has no formula for
    it), times two. The groups cut one dimension: the rows of ``a`` (``a`` 2-D, ``b``
    3-D), the inner one (both 2-D: a weight's gradient), the columns of ``b`` (``a`` 3-D,
    ``b`` 2-D), or none (both 3-D: a batch); summed over the groups, every case is one
    product of the three extents."""
    groups = a.size(0) if a.dim() == 3 else b.size(0) if b.dim() == 3 else 1
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.size(0) * a.size(1) * b.size(1)
    rows = a.numel() // a.size(-1)  # every group's rows (a 2-D: the rows all groups share)
    return 2 * rows * a.size(-1) * (b.size(-1) if b.dim() == 3 else b.size(-1) // groups)


_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch ships TorchDispatchMode without annotations; subclassing it is an untyped call.
class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Tracks every storage created inside it (meta included) and, while ``recording``, the
    ops with their costs and the bytes alive after each.

    [Note: a running total of live bytes]
    The bytes alive are a running total: a storage adds its bytes when an op creates it,
    and changes them when it is resized (by an op that mutates its inputs, ``resize_``
    among them, or by flatshard: [Note: resizes the dispatcher does not see]) or dies (a
    weak reference's callback). Reading every live storage after every op instead, as
    ``PeakStorage`` does, cost most of a large model's plan (thousands of storages, tens of
    thousands of ops). A storage that someone else resizes from Python would go unseen,
    so the total is checked against the storages themselves at each collective and at the
    ends of the step (``_check``); where it drifted, ``drifted`` says so and the
    simulation runs again reading every storage after every op (``read_every_op``). Only
    such a resize undone before the next collective stays unseen (nothing in torch's or
    flatshard's training step does that).
    """

    def __init__(self, read_every_op: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.read_every_op = read_every_op
        self.drifted = False  # a storage changed size unseen ([Note: a running total ...])
        self._serial = itertools.count()
        self._live: dict[int, tuple[int, weakref.ref[torch.UntypedStorage]]] = {}
        self._sizes: dict[int, int] = {}  # serial -> bytes, of the storages alive now
        self._total = 0  # their sum
        self.tags: dict[int, str] = {}  # serial -> what it holds
        self.phase = PARAMETERS  # the tag of storages made by compute ops now
        self.backward = False
        self.recording = False
        self.ops: list[Op] = []
        self.peak = 0
        self.ranks_per_host = 1  # to tell which collectives cross hosts
        self.timeline: list[int] = []  # bytes alive after each recorded op (and at start)
        # While recording: (timeline index, serial, its bytes from then on; 0: freed), so
        # that the bytes can be split afterwards by where they live (``split``).
        self._events: list[tuple[int, int, int]] = []
        self._ops_at: list[int] = []  # ops recorded before each timeline entry
        self._watches = contextlib.ExitStack()

    def __enter__(self) -> Recorder:
        self._watches.enter_context(watching_resizes(self._resized))
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._watches.close()

    def serial(self, storage: torch.UntypedStorage) -> int | None:
        entry = self._live.get(id(storage))
        if entry is None or entry[1]() is not storage:
            return None
        return entry[0]

    def retag(self, tensors: list[torch.Tensor], tag: str) -> None:
        for t in tensors:
            serial = self.serial(t.untyped_storage())
            if serial is not None:
                self.tags[serial] = tag

    def settle(self) -> None:
        """After the last step: what the optimizer made that is gone now was a temporary of
        its step, not its state."""
        self._check()
        for serial, tag in self.tags.items():
            if tag == OPTIMIZER and serial not in self._sizes:
                self.tags[serial] = OPTIMIZER_TEMPORARIES

    def start_recording(self) -> None:
        """From now on: ops are recorded and the peak counts from the bytes alive now."""
        self._check()
        self.recording = True
        self.ops.clear()
        self.timeline.clear()
        self._ops_at.clear()
        self._events = [(0, serial, nbytes) for serial, nbytes in self._sizes.items()]
        self.peak = 0
        self._note_peak()

    def _note_peak(self) -> None:
        if self.read_every_op:
            self._check()
        self._ops_at.append(len(self.ops))
        self.timeline.append(self._total)
        self.peak = max(self.peak, self._total)

    def _check(self) -> None:
        """Every live storage's bytes read again; any that differ from the running total's
        are taken (and, but where every op reads them, mark the total as ``drifted``)."""
        for serial, ref in list(self._live.values()):
            storage = ref()
            if storage is not None and storage.nbytes() != self._sizes.get(serial):
                self.drifted |= not self.read_every_op
                self._resize(serial, storage.nbytes())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` may have changed size (``resize_storage``, a mutating op)."""
        serial = self.serial(storage)
        if serial is not None and storage.nbytes() != self._sizes.get(serial):
            self._resize(serial, storage.nbytes())

    def _resize(self, serial: int, nbytes: int) -> None:
        self._total += nbytes - self._sizes.get(serial, 0)
        self._sizes[serial] = nbytes
        if self.recording:
            self._events.append((len(self.timeline), serial, nbytes))

    def _died(self, key: int, serial: int, _: object) -> None:
        """A tracked storage is gone (its weak reference's callback)."""
        entry = self._live.get(key)
        if entry is not None and entry[0] == serial:
            del self._live[key]
        self._resize(serial, 0)
        del self._sizes[serial]

    @property
    def ops_at(self) -> list[int]:
        """The ops recorded before each timeline entry."""
        return list(self._ops_at)

    def split(self, on_host: Callable[[int], bool]) -> tuple[MemoryView, MemoryView]:
        """The recorded step's bytes as two memories, the device's and the host's, by
        ``on_host(serial)`` (CPU offload: shards, gradients, optimizer state)."""
        device, host = MemoryView(), MemoryView()
        peaks: dict[bool, int] = {}  # on the host? -> the timeline index of its peak
        sizes: dict[int, int] = {}
        events = iter(self._events)
        pending = next(events, None)
        for index, ops in enumerate(self._ops_at):
            while pending is not None and pending[0] == index:
                _, serial, nbytes = pending
                memory = host if on_host(serial) else device
                memory.total += nbytes - sizes.get(serial, 0)
                sizes[serial] = nbytes
                pending = next(events, None)
            for memory, mine in ((device, False), (host, True)):
                memory.timeline.append(memory.total)
                if memory.total > memory.peak:
                    memory.peak, memory.peak_op = memory.total, ops
                    peaks[mine] = index
        for memory, mine in ((device, False), (host, True)):
            if mine in peaks:
                alive = self._alive_at(peaks[mine])
                memory.at_peak = {s: b for s, b in alive.items() if b and on_host(s) == mine}
        return device, host

    def _alive_at(self, index: int) -> dict[int, int]:
        """serial -> bytes at the timeline entry ``index``."""
        alive: dict[int, int] = {}
        for at, serial, nbytes in self._events:
            if at > index:
                break
            alive[serial] = nbytes
        return alive

    def _track(self, t: torch.Tensor, tag: str) -> int:
        storage = t.untyped_storage()
        serial = self.serial(storage)
        if serial is None:
            serial = next(self._serial)
            key = id(storage)
            died = functools.partial(self._died, key, serial)
            self._live[key] = (serial, weakref.ref(storage, died))
            self.tags[serial] = tag
            self._resize(serial, storage.nbytes())
        return serial

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return _guessed_scalar(args[0])
        inputs = tensors([args, kwargs])
        before = {id(t.untyped_storage()) for t in inputs}
        out = _grouped_mm_in_any_dtype(func, args, kwargs)
        if out is None:
            out = REMEMBERED(func, args, kwargs)  # [Note: meta ops remembered]
        name = str(func.overloadpacket)
        kind = COLLECTIVES.get(name)
        outputs = tensors(out)
        new = [t for t in outputs if id(t.untyped_storage()) not in before]
        for t in new:
            self._track(t, self.phase)
        if func._schema.is_mutable:  # resize_, set_...: an input's storage may have changed
            for t in inputs:
                self._resized(t.untyped_storage())
        if kind is not None:
            if self.recording:
                self._check()
            self._collective(kind, args, inputs)
        elif name in FUNCTIONAL_COLLECTIVES:
            self._functional(FUNCTIONAL_COLLECTIVES[name], args, inputs, outputs)
        elif self.recording:
            self._compute(func, args, kwargs, out, inputs, new)
        if self.recording:
            self._note_peak()
        return out

    def _collective(self, kind: str, args: tuple[Any, ...], inputs: list[torch.Tensor]) -> None:
        if kind == "all_gather" and self.phase == ACTIVATIONS:
            self.retag(tensors(args[0]), UNSHARDED)
        # (output, input, group, output splits, ...): split sizes are a row-sparse table's
        # ids or rows (gloo's reduce-scatter form splits evenly: none given)
        rows = kind == "all_to_all" and bool(args[3])
        if kind in ("reduce_scatter", "all_to_all") and self.phase == ACTIVATIONS and not rows:
            # (output, input): the input is the unit's unsharded gradient; what the
            # all-to-all receives is a buffer (gloo's form, ``_collectives``). A row-sparse
            # table's ids and rows keep the tags of the phase that made them.
            self.retag(tensors(args[1]), UNSHARDED_GRADIENTS)
            if kind == "all_to_all":
                self.retag(tensors(args[0]), BUFFERS)
        if not self.recording:
            return
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
        group = dist.ProcessGroup.unbox(boxed)
        written = tensors(args[0])
        # The size a ring moves: the full buffer (gathered output, reduced input).
        full = tensors(args[1]) if kind in ("reduce_scatter", "all_to_all") else written
        self._add_collective(kind, group, full, inputs, written)

    def _functional(
        self, kind: str, args: tuple[Any, ...], inputs: list[torch.Tensor], out: list[torch.Tensor]
    ) -> None:
        """A functional collective (tensor parallel's): it returns its output."""
        if self.recording:
            # By name; torch keeps the lookup private (2.2 and later).
            group = c10d._resolve_process_group(args[-1])  # type: ignore[attr-defined]
            full = out if kind == "all_gather" else inputs
            self._add_collective(kind, group, full, inputs, out)

    def _add_collective(
        self,
        kind: str,
        group: dist.ProcessGroup,
        full: list[torch.Tensor],
        inputs: list[torch.Tensor],
        written: list[torch.Tensor],
    ) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.ops.append(
            Op(
                name=kind,
                flops=0.0,
                io_bytes=sum(_bytes(t) for t in full),
                collective=kind,
                group_size=len(ranks),
                reads=tuple(self._serials(inputs)),
                writes=tuple(self._serials(written)),
                backward=self.backward,
                hosts=len({r // self.ranks_per_host for r in ranks}),
                own_group=is_reduction_group(group),
            )
        )

    def _compute(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        inputs: list[torch.Tensor],
        new: list[torch.Tensor],
    ) -> None:
        formula = flop_registry.get(func.overloadpacket) or _EXTRA_FLOPS.get(func.overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        outputs = tensors(out)
        if not new and not flops and not func._schema.is_mutable:
            return  # a view or a no-op: no kernel runs
        read = [
            (s, _bytes(t)) for t in inputs if (s := self.serial(t.untyped_storage())) is not None
        ]
        self.ops.append(
            Op(
                name=str(func.overloadpacket),
                flops=flops,
                io_bytes=sum(_bytes(t) for t in [*inputs, *outputs]),
                collective=None,
                group_size=1,
                reads=tuple(s for s, _ in read),
                writes=tuple(self._serials(outputs)),
                backward=self.backward,
                dtype=outputs[0].dtype if outputs else None,
                read_bytes=tuple(b for _, b in read),
            )
        )

    def _serials(self, tensors: list[torch.Tensor]) -> list[int]:
        found = (self.serial(t.untyped_storage()) for t in tensors)
        return [s for s in found if s is not None]

    def breakdown(self, at_peak: dict[int, int]) -> dict[str, int]:
        """The bytes alive at a peak (a ``MemoryView``'s), by what they hold (tags as they
        stand now)."""
        parts: dict[str, int] = {}
        for serial, nbytes in at_peak.items():
            tag = self.tags.get(serial, ACTIVATIONS)
            parts[tag] = parts.get(tag, 0) + nbytes
        return parts
