"""FlatParameter: one flattened group of a unit's original parameters, and its storage.

A unit has one FlatParameter per (requires_grad, dtype, compute dtype) group of its
parameters, so frozen parameters never get gradient memory or a reduce-scatter.

[Note: FlatParameter tensors and their lifetimes]
- ``shard`` (C,): this rank's chunk; persistent. Every original parameter's ``.data`` is a
  view of its rows in it, so the optimizer updates the shard in place.
- ``_unsharded`` (C * F,), in the compute dtype and device: the autograd leaf that forward
  uses; original parameters are swapped for ``split`` + ``view`` views of it while the unit
  runs, so autograd accumulates one flat gradient for the whole group. Its storage is freed
  (resized to 0) while resharded and re-allocated by the next unshard. The storage object
  itself lives as long as the FlatParameter, so views saved by autograd for backward stay
  valid across reshard/unshard.
- ``_unsharded_data``: the same storage without autograd's version counter. The all-gather
  writes through it; writing through ``_unsharded`` would bump the version that autograd
  checks on saved views and make backward fail.
- The reduce-scatter output (C,) becomes the original parameters' ``.grad`` (views of it).
- The all-gather is asynchronous (see [Note: asynchronous all-gather]).
- With F = 1 (NO_SHARD, or a world of one) in the master dtype and device there is nothing
  to gather: ``_unsharded`` is a leaf sharing the shard's storage, never freed, and
  unshard/reshard only swap views (``aliases_shard``).

[Note: asynchronous all-gather]
``start_unshard`` allocates the unsharded buffer on the current stream, casts the shard and
issues the all-gather with ``async_op=True``; ``finish_unshard`` waits on the work handle.
Prefetch only starts; the unit's own hook finishes (and registers views), so the gather
runs while the current unit computes. On CPU (gloo) the collective runs in gloo's threads
and ``wait()`` blocks the CPU until the data is there. On CUDA (NCCL) it runs on NCCL's
internal stream and ``wait()`` makes the compute stream wait for it without blocking the
CPU; c10d records the buffers' use on that stream for the caching allocator, so freeing
the buffer later (``reshard``) cannot hand its memory to another tensor while NCCL still
writes it. The cast source is held until the wait for the same reason. The CPU may then
run ahead of the GPU; the rate limiter (``_rate_limiter.py``) bounds how far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from flatshard._collectives import (
    PendingReduction,
    all_gather_into,
    start_all_gather,
    start_reduction,
    wait_reduction,
    wait_work,
)
from flatshard._layout import FlatLayout, ShardRange, plan_layout, rows_shape
from flatshard._mesh import ShardGroups

CommHook = Callable[[torch.Tensor, ShardGroups], torch.Tensor]
"""Replaces a FlatParameter's gradient reduction: ``hook(grad, groups) -> shard``.

``grad`` is the unsharded flat gradient (C * F,) summed over this rank's backward passes;
the hook returns this rank's chunk (C,), averaged over all ``groups.world_size`` ranks, in
``grad``'s dtype. It must issue the same collectives on every rank.
"""


@dataclass
class OriginalParam:
    """One of the user's parameters, with every place a module registers it (ties)."""

    param: nn.Parameter
    fqn: str  # its first name in the model
    usages: list[tuple[nn.Module, str]] = field(default_factory=list)


class FlatParameter:
    """A group of original parameters flattened into one row-aligned buffer and sharded."""

    def __init__(
        self,
        originals: list[OriginalParam],
        groups: ShardGroups,
        device: torch.device,
        *,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        compute_device: torch.device | None = None,
    ) -> None:
        """Plan the layout and allocate this rank's (zero) shard on ``device``.

        Nothing full-size stays allocated: the originals may still be on the meta device.
        ``load_shard`` then copies this rank's rows out of the materialized originals.
        ``compute_dtype`` / ``compute_device``: where the unsharded parameters live
        (mixed precision; CPU offload keeps the shard on ``device`` = CPU).
        """
        first = originals[0].param
        self.originals = originals
        self.groups = groups
        self.rank = groups.shard_rank
        self.world_size = groups.shard_size  # F: ranks the buffer is cut across
        self.requires_grad = first.requires_grad
        self.layout: FlatLayout = plan_layout([o.param.shape for o in originals], self.world_size)
        # Asked for on every unshard and reduction: computed once. Each original is one
        # piece of a split of the buffer (empty gaps left out: in forward each piece is a
        # view, in backward a zero-filled input of the split's cat).
        slots = self.layout.slots
        self._held = [self.layout.shard_range(slot, self.rank) for slot in slots]
        self._segment_sizes, self._param_segments = _pieces(
            [(slot.offset, slot.numel) for slot in slots], self.layout.unsharded_numel
        )
        self._shard_sizes, self._shard_pieces = _pieces(
            [(held.local_offset, held.numel) for held in self._held], self.layout.shard_numel
        )
        self._shard_shapes = [
            rows_shape(slot.shape, held.rows) for slot, held in zip(slots, self._held, strict=True)
        ]
        self.comm_hook: CommHook | None = None
        self.compute_dtype = compute_dtype or first.dtype
        self.compute_device = compute_device or device
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # Persistent: this rank's shard; original parameters are views of it.
        # Pinned when offloaded from an accelerator: host-to-device copies run async.
        pin = device.type == "cpu" and self.compute_device.type != "cpu"
        self.shard = torch.zeros(
            self.layout.shard_numel, dtype=first.dtype, device=device, pin_memory=pin
        )
        self._grad_hook: Callable[[torch.Tensor], None] | None = None
        # (original's index, its module's parameter dict, its name there), on first use.
        self._registrations: list[tuple[int, dict[str, torch.Tensor], str]] | None = None
        self._gather: tuple[dist.Work, torch.Tensor] | None = None  # started, not waited
        self._allocate_unsharded()
        # Per backward pass: the reduction in flight, and whether this pass's gradient
        # has been dealt with (reduced, or kept for later under no_sync).
        self.pending: PendingReduction | None = None
        self.grad_done_in_backward = False

    def load_shard(self) -> None:
        """Copy this rank's rows of the (full) originals into the shard; they become views."""
        for orig, slot, held in zip(self.originals, self.layout.slots, self._held, strict=True):
            start = held.first_row * slot.row_numel
            source = orig.param.detach().reshape(-1)[start : start + held.numel]
            self.shard[held.local_offset : held.local_offset + held.numel].copy_(source)
        self.use_sharded_data()

    @property
    def gathers(self) -> bool:
        """Whether unsharding needs an all-gather (F > 1)."""
        return self.groups.shard is not None

    @property
    def aliases_shard(self) -> bool:
        """F = 1 in the master dtype and device: the shard itself is the unsharded buffer."""
        return (
            not self.gathers
            and self.compute_dtype == self.shard.dtype
            and self.compute_device == self.shard.device
        )

    def _allocate_unsharded(self) -> None:
        """Create the unsharded leaf (C * F,), alive only while unsharded (see the note)."""
        if self.aliases_shard:
            self._unsharded = self.shard.detach().requires_grad_(self.requires_grad)
        else:
            self._unsharded = torch.empty(
                self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.compute_device
            ).requires_grad_(self.requires_grad)
        self._unsharded_data = self._unsharded.data
        self._unsharded_nbytes = self._unsharded.untyped_storage().nbytes()
        self.is_unsharded = self.aliases_shard
        if not self.aliases_shard:
            self._unsharded_data.untyped_storage().resize_(0)
        if self._grad_hook is not None:
            self.register_post_accumulate_hook(self._grad_hook)

    def set_compute_dtype(self, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """Change the dtype of gathering and compute (before first use: inherited policy)."""
        if self.is_unsharded and not self.aliases_shard:
            raise RuntimeError("a FlatParameter's compute dtype can only change while sharded")
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self._allocate_unsharded()

    # ------------------------------------------------------------------ storage
    @property
    def gathering(self) -> bool:
        """An all-gather into the unsharded buffer was started and not yet waited for."""
        return self._gather is not None

    def start_unshard(self) -> None:
        """Start all-gathering the shards into the unsharded buffer, without waiting.

        Nothing if unsharded or already gathering. See [Note: asynchronous all-gather].
        """
        if self.is_unsharded or self._gather is not None:
            return
        self._unsharded_data.untyped_storage().resize_(self._unsharded_nbytes)
        # Cast once per unshard (not once per op), before communicating.
        source = self.shard.to(self.compute_device, self.compute_dtype, non_blocking=True)
        if self.groups.shard is None:
            self._unsharded_data.copy_(source)
            self.is_unsharded = True
            return
        work = start_all_gather(self._unsharded_data, source, self.groups.shard)
        self._gather = (work, source)  # the source must outlive the collective

    def finish_unshard(self) -> None:
        """Wait for a started all-gather; the buffer is then safe to read."""
        if self._gather is not None:
            wait_work(self._gather[0])
            self._gather = None
            self.is_unsharded = True

    def unshard(self) -> None:
        """All-gather the shards (unless unsharded) and register fresh views in the modules.

        Views are made anew on every call so that they follow the current grad mode.
        """
        self.start_unshard()
        self.finish_unshard()
        self.register_views(self.unsharded_views())

    @property
    def unshard_allocates(self) -> bool:
        """Whether unsharding now would allocate the unsharded buffer (and gather into it)."""
        return not (self.is_unsharded or self.aliases_shard or self._gather is not None)

    def reshard(self) -> bool:
        """Free the unsharded buffer and register the original parameters again.

        Views of the buffer that autograd saved stay valid objects (see the note above).
        A prefetched all-gather still running is waited for first: its memory is in use.
        Returns whether memory was freed.
        """
        self.finish_unshard()
        freed = not self.aliases_shard and self.is_unsharded
        if freed:
            self._unsharded_data.untyped_storage().resize_(0)
            self.is_unsharded = False
        self.register_views(None)
        return freed

    # ------------------------------------------------------------------ views
    def unsharded_views(self) -> list[torch.Tensor]:
        """Autograd-visible full-shape views of the unsharded buffer, one per original."""
        return self._full_views(self._unsharded)

    def _full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Full-shape views of each original in a (C * F,) tensor laid out like the buffer."""
        pieces = torch.split(full, self._segment_sizes)
        return [
            _shaped(pieces[piece], slot.shape)
            for piece, slot in zip(self._param_segments, self.layout.slots, strict=True)
        ]

    def shard_views(self, flat_shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of each original's rows in a (C,) tensor laid out like ``shard``."""
        pieces = torch.split(flat_shard, self._shard_sizes)
        return [
            _shaped(pieces[piece], shape)
            for piece, shape in zip(self._shard_pieces, self._shard_shapes, strict=True)
        ]

    def use_sharded_data(self) -> None:
        """Point every original parameter's ``.data`` at its rows of the shard."""
        for orig, view in zip(self.originals, self.shard_views(self.shard), strict=True):
            orig.param.data = view

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
        values = [o.param for o in self.originals] if views is None else views
        for i, registry, name in self._registrations:
            registry[name] = values[i]

    # ------------------------------------------------------------------ gradients
    def start_reduction(self) -> None:
        """Reduce the accumulated unsharded gradient (zeros if none arrived).

        Zeros keep every rank issuing the same collectives when a unit's gradient did not
        reach it on this rank (its outputs were unused in the loss here).
        """
        grad = self._unsharded.grad
        self._unsharded.grad = None
        if grad is None:
            grad = torch.zeros_like(self._unsharded_data, memory_format=torch.contiguous_format)
        if self.pending is not None:
            self.finish_reduction()
        grad = grad.to(self.reduce_dtype).contiguous()
        if self.comm_hook is not None:
            reduced = self.comm_hook(grad, self.groups)
            self.pending = PendingReduction(work=None, input=grad, output=reduced)
        else:
            self.pending = start_reduction(grad, self.groups)
        self.grad_done_in_backward = True

    def keep_unreduced(self) -> None:
        """no_sync: leave the flat gradient to accumulate until a synchronized backward."""
        self.grad_done_in_backward = True

    def finish_reduction(self) -> None:
        """Wait for the reduce-scatter and add the result to the originals' ``.grad``."""
        if self.pending is None:
            return
        reduced = wait_reduction(self.pending)  # (C,)
        self.pending = None
        # The optimizer steps on the master shard: its dtype and device.
        # Blocking: the optimizer may read it on the CPU right after (offload).
        reduced = reduced.to(self.shard.device, self.shard.dtype)
        for orig, view in zip(self.originals, self.shard_views(reduced), strict=True):
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
            self._unsharded.register_post_accumulate_grad_hook,
        )
        register(hook)

    # ------------------------------------------------------------------ full parameters
    @contextmanager
    def full_params(self, writeback: bool) -> Iterator[None]:
        """Give every original parameter its full shape and value on every rank."""
        # In the master dtype.
        full, views = self.gather_full(self.shard)
        for orig, view in zip(self.originals, views, strict=True):
            orig.param.data = view
        try:
            yield
        finally:
            if writeback:
                self._write_back(full, views)
            self.use_sharded_data()

    def gather_full(self, flat_shard: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """All-gather a (C,) tensor laid out like ``shard``; return it and full-shape views.

        A collective over the shard group. Used for parameters (the shard itself) and for
        anything shaped like them, such as optimizer moments packed by ``pack_rows``.
        """
        # Gathered on the compute device: NCCL cannot gather CPU shards when offloading.
        full = torch.empty(
            self.layout.unsharded_numel, dtype=flat_shard.dtype, device=self.compute_device
        )  # (C * F,)
        source = flat_shard.to(self.compute_device)
        if self.groups.shard is None:
            full.copy_(source)
        else:
            all_gather_into(full, source, self.groups.shard)
        return full, self._full_views(full)

    def pack_rows(self, local_rows: list[torch.Tensor]) -> torch.Tensor:
        """Lay tensors shaped like each original's held rows out like ``shard`` (C,)."""
        flat = torch.zeros(
            self.layout.shard_numel, dtype=local_rows[0].dtype, device=self.shard.device
        )
        for view, rows in zip(self.shard_views(flat), local_rows, strict=True):
            view.copy_(rows)
        return flat

    def held_rows(self, index: int) -> ShardRange:
        """The rows of original ``index`` that this rank's shard holds."""
        return self._held[index]

    def _write_back(self, full: torch.Tensor, views: list[torch.Tensor]) -> None:
        for orig, view in zip(self.originals, views, strict=True):
            if orig.param.data_ptr() != view.data_ptr():  # the user replaced ``.data``
                view.copy_(orig.param.data)
        chunk = self.layout.shard_numel
        self.shard.copy_(full[self.rank * chunk : (self.rank + 1) * chunk])


def _pieces(ranges: list[tuple[int, int]], total: int) -> tuple[list[int], list[int]]:
    """Split sizes covering ``total`` elements, and the piece of each (offset, numel) range.

    Ranges come in offset order; the gaps between them become pieces of their own, empty
    ones are left out (an empty range, e.g. rows a rank does not hold, is an empty piece).
    """
    sizes: list[int] = []
    pieces: list[int] = []
    cursor = 0
    for offset, numel in ranges:
        if numel and offset > cursor:
            sizes.append(offset - cursor)
            cursor = offset
        pieces.append(len(sizes))
        sizes.append(numel)
        cursor += numel
    if total > cursor:
        sizes.append(total - cursor)
    return sizes, pieces


def _shaped(piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``piece`` viewed as ``shape``; as it is when it already has it (no extra view)."""
    return piece if piece.shape == shape else piece.view(shape)
