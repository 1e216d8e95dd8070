"""Startup checks that every rank built the same model and holds the same replicated values.

Ranks that built different models would otherwise hang in a collective or train silently
wrong (../shared/design/USERS.md, item 15). Each check is one small all-gather of a digest;
only when digests differ do the ranks exchange their descriptions to say what differs.
"""

from __future__ import annotations

import hashlib
from typing import cast

import torch
import torch.distributed as dist

from flatshard._collectives import all_gather_into, all_gather_object
from flatshard._partition import UnitPlan
from flatshard._ranks import join_name

_SHOWN = 4  # differing lines quoted per rank
_CHUNK_BYTES = 1 << 20  # bytes checksummed at a time


def structure_lines(plans: list[UnitPlan], strategy: str) -> list[str]:
    """One line per unit, parameter and buffer: what every rank must agree on."""
    lines = [strategy]
    for plan in plans:
        lines.append(f"unit '{plan.fqn or '<root>'}'")
        for orig in plan.originals:
            p = orig.param
            lines.append(
                f"  parameter '{orig.fqn}' shape {tuple(p.shape)} {str(p.dtype)[6:]} "
                f"requires_grad={p.requires_grad}"
            )
        for mname, module in plan.modules:
            for bname, buf in module._buffers.items():
                if buf is not None:
                    name = join_name(mname, bname)
                    lines.append(f"  buffer '{name}' shape {tuple(buf.shape)} {str(buf.dtype)[6:]}")
    return lines


def value_lines(plan: UnitPlan, with_params: bool) -> list[str]:
    """Exact checksums of the unit's buffers (and parameters, before sharding)."""
    named: list[tuple[str, torch.Tensor]] = []
    if with_params:
        named += [(f"parameter '{o.fqn}'", o.param.detach()) for o in plan.originals]
    for mname, module in plan.modules:
        for bname, buf in module._buffers.items():
            if buf is not None:
                named.append((f"buffer '{join_name(mname, bname)}'", buf))
    return [f"{name} checksum {_checksum(t)}" for name, t in named if not t.is_meta]


def lines_if_different(
    lines: list[str], group: dist.ProcessGroup, device: torch.device
) -> list[list[str]] | None:
    """Every rank's ``lines`` if they are not the same on all ranks, else None.

    A collective over ``group``. One 8-byte digest per rank travels as a tensor on
    ``device`` (the backend's own device: NCCL needs a GPU tensor); only on a mismatch do
    ranks exchange their lines as objects, so every rank can raise the same error.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return None
    digest = hashlib.sha256("\n".join(lines).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], device=device)
    every_digest = mine.new_empty(world)
    all_gather_into(every_digest, mine, group)
    # On meta (the planner's simulated world, ``flatshard.plan``) nothing was sent.
    same = every_digest.is_meta or bool((every_digest == mine).all())
    # Waited for, so freed now: gloo's worker thread lets go of its reference a moment
    # after the wait, and the memory would outlive the check until then.
    every_digest.untyped_storage().resize_(0)
    if same:
        return None
    gathered = all_gather_object(lines, group)
    return [cast(list[str], g) for g in gathered]


def check_same_on_all_ranks(
    lines: list[str],
    group: dist.ProcessGroup,
    device: torch.device,
    what: str,
    fix: str,
    caller: str = "fully_shard",
) -> None:
    """Raise on every rank, naming ranks and differing lines, unless all ranks agree."""
    every = lines_if_different(lines, group, device)
    if every is None:
        return
    reference = set(every[0])
    reports = []
    for rank, theirs in enumerate(every):
        if rank == 0 or set(theirs) == reference:
            continue
        only_0 = [line.strip() for line in every[0] if line not in theirs][:_SHOWN]
        only_r = [line.strip() for line in theirs if line not in reference][:_SHOWN]
        reports.append(
            f"rank {rank} differs from rank 0:\n"
            + "".join(f"    rank 0 only: {line}\n" for line in only_0)
            + "".join(f"    rank {rank} only: {line}\n" for line in only_r)
        )
    raise ValueError(
        f"flatshard.{caller}: ranks {what} (seen on rank {dist.get_rank()}).\n"
        + "".join(reports)
        + fix
    )


def _checksum(tensor: torch.Tensor, chunk: int = _CHUNK_BYTES) -> str:
    """An exact, order-sensitive checksum of the tensor's bytes (integer arithmetic).

    Bytes are widened to int64 (8x) and weighted by position (an int64 tensor as long), so
    they are taken ``chunk`` bytes at a time and weighted in place: the extra memory is
    16 x ``chunk`` (plus the copy a non-contiguous tensor needs), not 16x the tensor, which
    would not fit beside a large unit on a GPU.
    """
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    plain = weighted = 0
    for start in range(0, data.numel(), chunk):
        part = data[start : start + chunk].to(torch.int64)
        plain += int(part.sum())
        weights = torch.arange(start, start + part.numel(), device=data.device)
        weights.remainder_(65521).add_(1)
        weighted += int(part.mul_(weights).sum())
        del part, weights  # before the next chunk's: loop variables outlive their turn
    return f"{plain}:{weighted}"
