"""How ranks agree: who this rank is, whether all hold the same lines, rank 0 checks first,
and the step's ledger of collectives compared at the end of each backward.

Do all ranks hold the same lines? One 8-byte digest each; the lines only on a mismatch.
This is the protocol behind every "ranks built/read/issued different ..." error: the
startup checks (``fully_shard``), ``load_safetensors`` and the end-of-step collective check
(``StepLedger``, below) each describe what they compare as lines of text. Messages name ranks by
``global_rank`` and parameters by names joined with ``join_name``, the same everywhere.

[Note: check on rank 0, then broadcast]
Loading a dict that only rank 0 holds (``from_rank0=True``) must fail on every rank alike,
or the others would wait in the broadcasts that follow. Rank 0 checks and describes what it
will send; that verdict (an error message, or the description) is broadcast first, and
every rank raises the same error or goes on with the same description.

[Note: collectives pair by issue order]
gloo and NCCL pair collectives on a group by the order each rank issues them, not by what
they are for. If ranks issue the same number of equally sized collectives for different
units (an expert that got no tokens on one rank is skipped there; a unit whose output
reaches the loss on some ranks only is reduced mid-backward there and at the end of
backward elsewhere), every collective completes and the results are silently wrong: a rank
computes with another unit's weights, or sums another unit's gradients.

So each root keeps a ``StepLedger`` of what its units issued since the last check (unit,
collective, elements, in order), and at the end of every backward pass, and of every
forward that has no backward, the ranks all-gather one 8-byte digest of it. Different
digests: every rank exchanges its list and raises the same ``CollectiveMismatchError``,
naming the first call where the ranks differ, before ``optimizer.step()`` can apply
anything. Counts that differ (one rank issues more) hang or mispair before this check
can run; that is for a timeout to report.

[Note: steps in the ledger]
An optimizer step of the model issues no collective, but a rank that steps alone (or
skips a step, or steps with another learning rate) leaves its shards apart from its
peers': every later gather mixes two models, silently. So each step of an optimizer that
holds the model's parameters is an entry of the ledger too, with the optimizer's class and
its float hyper-parameters, compared with the collectives at the next check; a step
between a forward and its backward is refused before it can pair anything (the unit's
pre-backward hook, ``runtime/_unit.py``).

[Note: the digest without a host sync]
Reading the gathered digests on the host (``bool(...)``) waits for everything the device
was asked to do before them: the whole backward and every reduction. On gloo that costs
nothing (the all-gather blocks the host anyway); on NCCL it would stop the host from
running ahead into ``optimizer.step()`` and the next forward, every step. So on an
accelerator the digests are copied into pinned host memory behind an event and compared
before the next step issues anything (the root's next forward, or the next check), when the
event has long completed while the host ran ``optimizer.step()`` (``query()``: no wait).
A mismatch is then reported one step late (``optimizer.step()`` may have applied it); the
ranks all see the same digests, so they raise together. Collective calls between steps that must
not act on a mismatched step (state dicts, checkpoints, summon) compare what is pending
first (``settle``), waiting if need be. A mismatch in the very last step, with no check and
no such call after it, is compared at interpreter exit (``settle_at_exit``): every rank
prints the error and exits with status 1, so the launcher sees the run failed.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from flatshard.comm._collectives import (
    all_gather_into,
    all_gather_object,
    broadcast_object_list,
    on_device,
)
from flatshard.comm._errors import CollectiveMismatchError
from flatshard.comm._watchdog import Tag, tagged
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
    if every is not None:
        raise_differences(every, what, fix, caller)


def raise_differences(every: list[list[str]], what: str, fix: str, caller: str) -> None:
    """The error of ``check_same_on_all_ranks`` for every rank's ``lines``."""
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


# ------------------------------ the step's ledger: each backward's collectives, compared at its end
_SHOWN = 6  # calls quoted per rank around the first difference
_STEP = "optimizer_step"  # not a collective: an entry the ranks compare all the same
_STEP_SHOWN = "optimizer.step() of model"


@dataclass(frozen=True)
class Call:
    """One collective flatshard issued for a unit (or an optimizer step of the model)."""

    op: str  # "all_gather" or "reduce"
    unit: str  # the unit's name
    numel: int  # elements this rank sent
    settings: str = ""  # an optimizer step's hyper-parameters

    def __str__(self) -> str:
        if self.op == _STEP:
            return f"{_STEP_SHOWN} '{self.unit}' ({self.settings})"
        return f"{self.op} of unit '{self.unit}' ({self.numel:,} elements)"


def defers_digest(device: torch.device) -> bool:
    """Whether the digests on ``device`` are compared one check later ([Note: the digest
    without a host sync]): on accelerators."""
    return device.type not in ("cpu", "meta")


@dataclass
class _Pending:
    """Digests gathered at a check, compared at the next one."""

    lines: list[str]  # this rank's calls then
    mine: int  # this rank's digest
    every: torch.Tensor  # (W,) every rank's, in host memory once ``ready`` completed
    ready: torch.Event | None  # None: ``every`` is there already
    group: dist.ProcessGroup
    device: torch.device
    when: str
    tag: Tag
    rank: int  # this rank in the world (the group may be gone when it is read at exit)


class StepLedger:
    """The collectives a root's units issued since the last check, in issue order."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._pending: _Pending | None = None  # an accelerator's digests, not yet compared

    def record(self, op: str, unit: str, numel: int) -> None:
        self.calls.append(Call(op, unit, numel))

    def record_step(self, model: str, settings: str) -> None:
        """An optimizer is about to step the model's shards, with its hyper-parameters
        ``settings`` ([Note: steps in the ledger])."""
        self.calls.append(Call(_STEP, model, 0, settings))

    def check(
        self, group: dist.ProcessGroup | None, device: torch.device, when: str, tag: Tag
    ) -> None:
        """An error on every rank unless all ranks issued the same calls; then forget them.

        A collective over ``group``: every rank calls it at the same point (the end of a
        backward pass, or of a forward without backward: ``when``). None: no group left
        (interpreter exit), nothing to compare. On an accelerator this check's digests are
        compared before the next step ([Note: the digest without a host sync]).
        """
        calls, self.calls = self.calls, []
        if group is None:
            return
        self.settle()
        lines = [str(c) for c in calls]
        if not defers_digest(device) or dist.get_world_size(group) == 1:
            with tagged(tag):
                every = lines_if_different(lines, group, device)
            if every is not None:
                raise CollectiveMismatchError(_report(every, when))
            return
        with tagged(tag):
            self._pending = _gather_later(lines, group, device, when, tag)

    def settle(self) -> None:
        """Compare the digests still pending (waiting for them if they are not there yet);
        the same error on every rank if they differ."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None and not pending.ready.query():
            pending.ready.synchronize()
        if bool((pending.every == pending.mine).all()):
            return
        with tagged(pending.tag), on_device(pending.device):
            gathered = all_gather_object(pending.lines, pending.group)
        every = [[str(line) for line in cast(list[str], g)] for g in gathered]
        raise CollectiveMismatchError(_report(every, pending.when, late=True))

    def settle_at_exit(self) -> None:
        """At interpreter exit: compare the digests still pending. On a mismatch every rank
        holds the same digests, so every rank prints the error and exits with status 1
        (an exception in an exit handler would leave the status 0). The lines are not
        exchanged: the process group may be gone."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        if bool((pending.every == pending.mine).all()):
            return
        digests = ", ".join(f"rank {r}: {int(d):#x}" for r, d in enumerate(pending.every))
        sys.stderr.write(
            f"flatshard: ranks issued different collectives in the last {pending.when} of the "
            f"run (seen on rank {pending.rank} at exit; digests {digests}): its results mix "
            "units. Rerun with FLATSHARD_DEBUG=1 to name the first difference.\n"
        )
        sys.stderr.flush()
        os._exit(1)


def _gather_later(
    lines: list[str], group: dist.ProcessGroup, device: torch.device, when: str, tag: Tag
) -> _Pending:
    """All-gather the digests on ``device`` and copy them to the host behind an event."""
    mine = digest_of(lines)
    world = dist.get_world_size(group)
    sent = torch.tensor([mine], device=device)
    gathered = sent.new_empty(world)
    all_gather_into(gathered, sent, group)  # the stream waits, the host does not
    if device.type == "cpu":  # (tests run this path on gloo: the digests are there)
        return _Pending(lines, mine, gathered, None, group, device, when, tag, global_rank())
    every = torch.empty(world, dtype=gathered.dtype, pin_memory=True)
    every.copy_(gathered, non_blocking=True)
    ready = torch.Event(device=device)
    ready.record()
    return _Pending(lines, mine, every, ready, group, device, when, tag, global_rank())


def _report(per_rank: list[list[str]], when: str, late: bool = False) -> str:
    first = _first_difference(per_rank)
    later = " (found before the next step: optimizer.step() may have applied its results)"
    lines = [
        f"flatshard: ranks issued different collectives in one {when}{later if late else ''} "
        f"(seen on rank "
        f"{global_rank()}); collectives pair by issue order, so the results would mix units "
        f"(see docs/design.md, 'collectives pair by issue order'). First difference at call "
        f"{first + 1}:"
    ]
    for rank, calls in enumerate(per_rank):
        window = calls[max(0, first - 1) : first + _SHOWN - 1]
        shown = "; ".join(window) if window else "(no further call)"
        lines.append(f"  rank {rank} ({len(calls)} calls): {shown}")
    if any(line.startswith(_STEP_SHOWN) for calls in per_rank for line in calls[first : first + 1]):
        lines.append(
            "optimizer.step() differs between the ranks (how often, or its "
            "hyper-parameters): a rank that steps alone, skips a step or steps with another "
            "learning rate leaves its shards apart from the others', and the model is then "
            "a mix of two. Call optimizer.step() on every rank alike, with the same "
            "settings (a skip decided on one rank, e.g. a NaN guard, must be agreed first: "
            "all_reduce the flag)."
        )
        return "\n".join(lines)
    lines.append(
        "Every rank must run every unit in the same order, and each unit's output must reach "
        "the loss on every rank: run conditional units (e.g. experts that got no tokens) on "
        "every rank, or keep all of them in one unit, and add 0 * output.sum() to the loss for "
        "outputs a rank does not use."
    )
    return "\n".join(lines)


def _first_difference(per_rank: list[list[str]]) -> int:
    """The index of the first call not the same on every rank."""
    longest = max(len(calls) for calls in per_rank)
    for index in range(longest):
        seen = {calls[index] if index < len(calls) else None for calls in per_rank}
        if len(seen) > 1:
            return index
    return longest
