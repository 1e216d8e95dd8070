"""The row-aligned layout, in one process: no chunk boundary cuts a row."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flatshard.report import FlatLayout, row_layout
from flatshard.testing.internals import ViewSplits


def check_invariants(layout: FlatLayout) -> None:
    """Params are in order, disjoint, inside the buffer, and chunks cut only between rows."""
    cursor = 0
    for slot in layout.slots:
        assert slot.offset >= cursor
        cursor = slot.end
        for rank in range(layout.factor):
            boundary = rank * layout.shard_numel
            if slot.offset < boundary < slot.end:
                assert (boundary - slot.offset) % slot.row_numel == 0, (slot, boundary)
    assert cursor <= layout.unsharded_numel
    # Each rank's pieces together are exactly the parameter.
    for slot in layout.slots:
        held = [layout.shard_range(slot, r) for r in range(layout.factor)]
        assert sum(h.numel for h in held) == slot.numel
        assert sum(h.rows for h in held) == slot.rows


SHAPES = [
    [(3, 4), (5,), ()],
    [(7, 13), (13,), (13, 11), (11,), (1,)],
    [(37, 16), (9, 16), (48, 16), (48,), (16, 16), (16,), (64, 16), (64,), (16, 64), (16,)],
    [(0, 5), (4, 3), (), (), (2, 2, 2)],
    [(1000, 3), (7,), (3, 1000)],
]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("factor", [1, 2, 3, 4, 8])
def test_invariants(shapes: list[tuple[int, ...]], factor: int) -> None:
    layout = row_layout([torch.Size(s) for s in shapes], factor)
    check_invariants(layout)
    assert layout.param_numel == sum(math.prod(s) for s in shapes)
    assert layout.unsharded_numel % factor == 0
    assert layout.padding_numel >= layout.alignment_padding_numel >= 0


def test_hand_computed_layout() -> None:
    # 18 elements at W=2: C=9 would cut the (3, 4) matrix mid-row at 9, and padding it by
    # one pushes the total to 19 > 18, so C becomes 10 and the matrix starts at 2.
    layout = row_layout([torch.Size((3, 4)), torch.Size((5,)), torch.Size(())], 2)
    assert layout.shard_numel == 10
    assert [s.offset for s in layout.slots] == [2, 14, 19]
    assert layout.alignment_padding_numel == 2  # 20 - ceil(18 / 2) * 2
    matrix = layout.slots[0]
    assert layout.shard_range(matrix, 0).rows == 2  # rows 0-1 in elements 2..9
    assert layout.shard_range(matrix, 1).first_row == 2
    assert layout.shard_range(matrix, 1).rows == 1


def test_paper_layout_when_rows_fit() -> None:
    # 1-D parameters have rows of one element: no alignment padding at all.
    layout = row_layout([torch.Size((10,)), torch.Size((7,))], 3)
    assert layout.shard_numel == 6
    assert layout.alignment_padding_numel == 0
    assert [s.offset for s in layout.slots] == [0, 10]


def test_zero_row_shards() -> None:
    # A small matrix at the start sits wholly on rank 0; later ranks hold no rows of it.
    layout = row_layout([torch.Size((2, 3)), torch.Size((30,))], 3)
    small = layout.slots[0]
    assert layout.shard_range(small, 0).rows == 2
    assert layout.shard_range(small, 1).rows == 0
    assert layout.shard_range(small, 2).rows == 0


def test_parameter_spanning_many_chunks_forces_row_multiple() -> None:
    layout = row_layout([torch.Size((100, 7))], 4)
    assert layout.shard_numel % 7 == 0
    assert layout.shard_numel == 175  # 700 / 4 = 175 = 25 rows of 7
    assert layout.alignment_padding_numel == 0


@pytest.mark.parametrize("factor", [2, 3, 4, 8])
def test_transformer_block_waste_is_at_most_one_row_per_chunk(factor: int) -> None:
    d = 64
    shapes = [
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
    ]
    layout = row_layout([torch.Size(s) for s in shapes], factor)
    check_invariants(layout)
    widest_row = 4 * d
    assert layout.alignment_padding_numel <= factor * widest_row


def test_rejects_bad_sharding_factor() -> None:
    with pytest.raises(ValueError, match="sharding factor F must be >= 1, got 0"):
        row_layout([torch.Size((2,))], 0)


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("factor", [1, 2, 3, 4, 8])
def test_whole_layout_cuts_no_parameter(shapes: list[tuple[int, ...]], factor: int) -> None:
    layout = row_layout([torch.Size(s) for s in shapes], factor, whole=True)
    assert layout.whole
    loads = [0] * factor
    for slot in layout.slots:
        owners = [r for r in range(factor) if layout.shard_range(slot, r).numel]
        assert len(owners) == (1 if slot.numel else 0), (slot, owners)
        if owners:
            assert layout.shard_range(slot, owners[0]).rows == slot.rows  # all of it
            loads[owners[0]] += slot.numel
    # Disjoint, inside the buffer: each chunk holds its owned parameters end to end.
    spans = sorted((s.offset, s.end) for s in layout.slots if s.numel)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert layout.shard_numel == max(1, *loads)  # C is the largest load: no other padding


def test_whole_layout_by_hand() -> None:
    # Largest first to the least loaded rank: 12 -> rank 0, 9 -> 1, 5 -> 1 (9 < 12),
    # 1 -> 0 (12 < 14); C = 14, and inside a chunk the parameters keep their order.
    shapes = [torch.Size(s) for s in [(3, 4), (5,), (), (3, 3)]]
    layout = row_layout(shapes, 2, whole=True)
    assert layout.shard_numel == 14
    assert [s.offset for s in layout.slots] == [0, 14 + 0, 12, 14 + 5]
    assert layout.alignment_padding_numel == 28 - 28  # 27 elements: ceil(27 / 2) * 2 = 28
    views = ViewSplits(layout, 1)
    shard = torch.arange(14.0)
    matrix, vector, scalar, square = views.shard_views(shard)
    assert matrix.shape == (0, 4) and scalar.shape == (0,)
    assert torch.equal(vector, torch.arange(5.0))
    assert torch.equal(square, torch.arange(5.0, 14.0).view(3, 3))
    full = ViewSplits(layout, 0).full_views(torch.arange(28.0))
    assert torch.equal(full[1], torch.arange(14.0, 19.0))
    assert torch.equal(full[2], torch.tensor(12.0))
