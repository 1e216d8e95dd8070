"""FlatParamGroup: a group of a unit's original parameters in one flat, sharded buffer.

This is the paper's FlatParameter (the docs keep that name for the concept). It is not an
``nn.Parameter``: the user's parameters stay registered in their modules (as views of the
shard), so nothing is renamed. A unit has one group per (requires_grad, dtype, compute
dtype) set of its parameters, so frozen parameters never get gradient memory or a
reduce-scatter. This file owns the storage and the views; the gradient path is
``_reduction.py``; gathering for state dicts and ``summon_full_params`` is
``runtime/_by_hand.py``.

[Note: flat tensors and their lifetimes]
- ``shard`` (C,): this rank's chunk; persistent. Every original parameter's ``.data`` is a
  view of its rows in it, so the optimizer updates the shard in place.
- ``unsharded`` (C * F,), in the compute dtype and device: the autograd leaf that forward
  uses; original parameters are swapped for ``split`` + ``view`` views of it while the unit
  runs, so autograd accumulates one flat gradient for the whole group. Its storage is freed
  (resized to 0) while resharded and re-allocated by the next unshard. The storage object
  itself lives as long as the group, so views saved by autograd for backward stay valid
  across reshard/unshard.
- ``_unsharded_data``: the same storage without autograd's version counter. The all-gather
  writes through it; writing through ``unsharded`` would bump the version that autograd
  checks on saved views and make backward fail.
- The reduced gradient (C,) becomes the original parameters' ``.grad`` (``_reduction.py``).
- The all-gather is asynchronous (see [Note: asynchronous all-gather]).
- With F = 1 (NO_SHARD, or a world of one) in the master dtype and device there is nothing
  to gather: ``unsharded`` is a leaf sharing the shard's storage, never freed, and
  unshard/reshard only swap views (``aliases_shard``).

[Note: asynchronous all-gather]
``start_unshard`` allocates the unsharded buffer on the current stream, casts the shard and
issues the all-gather with ``async_op=True``; ``finish_unshard`` waits on the work handle.
Prefetch only starts; the unit's own hook finishes (and registers views), so the gather
runs while the current unit computes. On CPU (gloo) the collective runs in gloo's threads
and ``wait()`` blocks the CPU until the data is there. On CUDA (NCCL) it runs on NCCL's
internal stream and ``wait()`` makes the current (compute) stream wait for it without
blocking the CPU. Since torch 2.8 the NCCL process group no longer calls ``record_stream``:
a Work object keeps its tensors referenced until ``wait()``. A reference does not stop
``untyped_storage().resize_(0)`` from releasing the memory, so safety rests on one rule:
a buffer a collective uses is waited for before it is freed or re-allocated (``reshard``
and ``set_compute_dtype`` wait for a gather in flight first; a reduction keeps its input
until it is waited for). After the wait the compute stream is ordered after the
collective, and the buffer was allocated on that stream, so the caching allocator can
hand its memory only to work that runs later. The cast source is held until the wait for
the same reason. The CPU may run ahead of the GPU; the rate limiter
(``runtime/_prefetch.py``) bounds how far.

[Note: stale gathers]
A gathered buffer is a copy of the shards at the time its all-gather started. If the shard
is written afterwards (``optimizer.step()`` while a unit is kept gathered by
``unshard`` or ``set_reshard_after_backward(False)``, a load, a write-back), that copy is
stale, and on NCCL the gather may even have read the shard while the step wrote it. So
each group counts the writes of its shard that flatshard knows of, its ``generation``:
events every rank sees alike, never a rank-local signal (a tensor's version counter
misses ``p.data`` writes and fused optimizers; a process-wide count of optimizer steps
moves for another model's optimizer, on one rank). ``shards_written`` is called by the
owner of each such event: the step pre-hook of an optimizer that holds the model's
parameters (``runtime/_optimizer_steps.py``), the loads, ``summon_full_params``'s
write-back, and, for a model no torch optimizer steps (a hand-written update through
``p.data``), each synchronized backward and the root's next forward after a forward whose
backward never came (what it kept was gathered after the backward's mark). It waits for
a gather in flight and bumps the generation; ``start_unshard`` (every gather, prefetched
or not, and a row-sparse table's lookup through ``drop_stale_gather``) finds a buffer
gathered at an older generation, frees it and gathers again. Every rank makes the same
calls, so every rank decides alike.

[Note: optimizer state sharded across the replicas]
HYBRID_SHARD_OPTIM keeps HYBRID_SHARD's parameters (each rank holds 1/F, gathered inside
its shard group of F ranks) but cuts the gradients and the optimizer state across all W =
F x R ranks. The layout is row-aligned at W chunks; a rank's shard is its F-chunk, made of
R consecutive W-chunks (so the shard group's all-gather still yields the unsharded buffer),
and its original parameters are views of its own W-chunk only, the ``param_region``
(W-chunk s * R + r for shard rank s and replica r). The optimizer, its state, ``.grad``,
sharded state dicts and checkpoints therefore see 1/W, as under FULL_SHARD over W. A
gradient is reduce-scattered inside the shard group (the F-chunk), then across the
replicas (the own W-chunk). After the optimizer wrote its region, the other R - 1 W-chunks
of the shard are old: the next gather first all-gathers the regions across the replicas
into the shard (``refresh``), decided by the shard's generation ([Note: stale gathers]),
which every rank sees alike.
Anything gathered from the originals' layout (state dicts, optimizer state) goes through
the same two steps (``gather_region``).

[Note: resharding to a smaller group after forward]
``set_reshard_after_forward(model, N)`` (FSDP2's int): forward frees the gathered buffer
but keeps 1/N of it, the part this rank holds in its group of N consecutive shard ranks
(``post_forward_group``, e.g. the ranks of one host), and backward all-gathers the buffer
from those parts inside that group: traffic inside a host in backward, for L / N elements
kept per unit where FULL_SHARD keeps L / F. The buffer the parts make is the gathered
buffer itself: L = C * F elements cut into N equal parts, in the order of the shard
ranks, which the group keeps. A part is used only at the generation it was cut at ([Note:
stale gathers]): after a write of the shard it is dropped and the next use gathers from
the shards over the whole shard group. It is dropped once used; a forward whose backward
never comes leaves it until the next gather of the group, which then uses it.

[Note: the group's storage states]
A group's unsharded buffer is in one ``Storage`` state, and its originals' module entries
hold one ``Holding``: together what the group holds right now. Only ``FlatParamGroup``
changes them; a move outside ``_STORAGE_MOVES`` is a flatshard bug and raises, naming the
group and both states. docs/design.md ("Unit state") has the table with the unit's own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from enum import Enum, auto
from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import start_all_gather, wait_work
from flatshard.comm._mesh import ShardGroups
from flatshard.comm._watchdog import Tag
from flatshard.flat._layout import FlatLayout, ViewSplits
from flatshard.flat._partition import OriginalParam
from flatshard.flat._placement import ROWS, GroupPlacement, ShardPlacement
from flatshard.flat._reduction import GradientReduction
from flatshard.flat._transport import IDENTITY, SCALED, GatherCodec, Gathering, Transport
from flatshard.measure._accounting import resize_storage


# ---------------------------------------------------------------- storage states
class Storage(Enum):
    """What a group's unsharded buffer holds. Only the group's own methods change it, along
    ``_STORAGE_MOVES``; an F = 1 group in the master dtype (``aliases_shard``) is always
    GATHERED: its shard is the buffer."""

    SHARDED = auto()  # no memory: this rank's shard is all there is
    GATHERING = auto()  # an all-gather into the buffer is in flight (prefetch)
    GATHERED = auto()  # every rank's rows, as of the shard generation it was gathered at


class Holding(Enum):
    """What the modules' parameter entries of a group's originals hold."""

    ORIGINALS = auto()  # the original parameters: this rank's rows (between steps)
    VIEWS = auto()  # views of the gathered buffer (while the unit runs, or is summoned)
    PROXY = auto()  # a row-sparse table's lookup proxy ([Note: row-sparse embedding tables])


_STORAGE_MOVES = {
    Storage.SHARDED: {Storage.GATHERING, Storage.GATHERED},
    Storage.GATHERING: {Storage.GATHERED},
    Storage.GATHERED: {Storage.SHARDED},
}


def storage_move(now: Storage, to: Storage, name: str) -> Storage:
    """``to``, if a group may go there from ``now``; else an error naming the group by its
    first parameter ``name``."""
    if to not in _STORAGE_MOVES[now]:
        raise RuntimeError(
            f"flatshard: internal error: the flat parameter group of '{name}' (rank "
            f"{global_rank()}) cannot go from {now.name} to {to.name}; please report it "
            "with the traceback"
        )
    return to


# ---------------------------------------------------------------- the group


@dataclass(frozen=True)
class GroupSpec:
    """Where a group's tensors live and in which dtypes (mixed precision, CPU offload)."""

    master_device: torch.device  # the shard (and the optimizer state)
    compute_device: torch.device  # the unsharded buffer
    compute_dtype: torch.dtype | None = None  # None: the parameters' own dtype
    reduce_dtype: torch.dtype | None = None  # None: the compute dtype
    offload: bool = False  # CPUOffload: every use on the compute device copies the shard
    gather_dtype: torch.dtype | None = None  # the policy's; the placement may choose another


def allocate_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give ``tensor``'s storage its memory back (``nbytes``)."""
    resize_storage(tensor.untyped_storage(), nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory while keeping its storage object (and its views) alive."""
    resize_storage(tensor.untyped_storage(), 0)


class _Encoding(NamedTuple):
    """A codec's payload of this rank's shard, and the shard it encoded: its generation
    and torch's version counter then."""

    payload: torch.Tensor
    generation: int
    version: int


class FlatParamGroup:
    """A group of original parameters flattened into one row-aligned buffer and sharded."""

    def __init__(
        self,
        originals: list[OriginalParam],
        groups: ShardGroups,
        spec: GroupSpec,
        placement: ShardPlacement = ROWS,
    ) -> None:
        """Plan the layout and allocate this rank's (zero) shard on the master device.

        Nothing full-size stays allocated: the originals may still be on the meta device.
        ``load_shard`` then copies this rank's rows out of the materialized originals.
        """
        first = originals[0].param
        self.originals = originals
        self.groups = groups
        self.rank = groups.shard_rank
        self.factor = groups.factor  # F: ranks the buffer is cut across
        self.requires_grad = first.requires_grad
        # R where the optimizer state is cut across the replicas too, else 1 (see the note)
        self.splits = groups.splits
        self.param_layout: FlatLayout = placement.layout(
            [o.param.shape for o in originals], self.factor * self.splits
        )
        # Gathering: F chunks, each of ``splits`` consecutive chunks of the parameters' layout
        self.layout = replace(
            self.param_layout,
            factor=self.factor,
            shard_numel=self.param_layout.shard_numel * self.splits,
        )
        self.views = ViewSplits(self.layout, self.rank)  # the shard's rows (F-chunk)
        self.split_rank = groups.replicate_rank if self.splits > 1 else 0
        # The original parameters' rows: the own W-chunk (the whole shard unless split)
        self.param_views = ViewSplits(self.param_layout, self.rank * self.splits + self.split_rank)
        self.full_shapes = [slot.shape for slot in self.layout.slots]  # per original
        # Per original: False where a whole-parameter layout puts it in another rank's shard.
        self.owned = [
            not (self.layout.whole and held.numel == 0 and slot.numel > 0)
            for slot, held in zip(self.layout.slots, self.param_views.held, strict=True)
        ]
        self.compute_dtype = spec.compute_dtype or first.dtype
        self.compute_device = spec.compute_device
        self.reduce_dtype = spec.reduce_dtype or self.compute_dtype
        device = spec.master_device
        self.offloaded = spec.offload
        # Persistent: this rank's shard; original parameters are views of it.
        # Pinned when offloaded from an accelerator: host-to-device copies run async.
        pin = device.type == "cpu" and self.compute_device.type != "cpu"
        self.shard = torch.zeros(
            self.layout.shard_numel, dtype=first.dtype, device=device, pin_memory=pin
        )
        self._grad_hook: Callable[[torch.Tensor], None] | None = None
        # (original's index, its module's parameter dict, its name there), on first use.
        self._registrations: list[tuple[int, dict[str, torch.Tensor], str]] | None = None
        self.has_tp = any(o.tp is not None for o in originals)  # DTensor parameters
        self._gather: Gathering | None = None  # started, not waited for
        self.holding = Holding.ORIGINALS
        # Writes of the shard flatshard knows of ([Note: stale gathers]); the generation the
        # buffer was gathered at, and the one the replicas' regions were last refreshed at.
        self.generation = 0
        self._gathered_generation = -1
        self._refreshed_generation = 0
        # Told of every collective issued for the group: (kind, elements sent); gives the
        # tag to issue it with. The unit records it in its root's ledger (see comm/_agreement.py).
        self.on_collective: Callable[[str, int], Tag | None] = _ignore
        self.transport: Transport = IDENTITY  # how gathers and reductions travel
        # set_reshard_after_forward(model, N): forward keeps this rank's part for its group
        # of N shard ranks; backward gathers from the parts ([Note: resharding to a smaller
        # group after forward]). The part: (its elements, the generation it was cut at).
        self.post_forward_group: dist.ProcessGroup | None = None
        self._part: tuple[torch.Tensor, int] | None = None
        # A codec's payload of this rank's shard: the last one sent, while the buffer is
        # gathered, and the one kept from forward for backward's gather ([Note: one
        # encoding per write]).
        self._sent: _Encoding | None = None
        self._encoded: _Encoding | None = None
        self._allocate_unsharded()
        self.reduction = GradientReduction(self)
        # What the group does where its placement decides ([Note: one placement protocol])
        self.placement: GroupPlacement = placement.bind(self)
        self.placement_value = placement
        gather = placement.gathered_in(spec.gather_dtype)
        if gather is not None:
            self.set_gather_dtype(gather)

    def load_shard(self) -> None:
        """Copy this rank's rows of the (full) originals into the shard; they become views."""
        for orig, slot, held in zip(
            self.originals, self.layout.slots, self.views.held, strict=True
        ):
            start = held.first_row * slot.row_numel
            source = orig.param.detach().reshape(-1)[start : start + held.numel]
            self.shard[held.local_offset : held.local_offset + held.numel].copy_(source)
        self.use_sharded_data()
        self._refreshed_generation = self.generation  # every replica copied the same rows

    @property
    def param_region(self) -> torch.Tensor:
        """The part of the shard the original parameters view (all of it unless split)."""
        size = self.param_layout.shard_numel
        return self.shard[self.split_rank * size : (self.split_rank + 1) * size]

    def refresh(self) -> None:
        """Split across the replicas: all-gather every replica's region into the shard, if
        any region was written since the last refresh (see the note)."""
        if self.splits == 1 or self.generation == self._refreshed_generation:
            return
        region = self.param_region.clone()  # an input that is not part of the output
        tag = self.on_collective("all_gather", region.numel())
        assert self.groups.replicate is not None
        wait_work(start_all_gather(self.shard, region, self.groups.replicate, tag))
        self._refreshed_generation = self.generation

    def gather_region(self, region: torch.Tensor) -> torch.Tensor:
        """A tensor laid out like ``param_region`` -> laid out like the shard (the other
        replicas' regions gathered in; itself unless split)."""
        if self.splits == 1:
            return region
        out = region.new_empty(self.layout.shard_numel)
        assert self.groups.replicate is not None
        tag = self.on_collective("all_gather", region.numel())
        wait_work(start_all_gather(out, region.contiguous(), self.groups.replicate, tag))
        return out

    @property
    def needs_all_gather(self) -> bool:
        """Whether unsharding needs an all-gather (F > 1)."""
        return self.groups.shard is not None

    @property
    def aliases_shard(self) -> bool:
        """F = 1 in the master dtype and device, not offloaded, not encoded: the shard is
        the unsharded buffer."""
        return (
            not self.needs_all_gather
            and self.transport.codec is None
            and not self.offloaded
            and self.compute_dtype == self.shard.dtype
            and self.compute_device == self.shard.device
        )

    @property
    def originals_are_full(self) -> bool:
        """The original parameters are whole at all times: the shard is the buffer and the
        optimizer state is not cut across the replicas."""
        return self.aliases_shard and self.splits == 1

    def _allocate_unsharded(self) -> None:
        """Create the unsharded leaf (C * F,), alive only while unsharded (see the note)."""
        if self.aliases_shard:
            self.unsharded = self.shard.detach().requires_grad_(self.requires_grad)
        else:
            self.unsharded = torch.empty(
                self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.compute_device
            ).requires_grad_(self.requires_grad)
        self._unsharded_data = self.unsharded.data
        self._unsharded_nbytes = self.unsharded.untyped_storage().nbytes()
        self.storage = Storage.GATHERED if self.aliases_shard else Storage.SHARDED
        if not self.aliases_shard:
            free_storage(self._unsharded_data)
        if self._grad_hook is not None:
            self.register_post_accumulate_hook(self._grad_hook)

    def set_compute_dtype(self, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """Change the dtype of gathering and compute (before first use: inherited policy)."""
        self.finish_unshard()  # a gather in flight writes the buffer about to be replaced
        if self.is_unsharded and not self.aliases_shard:
            raise RuntimeError(
                "a flat parameter group's compute dtype can only change while sharded"
            )
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self._allocate_unsharded()

    def set_gather_dtype(self, dtype: torch.dtype | None) -> None:
        """Gather in ``dtype`` (int8 or float8 with row scales, or a cast; None: the
        compute dtype) from now on ([Note: row-wise quantized all-gather]); while sharded."""
        self.finish_unshard()
        if self.is_unsharded and not self.aliases_shard:
            raise RuntimeError(
                "a flat parameter group's gather dtype can only change while sharded"
            )
        codec = None
        matrices = any(len(slot.shape) >= 2 for slot in self.layout.slots)
        if dtype is not None and dtype != self.compute_dtype and (matrices or dtype not in SCALED):
            codec = GatherCodec(self.layout, self.rank, dtype)  # vectors alone: unencoded
        self.transport = replace(self.transport, codec=codec)
        self._allocate_unsharded()

    # ------------------------------------------------------------------ unshard / reshard
    @property
    def is_unsharded(self) -> bool:
        """The buffer holds every rank's rows (waited for)."""
        return self.storage is Storage.GATHERED

    @property
    def gather_in_flight(self) -> bool:
        """An all-gather into the unsharded buffer was started and not yet waited for."""
        return self.storage is Storage.GATHERING

    @property
    def views_registered(self) -> bool:
        """The modules hold views of the buffer (or a row-sparse table's proxy)."""
        return self.holding is not Holding.ORIGINALS

    def _move(self, to: Storage) -> None:
        self.storage = storage_move(self.storage, to, self.originals[0].fqn)

    def start_unshard(self) -> None:
        """Start all-gathering the shards into the unsharded buffer, without waiting.

        Nothing if unsharded or already gathering, unless that buffer was gathered before
        the shard's last known write: it is dropped and gathered again. See [Note:
        asynchronous all-gather] and [Note: stale gathers].
        """
        self.drop_stale_gather()
        self.refresh()  # first: with F = 1 the shard is the unsharded buffer itself
        if self.storage is not Storage.SHARDED:
            return
        allocate_storage(self._unsharded_data, self._unsharded_nbytes)
        self._gathered_generation = self.generation
        part, self._part = self._part, None
        smaller = self.post_forward_group
        if part is not None and part[1] == self.generation and smaller is not None:
            # [Note: resharding to a smaller group after forward]: the part is decoded
            self._gather = self.transport.gather(
                self._unsharded_data, part[0], smaller, self.on_collective, encoded=False
            )
            self._move(Storage.GATHERING)
            return
        sent = self._kept_encoding()
        # Cast once per unshard (not once per op), before communicating; a codec encodes
        # from the master dtype.
        dtype = self.transport.source_dtype(self.shard.dtype, self.compute_dtype)
        source = self.shard
        if sent is None:
            source = source.to(self.compute_device, dtype, non_blocking=True, copy=self.offloaded)
        if self.groups.shard is None and self.transport.codec is None:
            self._unsharded_data.copy_(source)
            self._move(Storage.GATHERED)
            return
        self._gather = self.transport.gather(
            self._unsharded_data, source, self.groups.shard, self.on_collective, sent=sent
        )
        if self._gather.sent is not None:
            self._sent = _Encoding(self._gather.sent, self.generation, self.shard._version)
        self._move(Storage.GATHERING)

    def _kept_encoding(self) -> torch.Tensor | None:
        """The payload kept from forward, if the shard has not been written since.

        [Note: one encoding per write]
        A codec's payload depends on the shard alone, and under FULL_SHARD a unit is
        gathered twice between two writes of its shard (forward, backward). So the
        payload a forward gather sent is kept when the unit reshards after forward, and
        backward's gather sends it again: one encoding per step instead of two, for a
        payload per unit held from its forward to its backward (a quarter of the fp32
        shard for int8, half for bfloat16). It is used once, and only if the shard is as
        it was: the same generation (the writes flatshard knows of: optimizer steps,
        loads, write-backs) and the same version counter (torch counts every in-place
        write of the shard or a view of it)."""
        kept, self._encoded = self._encoded, None
        if kept is None or kept.generation != self.generation:
            return None
        return kept.payload if kept.version == self.shard._version else None

    def finish_unshard(self) -> None:
        """Wait for a started all-gather (and decode it); the buffer is then safe to read."""
        if self._gather is not None:
            gathering, self._gather = self._gather, None
            wait_work(gathering.work)
            if gathering.finish is not None:
                gathering.finish()
            self._move(Storage.GATHERED)

    def unshard(self) -> None:
        """All-gather the shards (unless unsharded) and register fresh views in the modules.

        Views are made anew on every call so that they follow the current grad mode. A
        buffer gathered before the shard's last known write is gathered again (see [Note:
        stale gathers]).
        """
        self.start_unshard()
        self.finish_unshard()
        self.register_views(self.views.full_views(self.unsharded))

    @property
    def holds_stale_gather(self) -> bool:
        """Whether the buffer was (or is being) gathered before the shard's last write."""
        return (
            self.storage is not Storage.SHARDED
            and not self.aliases_shard
            and self._gathered_generation != self.generation
        )

    def drop_stale_gather(self) -> None:
        """Free a buffer gathered before the shard's last known write (the modules get
        the original parameters back): the one place that rule is applied."""
        if self.holds_stale_gather:
            self.reshard()

    def shards_written(self) -> None:
        """The shard is about to be written (an optimizer step, a load, a write-back): what
        was gathered before is stale ([Note: stale gathers]). A gather still reading the
        shard is waited for first. Every rank calls it alike."""
        self.finish_unshard()
        self.generation += 1
        self._part = None  # cut from the old shards
        self._encoded = None

    def reshard_after_forward(self, backward_follows: bool) -> bool:
        """``reshard``, keeping this rank's part for its post-forward group if it has one
        ([Note: resharding to a smaller group after forward]), or, where a backward will
        gather the unit again, the codec's payload sent ([Note: one encoding per write]).
        Returns whether memory was freed."""
        self.finish_unshard()
        group = self.post_forward_group
        if group is not None and self.storage is Storage.GATHERED and not self.aliases_shard:
            parts = group.size()
            size = self.layout.unsharded_numel // parts
            start = group.rank() * size
            cut = self._unsharded_data[start : start + size].clone()
            self._part = (cut, self._gathered_generation)
        sent = self._sent
        freed = self.reshard()
        if backward_follows and sent is not None and group is None:
            self._encoded = sent  # for backward's gather ([Note: one encoding per write])
        return freed

    @property
    def unshard_allocates(self) -> bool:
        """Whether unsharding now would allocate the unsharded buffer (and gather into it)."""
        return self.storage is Storage.SHARDED

    def reshard(self) -> bool:
        """Free the unsharded buffer and register the original parameters again.

        Views of the buffer that autograd saved stay valid objects (see the note above).
        A prefetched all-gather still running is waited for first: its memory is in use.
        Returns whether memory was freed.
        """
        self.finish_unshard()
        freed = not self.aliases_shard and self.storage is Storage.GATHERED
        if freed:
            free_storage(self._unsharded_data)
            self._move(Storage.SHARDED)
        self._sent = None
        self.register_views(None)
        return freed

    # ------------------------------------------------------------------ views
    def use_sharded_data(self) -> None:
        """Point every original parameter's ``.data`` at its rows of the shard."""
        region = self.param_region
        for orig, view in zip(self.originals, self.param_views.shard_views(region), strict=True):
            orig.param.data = view

    def moved_originals(self) -> list[str]:
        """Names of the original parameters whose data is no longer in the shard (the
        model was moved or cast after sharding: ``param.data`` became a copy), or that
        their module holds another parameter for, on another device or in another dtype
        (``model.to("meta")``: ``nn.Module._apply`` replaces a parameter it cannot give
        new data in place, without the registration hooks that would report it)."""
        home = self.shard.untyped_storage().data_ptr()
        moved = []
        for orig in self.originals:
            if orig.param.numel() and orig.param.untyped_storage().data_ptr() != home:
                moved.append(orig.fqn)
            elif not self.views_registered:
                module, name = orig.usages[0]
                held = module._parameters.get(name)
                if (
                    held is not None
                    and held is not orig.param
                    and (held.device != orig.param.device or held.dtype != orig.param.dtype)
                ):
                    moved.append(orig.fqn)
        return moved

    def register_views(self, views: list[torch.Tensor] | None) -> None:
        """Put ``views`` (or, with None, the original parameters) in their modules.

        Writing ``module._parameters`` directly keeps the registration order, so
        ``named_parameters()`` and ``state_dict()`` keys never move.
        """
        if self._registrations is None:  # runs twice per unit and step: resolved once
            self._registrations = [
                (i, cast(dict[str, torch.Tensor], module._parameters), name)
                for i, orig in enumerate(self.originals)
                for module, name in orig.usages
            ]
        values = [o.param for o in self.originals] if views is None else self._as_used(views)
        for i, registry, name in self._registrations:
            registry[name] = values[i]
        self.holding = Holding.ORIGINALS if views is None else Holding.VIEWS
        self.placement.views_returned()

    def _as_used(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """DTensor parameters' views wrapped back into DTensors for their TP layers."""
        if not self.has_tp:
            return views
        return [
            tp.wrap(view) if (tp := orig.tp) is not None else view
            for orig, view in zip(self.originals, views, strict=True)
        ]

    # ------------------------------------------------------------------ gradients
    def take_grad(self) -> torch.Tensor:
        """The accumulated flat gradient (C * F,), zeros if none arrived; detached from it.

        Zeros keep every rank issuing the same collectives when a unit's gradient did not
        reach it on this rank (its outputs were unused in the loss here).
        """
        grad = self.unsharded.grad
        self.unsharded.grad = None
        if grad is None:
            grad = torch.zeros_like(self._unsharded_data, memory_format=torch.contiguous_format)
        return grad

    def accumulate_grad(self, grad: torch.Tensor) -> None:
        """Add a flat gradient (C * F,) computed outside autograd's accumulation (a split
        backward's weight pass) to the one backward passes accumulate."""
        if self.unsharded.grad is None:
            self.unsharded.grad = grad
        else:
            self.unsharded.grad += grad

    def drop_kept_gradients(self, zeroed: Collection[int]) -> None:
        """``zero_grad`` of the originals at indices ``zeroed``: their part of the
        gradients this group keeps unreduced goes with their ``.grad`` (the sum of backward
        passes with sync off; hybrid, a chunk owed to the replicas' all-reduce). See
        [Note: zero_grad drops kept gradients] in runtime/_torch_utilities.py."""
        reduction = self.reduction
        if not reduction.keeps_gradients or not zeroed:
            return
        if len(set(zeroed)) == len(self.originals):
            self.unsharded.grad = None
            reduction.drop_kept()
            self.placement.drop_pending()
            return
        kept = self.unsharded.grad
        if kept is not None:
            for index, view in enumerate(self.views.full_views(kept)):
                if index in zeroed:
                    view.zero_()
        if reduction.owed is not None:  # the F-chunk, laid out like the shard
            for index, view in enumerate(self.views.shard_views(reduction.owed)):
                if index in zeroed:
                    view.zero_()

    def add_to_grads(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk (C,: its region) to the originals' ``.grad``.

        In a whole-parameter layout a parameter another rank owns keeps ``.grad`` None here,
        so optimizers skip it: a matrix optimizer must not step on an empty slice (Adafactor
        divides by its size) and holds no state for it ([Note: whole-parameter layout]).
        """
        # The optimizer steps on the master shard: its dtype and device. Offloaded from an
        # accelerator the copy to the host runs behind the compute stream (into pinned
        # memory); the end of backward waits for it before anything on the host reads the
        # gradient ([Note: offload without a stall per unit] in runtime/_step.py).
        reduced = reduced.to(
            self.shard.device, self.shard.dtype, non_blocking=True, copy=self.offloaded
        )
        views = self.param_views.shard_views(reduced)
        for orig, view, owned in zip(self.originals, views, self.owned, strict=True):
            if not owned:
                continue
            if orig.param.grad is None:
                orig.param.grad = view
            else:
                orig.param.grad.add_(view)

    def register_post_accumulate_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Call ``hook(tensor)`` once autograd has accumulated the flat gradient."""
        # torch's stub leaves this method unannotated; the cast states its real signature.
        self._grad_hook = hook  # registered again if the leaf is ever re-created
        register = cast(
            Callable[[Callable[[torch.Tensor], None]], object],
            self.unsharded.register_post_accumulate_grad_hook,
        )
        register(hook)


def _ignore(kind: str, numel: int) -> Tag | None:
    """``on_collective`` of a group no unit watches (yet)."""
    return None
