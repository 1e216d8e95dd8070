"""Layout math of the row-aligned FlatParameter: no process groups, no autograd.

See [Note: row-aligned layout]. Everything here is pure arithmetic on shapes, so it is
unit-tested in one process.

[Note: row-aligned layout]
The paper flattens a unit's parameters param-major into one 1-D buffer, pads the end to a
multiple of the sharding factor W and cuts it into W equal chunks of C elements; rank r keeps
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
    """Placement of a group of parameters in a FlatParameter sharded over W ranks."""

    slots: tuple[ParamSlot, ...]
    world_size: int
    shard_numel: int  # C: elements per rank

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        """All padding: alignment gaps plus the tail."""
        return self.unsharded_numel - self.param_numel

    @property
    def alignment_padding_numel(self) -> int:
        """Padding beyond what the paper's layout needs (ceil to a multiple of W)."""
        return self.unsharded_numel - _ceil_div(self.param_numel, self.world_size) * self.world_size

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

    def segment_sizes(self) -> list[int]:
        """Sizes that split the unsharded buffer into [gap, param, gap, param, ..., tail]."""
        sizes: list[int] = []
        cursor = 0
        for slot in self.slots:
            sizes += [slot.offset - cursor, slot.numel]
            cursor = slot.end
        sizes.append(self.unsharded_numel - cursor)
        return sizes


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


def plan_layout(shapes: Sequence[torch.Size], world_size: int) -> FlatLayout:
    """Lay out ``shapes`` param-major so that every chunk boundary falls between rows."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(math.prod(s) for s in shapes)
    shard_numel = max(1, _ceil_div(total, world_size))
    while True:
        attempt = _try_layout(shapes, world_size, shard_numel)
        if isinstance(attempt, FlatLayout):
            return attempt
        shard_numel = attempt  # a larger C that the next attempt must use


def _try_layout(
    shapes: Sequence[torch.Size], world_size: int, shard_numel: int
) -> FlatLayout | int:
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
    if cursor > shard_numel * world_size:
        return _ceil_div(cursor, world_size)
    return FlatLayout(slots=tuple(slots), world_size=world_size, shard_numel=shard_numel)


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
