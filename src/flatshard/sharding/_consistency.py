"""Startup checks that every rank built the same model and holds the same replicated values.

Ranks that built different models would otherwise hang in a collective or train silently
wrong (users report this as a common failure). Each check is one small all-gather of a digest;
only when digests differ do the ranks exchange their descriptions to say what differs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from flatshard.comm._agreement import join_name
from flatshard.flat._lookup_options import LOOKUPS
from flatshard.flat._partition import UnitMembers
from flatshard.flat._placement import ShardPlacement

_CHUNK_BYTES = 1 << 23  # bytes checksummed at a time
_WRAP = 1 << 64


def structure_lines(
    units: list[UnitMembers], options: list[str], placements: Mapping[str, ShardPlacement]
) -> list[str]:
    """The ``fully_shard`` call's ``options``, then one line per unit, parameter (with its
    placement) and buffer: what every rank must agree on."""
    lines = list(options)
    for members in units:
        lines.append(f"unit '{members.fqn or '<root>'}'")
        for orig in members.originals:
            p = orig.param
            lines.append(
                f"  parameter '{orig.fqn}' shape {tuple(p.shape)} {str(p.dtype)[6:]} "
                f"requires_grad={p.requires_grad} {placements[orig.fqn]!r}"
            )
            lookups = [m for m, _ in orig.usages if isinstance(m, LOOKUPS)]
            lines += [f"  '{orig.fqn}' looked up by {_lookup_line(m)}" for m in lookups]
        for mname, module in members.modules:
            for bname, buf in module._buffers.items():
                if buf is not None:
                    name = join_name(mname, bname)
                    lines.append(f"  buffer '{name}' shape {tuple(buf.shape)} {str(buf.dtype)[6:]}")
    return lines


def _lookup_line(e: nn.Embedding | nn.EmbeddingBag) -> str:
    """An embedding's options: each changes the result, or the path that serves it."""
    bag = f", mode={e.mode}" if isinstance(e, nn.EmbeddingBag) else ""
    return (
        f"nn.{type(e).__name__}(padding_idx={e.padding_idx}, max_norm={e.max_norm}, "
        f"norm_type={e.norm_type}, scale_grad_by_freq={e.scale_grad_by_freq}, "
        f"sparse={e.sparse}{bag})"
    )


def value_lines(members: UnitMembers, with_params: bool) -> list[str]:
    """Exact checksums of the unit's buffers (and parameters, before sharding)."""
    named: list[tuple[str, torch.Tensor]] = []
    if with_params:
        for o in members.originals:
            value = o.param.detach() if o.tp is None else o.tp.startup_value(o.param.detach())
            if value is not None:
                named.append((f"parameter '{o.fqn}'", value))
    for mname, module in members.modules:
        for bname, buf in module._buffers.items():
            if buf is not None:
                named.append((f"buffer '{join_name(mname, bname)}'", buf))
    return [f"{name} checksum {_checksum(t)}" for name, t in named if not t.is_meta]


def _checksum(tensor: torch.Tensor, chunk: int = _CHUNK_BYTES) -> str:
    """An exact, order-sensitive checksum of the tensor's bytes (integer arithmetic).

    The bytes are read as 8-byte words where their count allows (else 4-byte, else single
    bytes): a parameter costs one widening per 8 bytes, not per byte (it runs by default
    on every replicated parameter at ``fully_shard``: docs/performance.md). The words are
    summed plain and weighted by their position (from 1) in int64, products wrapping the
    same on every rank. Taken ``chunk`` bytes at a time, the position weights made once
    (a chunk's are the first chunk's plus its start), so the extra memory is about twice
    ``chunk`` (plus the copy a non-contiguous tensor needs), not a multiple of the tensor,
    which would not fit beside a large unit on a GPU.
    """
    words = _words(tensor.detach().contiguous().reshape(-1))
    step = max(1, chunk // words.element_size())
    positions = torch.arange(1, min(step, words.numel()) + 1, device=words.device)
    plain = weighted = 0
    for start in range(0, words.numel(), step):
        part = words[start : start + step].to(torch.int64, copy=True)
        total = int(part.sum())
        plain += total
        weighted += int(part.mul_(positions[: part.numel()]).sum()) + start * total
        del part  # before the next chunk's: loop variables outlive their turn
    return f"{plain % _WRAP}:{weighted % _WRAP}"  # int64's wrap: the same for any ``chunk``


def _words(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s bytes as the widest integer words that divide them."""
    data = flat.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if data.numel() % size == 0 and data.storage_offset() % size == 0:
            return data.view(dtype)
    return data
