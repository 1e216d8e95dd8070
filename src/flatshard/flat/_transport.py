"""The transport of a flat group's payloads: the codec seam of gather and reduction.

A flat group issues its all-gather (``FlatParamGroup.start_unshard``) and its gradient
reduction (``GradientReduction.start``) through its ``Transport``. Without a codec it sends
the tensors as they are: the shard in the compute dtype, the gradient in the reduce dtype.
With one (``codec``: one byte per weight with row-wise scales, or a cast; see
``_gather_codec.py``) ``gather`` sends this rank's encoded shard and decodes every rank's
into ``unsharded`` when its work is waited for, so the unit, the runtime and the state
layers never see the encoding. Gradients travel unencoded.
The collectives themselves are torch's, or a user's (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``): ``all_gather`` and ``reduce_scatter``; reductions inside the
shard group may take a group of their own (``reduce_group``, [Note: reductions on their
own group] in ``comm/_mesh.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from flatshard.comm._checks import Tag
from flatshard.comm._collectives import (
    AllGatherComm,
    PendingReduction,
    ReduceScatterComm,
    reduce_gradient,
    start_all_gather,
)
from flatshard.comm._mesh import ShardGroups
from flatshard.flat._gather_codec import GatherCodec


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
