"""Layout math of the row-aligned flat parameter group: no process groups, no autograd.

See [Note: row-aligned layout]. Everything here is arithmetic on shapes (and views by
it), so it is unit-tested in one process.

[Note: row-aligned layout]
The paper flattens a unit's parameters param-major into one 1-D buffer, pads the end to a
multiple of the sharding factor F and cuts it into F equal chunks of C elements; rank r keeps
chunk r. The all-gather output then *is* the unsharded buffer (zero copies). Its weak spot: a
chunk boundary can cut through the middle of a row, so a rank's part of a parameter is a
ragged 1-D slice and code such as ``p.dim() >= 2`` breaks.

We keep param-major order but insert padding so that no chunk boundary cuts a row (a row is
``numel // shape[0]`` elements; a scalar is one row of one element):
- before a parameter that straddles a boundary, pad just enough (< one row) that the boundary
  falls between two of its rows;
- a parameter that straddles two or more boundaries additionally needs C to be a multiple of
  its row length, so we round C up to one and lay out again (C only grows, so this ends).
Each rank's slice of a parameter is then whole rows: a real view ``[rows, *shape[1:]]``,
possibly with zero rows. The waste is reported as ``alignment_padding_numel``.

[Note: whole-parameter layout]
A matrix optimizer (Muon, Adafactor, Shampoo) updates each parameter from the whole of it,
so any cut into rows changes its update. ``row_layout(..., whole=True)`` cuts no parameter:
each one lies in exactly one rank's chunk, its owner. Owners are chosen largest parameter
first, each to the least loaded rank so far (ties: the lowest rank), and C is the largest
load; inside a chunk the owned parameters keep their order. The unsharded buffer is still
the all-gather output (each parameter a contiguous view of it), but parameters are no
longer in offset order across chunks, and shards are as uneven as the parameters are: the
padding up to the largest load is the price (``alignment_padding_numel``), paid in shard
memory and in all-gather and reduce-scatter bytes. Every rank computes the same owners from
the same shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lies in the unsharded flat buffer."""

    shape: torch.Size
    offset: int  # first element in the unsharded buffer
    numel: int
    row_numel: int  # elements per row: numel // shape[0]; 1 for scalars

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def rows(self) -> int:
        return 0 if self.numel == 0 else self.numel // self.row_numel


@dataclass(frozen=True)
class ShardRange:
    """The rows of one parameter that one rank's shard holds."""

    local_offset: int  # first element inside the rank's shard
    numel: int
    first_row: int  # index of the first held row in the full parameter
    rows: int


@dataclass(frozen=True)
class FlatLayout:
    """Placement of a group of parameters in a flat buffer cut across F ranks."""

    slots: tuple[ParamSlot, ...]
    factor: int  # F: ranks the buffer is cut across
    shard_numel: int  # C: elements per rank
    whole: bool = False  # each parameter in one rank's chunk ([Note: whole-parameter layout])

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.factor

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        """All padding: alignment gaps plus the tail."""
        return self.unsharded_numel - self.param_numel

    @property
    def alignment_padding_numel(self) -> int:
        """Padding beyond what the paper's layout needs (ceil to a multiple of F)."""
        return self.unsharded_numel - _ceil_div(self.param_numel, self.factor) * self.factor

    def shard_range(self, slot: ParamSlot, rank: int) -> ShardRange:
        """The whole rows of ``slot`` that ``rank`` holds (maybe none)."""
        chunk_start = rank * self.shard_numel
        lo = max(slot.offset, chunk_start)
        hi = min(slot.end, chunk_start + self.shard_numel)
        if hi <= lo:
            return ShardRange(local_offset=0, numel=0, first_row=0, rows=0)
        return ShardRange(
            local_offset=lo - chunk_start,
            numel=hi - lo,
            first_row=(lo - slot.offset) // slot.row_numel,
            rows=(hi - lo) // slot.row_numel,
        )


def rows_shape(full_shape: torch.Size, rows: int) -> torch.Size:
    """The shape of ``rows`` rows of a parameter (a scalar is one row: () held, (0,) not)."""
    if len(full_shape) == 0:
        return torch.Size([]) if rows else torch.Size([0])
    return torch.Size([rows, *full_shape[1:]])


def row_numel(shape: torch.Size) -> int:
    """Elements per row: a row is one index along dim 0; a scalar is one row of one."""
    if len(shape) == 0:
        return 1
    return max(1, math.prod(shape[1:]))


def row_layout(shapes: Sequence[torch.Size], factor: int, *, whole: bool = False) -> FlatLayout:
    """Lay out ``shapes`` param-major, cut across F = ``factor`` ranks between rows; with
    ``whole``, each parameter whole in one rank's chunk ([Note: whole-parameter layout])."""
    if factor < 1:
        raise ValueError(f"the sharding factor F must be >= 1, got {factor}")
    if whole:
        return _whole_layout(shapes, factor)
    total = sum(math.prod(s) for s in shapes)
    shard_numel = max(1, _ceil_div(total, factor))
    while True:
        attempt = _try_layout(shapes, factor, shard_numel)
        if isinstance(attempt, FlatLayout):
            return attempt
        shard_numel = attempt  # a larger C that the next attempt must use


def _try_layout(shapes: Sequence[torch.Size], factor: int, shard_numel: int) -> FlatLayout | int:
    """The layout for chunk size C, or a larger C to retry with."""
    slots: list[ParamSlot] = []
    cursor = 0
    for shape in shapes:
        numel, rown = math.prod(shape), row_numel(shape)
        offset = cursor
        if _boundaries_inside(offset, numel, shard_numel):
            next_boundary = (offset // shard_numel + 1) * shard_numel
            offset += (next_boundary - offset) % rown
            if not _rows_aligned(offset, numel, rown, shard_numel):
                return _ceil_div(shard_numel, rown) * rown
        slots.append(ParamSlot(shape=shape, offset=offset, numel=numel, row_numel=rown))
        cursor = offset + numel
    if cursor > shard_numel * factor:
        return _ceil_div(cursor, factor)
    return FlatLayout(slots=tuple(slots), factor=factor, shard_numel=shard_numel)


def _whole_layout(shapes: Sequence[torch.Size], factor: int) -> FlatLayout:
    """Each parameter in one chunk, largest first to the least loaded rank."""
    numels = [math.prod(shape) for shape in shapes]
    loads = [0] * factor
    owner = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: -numels[i]):  # stable: ties in order
        rank = min(range(factor), key=lambda r: loads[r])
        owner[index] = rank
        loads[rank] += numels[index]
    shard_numel = max(1, *loads)
    cursors = [rank * shard_numel for rank in range(factor)]
    slots = []
    for shape, numel, rank in zip(shapes, numels, owner, strict=True):
        slots.append(
            ParamSlot(shape=shape, offset=cursors[rank], numel=numel, row_numel=row_numel(shape))
        )
        cursors[rank] += numel
    return FlatLayout(slots=tuple(slots), factor=factor, shard_numel=shard_numel, whole=True)


def _rows_aligned(offset: int, numel: int, rown: int, chunk: int) -> bool:
    """Whether every chunk boundary inside the parameter falls between two of its rows."""
    inside = _boundaries_inside(offset, numel, chunk)
    if inside == 0:
        return True
    first = (offset // chunk + 1) * chunk
    return (first - offset) % rown == 0 and (inside == 1 or chunk % rown == 0)


def _boundaries_inside(offset: int, numel: int, chunk: int) -> int:
    """How many chunk boundaries lie strictly inside [offset, offset + numel)."""
    if numel <= 1:
        return 0
    return (offset + numel - 1) // chunk - offset // chunk


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ViewSplits:
    """How one rank's flat tensors split into per-parameter views, computed once.

    Asked for on every unshard and reduction. Each original is one piece of a split of a
    flat tensor; the gaps between originals are pieces of their own, empty ones left out
    (in forward each piece is a view, in backward a zero-filled input of the split's cat).
    """

    def __init__(self, layout: FlatLayout, rank: int) -> None:
        self.layout = layout
        self.held = [layout.shard_range(slot, rank) for slot in layout.slots]
        self._full_sizes, self._full_pieces = _pieces(
            [(slot.offset, slot.numel) for slot in layout.slots], layout.unsharded_numel
        )
        self._shard_sizes, self._shard_pieces = _pieces(
            [(held.local_offset, held.numel) for held in self.held], layout.shard_numel
        )
        self._shard_shapes = [
            rows_shape(slot.shape, held.rows)
            for slot, held in zip(layout.slots, self.held, strict=True)
        ]

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Full-shape views of each original in a (C * F,) tensor laid out like the buffer."""
        pieces = torch.split(full, self._full_sizes)
        return [
            _shaped(pieces[piece], slot.shape)
            for piece, slot in zip(self._full_pieces, self.layout.slots, strict=True)
        ]

    def shard_views(self, flat_shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of each original's rows in a (C,) tensor laid out like the shard."""
        pieces = torch.split(flat_shard, self._shard_sizes)
        return [
            _shaped(pieces[piece], shape)
            for piece, shape in zip(self._shard_pieces, self._shard_shapes, strict=True)
        ]


def _pieces(ranges: list[tuple[int, int]], total: int) -> tuple[list[int], list[int]]:
    """Split sizes covering ``total`` elements, and the piece of each (offset, numel) range.

    Ranges may come in any order (a whole-parameter layout's are not in offset order); the
    gaps between them become pieces of their own, empty ones are left out (an empty range,
    e.g. rows a rank does not hold, is an empty piece).
    """
    sizes: list[int] = []
    pieces = [0] * len(ranges)
    cursor = 0
    for index in sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1])):
        offset, numel = ranges[index]
        if numel and offset > cursor:
            sizes.append(offset - cursor)
            cursor = offset
        pieces[index] = len(sizes)
        sizes.append(numel)
        cursor += numel
    if total > cursor:
        sizes.append(total - cursor)
    return sizes, pieces


def _shaped(piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``piece`` viewed as ``shape``; as it is when it already has it (no extra view)."""
    return piece if piece.shape == shape else piece.view(shape)
