"""How ranks agree: who this rank is, whether all hold the same lines, rank 0 checks first.

Do all ranks hold the same lines? One 8-byte digest each; the lines only on a mismatch.
This is the protocol behind every "ranks built/read/issued different ..." error: the
startup checks (``fully_shard``), ``load_safetensors`` and the end-of-step collective check
(``_ledger.py``) each describe what they compare as lines of text. Messages name ranks by
``global_rank`` and parameters by names joined with ``join_name``, the same everywhere.

[Note: check on rank 0, then broadcast]
Loading a dict that only rank 0 holds (``from_rank0=True``) must fail on every rank alike,
or the others would wait in the broadcasts that follow. Rank 0 checks and describes what it
will send; that verdict (an error message, or the description) is broadcast first, and
every rank raises the same error or goes on with the same description.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from flatshard.comm._collectives import (
    all_gather_into,
    all_gather_object,
    broadcast_object_list,
    on_device,
)
from flatshard.measure._accounting import resize_storage

T = TypeVar("T")


def global_rank() -> int:
    """This process's rank in the world (0 without torch.distributed), for messages."""
    return dist.get_rank() if dist.is_initialized() else 0


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 for None: no group, one rank)."""
    return dist.get_rank(group) if group is not None else 0


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or either alone when the other is empty (module names)."""
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def checked_on_rank0(group: dist.ProcessGroup, check: Callable[[], T]) -> T:
    """Run ``check`` on rank 0 of ``group`` and give its result to every rank.

    A ``ValueError`` raised by ``check`` is raised on every rank (see the note above).
    """
    verdict: list[object] = [None, None]  # (error message, result)
    if dist.get_rank(group) == 0:
        try:
            verdict = [None, check()]
        except ValueError as error:
            verdict = [str(error), None]
    broadcast_object_list(verdict, group_src=0, group=group)
    if verdict[0] is not None:
        raise ValueError(f"{verdict[0]} (checked on rank 0)")
    return cast(T, verdict[1])


# ------------------------------------------------------------ do all ranks hold the same lines
_SHOWN = 4  # differing lines quoted per rank


def digest_of(lines: list[str]) -> int:
    """8 bytes of the lines' SHA-256, as a signed 64-bit integer."""
    digest = hashlib.sha256("\n".join(lines).encode()).digest()[:8]
    return int.from_bytes(digest, "little", signed=True)


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
    mine = torch.tensor([digest_of(lines)], device=device)
    every_digest = mine.new_empty(world)
    all_gather_into(every_digest, mine, group)
    # On meta (the planner's simulated world, ``flatshard.plan``) nothing was sent.
    same = every_digest.is_meta or bool((every_digest == mine).all())
    # Waited for, so freed now: gloo's worker thread lets go of its reference a moment
    # after the wait, and the memory would outlive the check until then.
    resize_storage(every_digest.untyped_storage(), 0)
    if same:
        return None
    with on_device(device):  # the objects travel on the current device (NCCL)
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
