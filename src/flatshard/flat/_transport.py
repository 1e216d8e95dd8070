"""The transport of a flat group's payloads, and the codec its gathers may encode them with.

A flat group issues its all-gather (``FlatParamGroup.start_unshard``) and its gradient
reduction (``GradientReduction.start``) through its ``Transport``. Without a codec it sends
the tensors as they are: the shard in the compute dtype, the gradient in the reduce dtype.
With one (``codec``: one byte per weight with row-wise scales, or a cast; ``GatherCodec``
below) ``gather`` sends this rank's encoded shard and decodes every rank's
into ``unsharded`` when its work is waited for, so the unit, the runtime and the state
layers never see the encoding. Gradients travel unencoded.
The collectives themselves are torch's, or a user's (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``): ``all_gather`` and ``reduce_scatter``; reductions inside the
shard group may take a group of their own (``reduce_group``, [Note: reductions on their
own group] in ``comm/_mesh.py``).

The codec (``GatherCodec``) makes gathers that send fewer bytes than the compute dtype:
one byte per weight with a scale per row (int8, float8), or a plain cast (bfloat16,
float16); ``MixedPrecision(gather_dtype=...)`` for the units of a ``fully_shard`` call,
``Rows(gather_dtype=...)`` per parameter.

[Note: row-wise quantized all-gather]
Each rank holds whole rows of every parameter ([Note: row-aligned layout]), so it can
quantize its rows with one scale per row from its own shard, with no collective for the
scales (per-tensor schemes all-reduce every tensor's amax first), and the result does not
depend on how the rows are cut across ranks: the weights a unit computes with are the same
function of the master weights at every world size. For a row ``x`` of a parameter of two
or more dimensions (a row is ``numel // shape[0]`` elements), in float32::

    scale = amax(|x|) / QMAX               (1 where that is 0, NaN where x holds a NaN or
                                            an infinity; QMAX: 127 for int8, 448 for
                                            float8_e4m3fn, 57344 for float8_e5m2)
    q     = clamp(x / scale, -QMAX, QMAX)  (int8: rounded to nearest first), sent as the
                                            gather dtype
    x'    = (float32(q) * scale)            cast to the compute dtype

A row holding a NaN or an infinity arrives as NaN in every element: a non-finite weight
shows in the loss as it would unquantized, instead of hiding behind a scale of 1 (an int8
cast of NaN is undefined, so the scale carries it).

Vectors and scalars (a row of one element: biases, norm weights) would need a scale per
element, more bytes than they save, so they travel in the compute dtype beside the rows.
A rank's payload is one byte tensor: its scales (float32), its vectors' elements, its
quantized rows (one byte per element of its shard), each part padded to 8 bytes and
sized for the rank that has the most, so that every rank sends the same number of bytes
and the all-gather stays one collective of bytes (any backend can send bytes, whatever the
gather dtype). The quantized part holds one byte per element of the shard, at the
element's own position (the bytes at vectors and padding zero), so the F payloads' parts
side by side are the unsharded buffer's layout. A cast dtype (bfloat16, float16) sends
the whole shard cast, and decoding casts it back in one op.

[Note: one decode for every rank]
A decode's launches do not grow with the ranks: one cast of every rank's quantized part
into the unsharded buffer (exact: int8 and fp8 values are exact in every compute dtype;
padding arrives as zeros), the scales of every rank put in the parameters' row order by
one index, one in-place scaling per parameter over all ranks' rows at once (a parameter's
rows are one contiguous run of the buffer, rank after rank), and the vectors moved by one
index. The product is computed in float32 and rounded once, as ``float32(q) * scale``
cast to the compute dtype is, bit for bit. The indices are built once per group and
device; no temporary is larger than the scales and vectors.

A shard is encoded once per write: backward's gather sends the payload forward's sent
where the shard is as it was ([Note: one encoding per write] in ``_flat_param.py``: the
writes flatshard knows of, and torch's version counter for the others). Gradients are
those of the decoded weights, applied to the master weights (straight-through), and
reduced as always (``reduce_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from flatshard.comm._collectives import (
    AllGatherComm,
    PendingReduction,
    ReduceScatterComm,
    reduce_gradient,
    start_all_gather,
)
from flatshard.comm._mesh import ShardGroups
from flatshard.comm._watchdog import Tag
from flatshard.flat._layout import FlatLayout


class Gathering(NamedTuple):
    """An all-gather in flight: ``held`` stays alive until ``work`` is waited for (the
    collective reads and writes them), then ``finish`` (if any) decodes."""

    work: dist.Work | None  # None: nothing to wait for
    held: tuple[torch.Tensor, ...]
    finish: Callable[[], None] | None = None
    sent: torch.Tensor | None = None  # this rank's payload, where a codec encoded the shard


@dataclass(frozen=True)
class Transport:
    """Sends a group's payloads, encoded by ``codec`` (None: unchanged), by torch's
    collectives or the user's given here (None: torch's)."""

    all_gather: AllGatherComm | None = None
    reduce_scatter: ReduceScatterComm | None = None  # the one inside the shard group
    reduce_group: dist.ProcessGroup | None = None  # the shard group's twin for reductions
    codec: GatherCodec | None = None  # how parameters are encoded for their all-gather

    def source_dtype(self, master: torch.dtype, compute: torch.dtype) -> torch.dtype:
        """The dtype ``gather`` wants the shard in: the master dtype where a codec encodes
        it (from the master weights), else the compute dtype."""
        return compute if self.codec is None else master

    def gather(
        self,
        unsharded: torch.Tensor,
        source: torch.Tensor,
        group: dist.ProcessGroup | None,
        record: Callable[[str, int], Tag | None],
        encoded: bool = True,
        sent: torch.Tensor | None = None,
    ) -> Gathering:
        """All-gather ``source`` (C,) of every rank into ``unsharded`` (C * F,), without
        waiting; ``unsharded`` is complete once the work is waited for and finished.
        ``source`` is the shard in ``source_dtype``, or (``encoded=False``) a part of the
        buffer already decoded, sent as it is; ``sent``, the codec's payload of an earlier
        gather of the same shard, is sent again instead of encoding ``source``. ``record``
        is told of the collective and gives its tag. ``group`` None (F = 1): the codec's
        round trip alone, done."""
        codec = self.codec if encoded else None
        if codec is None:
            assert group is not None
            tag = record("all_gather", source.numel())
            work = start_all_gather(unsharded, source, group, tag, self.all_gather)
            return Gathering(work, (source,))
        payload = codec.encode(source, unsharded.dtype) if sent is None else sent
        if group is None:
            codec.decode(payload, unsharded)
            return Gathering(None, ())
        gathered = payload.new_empty(payload.numel() * group.size())
        tag = record("all_gather", payload.numel())
        work = start_all_gather(gathered, payload, group, tag, self.all_gather)
        finish = partial(codec.decode, gathered, unsharded)
        return Gathering(work, (payload, gathered), finish, payload)

    def reduce(
        self,
        grad: torch.Tensor,
        groups: ShardGroups,
        tag: Tag | None,
        across_replicas: bool,
        division: tuple[float, float],
    ) -> PendingReduction:
        """Sum ``grad`` (C * F,) over the W ranks divided as ``division`` says (before,
        after the sum; W by default: the average); this rank keeps its chunk (C,)."""
        if self.reduce_group is not None and groups.shard is not None:
            groups = replace(groups, shard=self.reduce_group)
        return reduce_gradient(grad, groups, tag, across_replicas, division, self.reduce_scatter)


IDENTITY = Transport()


# ------------------------------ the codec: one byte per weight with row scales, or a cast
SCALED: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
"""Gather dtypes sent with one float32 scale per row, and their largest magnitude."""

CAST = (torch.bfloat16, torch.float16, torch.float32)
"""Gather dtypes sent as a plain cast of the shard."""

_ALIGN = 8  # bytes: each part of a payload starts aligned for any element type


def gather_dtype_error(dtype: object, where: str) -> str | None:
    """Why ``dtype`` cannot be a gather dtype (``where``: the option, for the message)."""
    if dtype is None or dtype in SCALED or dtype in CAST:
        return None
    names = ", ".join(str(d) for d in (*SCALED, *CAST))
    return f"{where} must be None or one of {names}; got {dtype!r}"


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values to send as ``dtype``, one float32 scale per row) of a (rows, k) tensor, as
    [Note: row-wise quantized all-gather] says; the values are float32 still."""
    x = rows.float()
    limit = SCALED[dtype]
    scale = x.abs().amax(dim=1) / limit
    finite = torch.isfinite(scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    q = x / scale[:, None]
    if dtype == torch.int8:
        q = q.round_()
    return q.clamp_(-limit, limit), scale


@dataclass(frozen=True)
class _Rows:
    offset: int  # first element in the rank's shard
    rows: int
    row_numel: int
    scale_index: int  # first scale in the rank's scales


@dataclass(frozen=True)
class _Span:
    offset: int  # first element in the rank's shard
    numel: int
    index: int  # first element in the rank's vector part (gaps: unused)


@dataclass(frozen=True)
class _RankPayload:
    """What one rank's shard holds, as the codec encodes it."""

    rows: tuple[_Rows, ...]  # quantized
    vectors: tuple[_Span, ...]  # sent in the compute dtype
    gaps: tuple[_Span, ...]  # padding between and after the parameters


class GatherCodec:
    """Encodes this rank's shard of one flat group into the bytes it sends, and decodes
    every rank's into the unsharded buffer ([Note: row-wise quantized all-gather])."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.rank = rank
        self.dtype = dtype  # the gather dtype
        self.scaled = dtype in SCALED
        self._ranks = [self._rank_payload(r) for r in range(layout.factor)]
        self._scales = max(sum(p.rows for p in r.rows) for r in self._ranks)
        self._vector_numel = max(sum(v.numel for v in r.vectors) for r in self._ranks)
        self._decode_plans: dict[torch.device, _DecodePlan] = {}
        self._encode_plans: dict[torch.device, _EncodePlan] = {}

    def _rank_payload(self, rank: int) -> _RankPayload:
        rows: list[_Rows] = []
        vectors: list[_Span] = []
        covered: list[tuple[int, int]] = []
        scales = vector_numel = 0
        for slot in self.layout.slots:
            held = self.layout.shard_range(slot, rank)
            if held.numel == 0:
                continue
            covered.append((held.local_offset, held.numel))
            if len(slot.shape) >= 2:
                rows.append(_Rows(held.local_offset, held.rows, slot.row_numel, scales))
                scales += held.rows
            else:
                vectors.append(_Span(held.local_offset, held.numel, vector_numel))
                vector_numel += held.numel
        gaps: list[_Span] = []
        at = 0
        for offset, numel in sorted(covered):
            if offset > at:
                gaps.append(_Span(at, offset - at, 0))
            at = max(at, offset + numel)
        if at < self.layout.shard_numel:
            gaps.append(_Span(at, self.layout.shard_numel - at, 0))
        return _RankPayload(tuple(rows), tuple(vectors), tuple(gaps))

    def _parts(self, compute: torch.dtype) -> tuple[int, int, int]:
        """Byte offsets of the vectors and the quantized rows in a payload, its size."""
        vectors = _aligned(4 * self._scales)
        rows = vectors + _aligned(self._vector_numel * compute.itemsize)
        return vectors, rows, _aligned(rows + self.layout.shard_numel)

    def payload_numel(self, compute: torch.dtype) -> int:
        """Bytes one rank sends."""
        if not self.scaled:
            return _aligned(self.layout.shard_numel * self.dtype.itemsize)
        return self._parts(compute)[2]

    def encode(self, shard: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        """This rank's payload (bytes) from its ``shard`` (C,) (the master weights, on the
        compute device), for a buffer in ``compute``. Only what nothing is written to is
        zeroed: the scales' and vectors' parts before they are written (a few bytes per
        row), the bytes among the rows at vectors and padding, and the tail."""
        size = self.payload_numel(compute)
        payload = torch.empty(size, dtype=torch.uint8, device=shard.device)
        if not self.scaled:
            used = shard.numel() * self.dtype.itemsize
            payload[:used].view(self.dtype).copy_(shard)
            payload[used:].zero_()
            return payload
        _, rows_at, _ = self._parts(compute)
        payload[:rows_at].zero_()
        scales, vectors, rows = self._views(payload, compute)
        mine = self._ranks[self.rank]
        for part in mine.rows:
            end = part.offset + part.rows * part.row_numel
            q, scale = quantize_rows(shard[part.offset : end].view(part.rows, -1), self.dtype)
            rows[part.offset : end].view(part.rows, -1).copy_(q)
            scales[part.scale_index : part.scale_index + part.rows].copy_(scale)
        plan = self._encode_plan(shard.device)
        if plan.vectors.numel():
            vectors[: plan.vectors.numel()].copy_(shard.index_select(0, plan.vectors))
        if plan.unwritten.numel():
            payload[rows_at : rows_at + self.layout.shard_numel].index_fill_(0, plan.unwritten, 0)
        payload[rows_at + self.layout.shard_numel :].zero_()
        return payload

    def _encode_plan(self, device: torch.device) -> _EncodePlan:
        """This rank's vector elements in its shard, and its shard's elements that are no
        rows (vectors, padding) (indices on ``device``, built on first use there)."""
        if device not in self._encode_plans:
            mine = self._ranks[self.rank]
            vectors = [i for v in mine.vectors for i in range(v.offset, v.offset + v.numel)]
            gaps = [i for g in mine.gaps for i in range(g.offset, g.offset + g.numel)]
            plan = _EncodePlan(_index(vectors, device), _index(sorted(vectors + gaps), device))
            self._encode_plans[device] = plan
        return self._encode_plans[device]

    def decode(self, gathered: torch.Tensor, unsharded: torch.Tensor) -> None:
        """Write every rank's payload in ``gathered`` (F payloads, in rank order) into
        ``unsharded`` (C * F,), laid out as the group's buffer ([Note: one decode for every
        rank])."""
        factor, chunk = self.layout.factor, self.layout.shard_numel
        size = self.payload_numel(unsharded.dtype)
        sent = gathered.view(factor, size)
        if not self.scaled:
            values = sent[:, : chunk * self.dtype.itemsize].view(self.dtype)
            unsharded.view(factor, chunk).copy_(values)
            return
        vectors_at, rows_at, _ = self._parts(unsharded.dtype)
        plan = self._decode_plan(unsharded.device)
        # Every rank's rows at once, cast to the compute dtype (exact: the values are
        # integers, or fp8, which the compute dtypes hold exactly)...
        unsharded.view(factor, chunk).copy_(sent[:, rows_at : rows_at + chunk].view(self.dtype))
        # ...then each parameter scaled row by row, all ranks' rows in one op.
        scales = sent[:, : 4 * self._scales].reshape(-1).view(torch.float32)
        by_row = scales.index_select(0, plan.scale_index)
        for offset, rows, row_numel, first in plan.matrices:
            matrix = unsharded[offset : offset + rows * row_numel].view(rows, row_numel)
            matrix.mul_(by_row[first : first + rows, None])
        if plan.vector_source.numel():
            itemsize = unsharded.dtype.itemsize
            part = sent[:, vectors_at : vectors_at + self._vector_numel * itemsize]
            vectors = part.reshape(-1).view(unsharded.dtype)
            unsharded.index_copy_(
                0, plan.vector_target, vectors.index_select(0, plan.vector_source)
            )

    def _decode_plan(self, device: torch.device) -> _DecodePlan:
        """Where every rank's scales and vectors go in the unsharded buffer (indices on
        ``device``, built on its first decode there)."""
        if device in self._decode_plans:
            return self._decode_plans[device]
        layout, chunk = self.layout, self.layout.shard_numel
        scale_index: list[int] = []
        matrices: list[tuple[int, int, int, int]] = []
        for slot in layout.slots:
            if len(slot.shape) < 2 or slot.numel == 0:
                continue
            first = len(scale_index)
            for rank, payload in enumerate(self._ranks):
                held = layout.shard_range(slot, rank)
                part = next((p for p in payload.rows if p.offset == held.local_offset), None)
                if held.rows == 0 or part is None:
                    continue
                # A parameter is one run of rows in the unsharded buffer, rank after rank.
                done = (len(scale_index) - first) * slot.row_numel
                assert rank * chunk + part.offset == slot.offset + done, (slot, rank)
                start = rank * self._scales + part.scale_index
                scale_index += range(start, start + part.rows)
            matrices.append((slot.offset, slot.rows, slot.row_numel, first))
        source: list[int] = []
        target: list[int] = []
        for rank, payload in enumerate(self._ranks):
            for span in payload.vectors:
                sent_at = rank * self._vector_numel + span.index
                source += range(sent_at, sent_at + span.numel)
                lands_at = rank * chunk + span.offset
                target += range(lands_at, lands_at + span.numel)
        indices = (_index(scale_index, device), _index(source, device), _index(target, device))
        plan = self._decode_plans[device] = _DecodePlan(indices[0], tuple(matrices), *indices[1:])
        return plan

    def _views(
        self, payload: torch.Tensor, compute: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scales (float32), vectors (``compute``) and rows (gather dtype) of a payload."""
        vectors, rows, _ = self._parts(compute)
        return (
            payload[: 4 * self._scales].view(torch.float32),
            payload[vectors : vectors + self._vector_numel * compute.itemsize].view(compute),
            payload[rows : rows + self.layout.shard_numel].view(self.dtype),
        )


@dataclass(frozen=True)
class _EncodePlan:
    """Indices of one encode, in this rank's shard."""

    vectors: torch.Tensor  # its vectors' elements, in the order its payload sends them
    unwritten: torch.Tensor  # its elements that are no rows: their bytes are zeroed


@dataclass(frozen=True)
class _DecodePlan:
    """Indices of one decode ([Note: one decode for every rank])."""

    scale_index: torch.Tensor  # every matrix row's scale, in unsharded order
    matrices: tuple[tuple[int, int, int, int], ...]  # (offset, rows, row_numel, first row)
    vector_source: torch.Tensor  # elements of the F payloads' vector parts...
    vector_target: torch.Tensor  # ...and where they go in the unsharded buffer


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
