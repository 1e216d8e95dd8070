"""Full-size parameters (and tensors laid out like them) gathered outside forward/backward.

Used by ``summon_full_params``, full state dicts and full optimizer state dicts: a blocking
all-gather over the group's shard group, on the compute device (NCCL cannot gather CPU
shards when offloading).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flatshard.comm._collectives import all_gather_into
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._tensor_parallel import SplitParam


def gather_full(
    flat: FlatParamGroup, region: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather a tensor laid out like ``flat.param_region``; return it and full-shape views.

    A collective over the shard group (and first across the replicas under
    HYBRID_SHARD_OPTIM: [Note: optimizer state sharded across the replicas]). Used for
    parameters (the region itself) and for anything shaped like them, such as optimizer
    moments packed by ``pack_rows``.
    """
    flat_shard = flat.gather_region(region)  # laid out like the shard (C,)
    full = torch.empty(
        flat.layout.unsharded_numel, dtype=flat_shard.dtype, device=flat.compute_device
    )  # (C * F,)
    source = flat_shard.to(flat.compute_device)
    if flat.groups.shard is None:
        full.copy_(source)
    else:
        all_gather_into(full, source, flat.groups.shard)
    return full, flat.views.full_views(full)


def gather_copies(
    flat: FlatParamGroup, region: torch.Tensor, keep: bool, cpu_offload: bool
) -> list[torch.Tensor]:
    """Gather ``region`` (laid out like ``param_region``); copy out each original's part.

    Returns nothing when not ``keep``. A function of its own so that the gathered buffer
    (which every view keeps alive) is freed on return, before the next gather.
    """
    views = gather_full(flat, region)[1]
    if not keep and not flat.has_tp:
        return []
    # A split parameter's part -> the global tensor, a collective over its group on the
    # ranks that must join it even without keeping it (SplitParam.full_where_kept).
    copies = [copy_out(view, cpu_offload) if keep else view for view in views]
    if flat.has_tp:
        copies = [
            _global(orig.tp, c, flat, keep) for orig, c in zip(flat.originals, copies, strict=True)
        ]
    return copies if keep else []


def _global(
    tp: SplitParam | None, local: torch.Tensor, flat: FlatParamGroup, keep: bool
) -> torch.Tensor:
    """The global tensor of a split parameter from every rank's ``local`` of its group
    (``local`` itself where this rank does not keep it)."""
    if tp is None:
        return local
    full = tp.full_where_kept(local.to(flat.compute_device), keep)
    return local if full is None else full.to(local.device)


def copy_out(tensor: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    """A fresh copy (on the CPU with ``cpu_offload``): a view would keep a whole buffer."""
    device = torch.device("cpu") if cpu_offload else tensor.device
    return tensor.detach().to(device, copy=True)


def pack_rows(flat: FlatParamGroup, local_rows: list[torch.Tensor]) -> torch.Tensor:
    """Lay tensors shaped like each original's held rows out like ``flat.param_region``."""
    packed = torch.zeros(
        flat.param_layout.shard_numel, dtype=local_rows[0].dtype, device=flat.shard.device
    )
    for view, rows in zip(flat.param_views.shard_views(packed), local_rows, strict=True):
        view.copy_(rows)
    return packed


class Summoned:
    """A group's parameters, full-size for a while (``full_params``)."""

    def __init__(self, flat: FlatParamGroup, views: list[torch.Tensor], given: list[torch.Tensor]):
        self.writeback = True  # False: what was written is dropped (``discard``)
        # The originals every rank holds alike: all but a tensor-parallel part (this rank's)
        self._alike = [
            orig
            for orig, view, tensor in zip(flat.originals, views, given, strict=True)
            if orig.tp is None or tensor is not view
        ]

    def digests(self) -> list[tuple[str, int]]:
        """(name, digest) of each parameter every rank must hold alike, as it is now."""
        return [(orig.fqn, value_digest(orig.param.data)) for orig in self._alike]

    def discard(self) -> None:
        self.writeback = False


_INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_CHUNK = 1 << 20  # elements per step (an int64 temporary of this size)


def value_digest(tensor: torch.Tensor) -> int:
    """A digest of ``tensor``'s bits: equal on every rank for equal values (NaNs included),
    whatever the reduction order (a position-weighted sum in wrapping 64-bit integers)."""
    bits = tensor.detach().contiguous().reshape(-1).view(_INTEGER_OF_SIZE[tensor.element_size()])
    weights = torch.arange(1, _DIGEST_CHUNK + 1, dtype=torch.int64, device=bits.device)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        chunk = bits[start : start + _DIGEST_CHUNK].to(torch.int64)
        total += (chunk * weights[: chunk.numel()]).sum() + start
    return int(total)


@contextmanager
def full_params(flat: FlatParamGroup, writeback: bool) -> Iterator[Summoned]:
    """Give every original parameter of ``flat`` its full shape and value (master dtype).

    A split parameter becomes what ``SplitParam.summoned`` says: expert slices the whole
    global tensor (joined over their group, as in a full state dict), tensor-parallel parts
    this rank's part. With ``writeback`` what they hold at exit is written to the shards,
    unless ``discard`` was called.
    """
    full, views = gather_full(flat, flat.param_region)
    joined = [
        view if orig.tp is None else orig.tp.summoned(view)
        for orig, view in zip(flat.originals, views, strict=True)
    ]
    for orig, tensor in zip(flat.originals, joined, strict=True):
        orig.param.data = tensor
    summoned = Summoned(flat, views, joined)
    try:
        yield summoned
    finally:
        if writeback and summoned.writeback:
            flat.shards_written()
            _write_back(flat, full, views, joined)
        flat.use_sharded_data()


def _write_back(
    flat: FlatParamGroup,
    full: torch.Tensor,
    views: list[torch.Tensor],
    given: list[torch.Tensor],
) -> None:
    for orig, view, tensor in zip(flat.originals, views, given, strict=True):
        data = orig.param.data
        if data.data_ptr() == view.data_ptr():
            continue  # edited in place: already in ``full``
        if tensor is not view and orig.tp is not None:  # a whole global tensor: our part
            data = orig.tp.local_part(data)
        view.copy_(data)
    chunk = flat.layout.shard_numel
    flat.shard.copy_(full[flat.rank * chunk : (flat.rank + 1) * chunk])
