"""The collectives a model's units issue in a step, and the check that ranks issued the same.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatshard.comm._agreement import lines_if_different
from flatshard.comm._checks import Tag, tagged
from flatshard.comm._errors import CollectiveMismatchError
from flatshard.comm._ranks import global_rank

_SHOWN = 6  # calls quoted per rank around the first difference


@dataclass(frozen=True)
class Call:
    """One collective flatshard issued for a unit."""

    op: str  # "all_gather" or "reduce"
    unit: str  # the unit's name
    numel: int  # elements this rank sent

    def __str__(self) -> str:
        return f"{self.op} of unit '{self.unit}' ({self.numel:,} elements)"


class StepLedger:
    """The collectives a root's units issued since the last check, in issue order."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def record(self, op: str, unit: str, numel: int) -> None:
        self.calls.append(Call(op, unit, numel))

    def check(
        self, group: dist.ProcessGroup | None, device: torch.device, when: str, tag: Tag
    ) -> None:
        """An error on every rank unless all ranks issued the same calls; then forget them.

        A collective over ``group``: every rank calls it at the same point (the end of a
        backward pass, or of a forward without backward: ``when``). None: no group left
        (interpreter exit), nothing to compare.
        """
        calls, self.calls = self.calls, []
        if group is None:
            return
        with tagged(tag):
            every = lines_if_different([str(c) for c in calls], group, device)
        if every is not None:
            raise CollectiveMismatchError(_report(every, when))


def _report(per_rank: list[list[str]], when: str) -> str:
    first = _first_difference(per_rank)
    lines = [
        f"flatshard: ranks issued different collectives in one {when} (seen on rank "
        f"{global_rank()}); collectives pair by issue order, so the results would mix units "
        f"(see docs/design.md, 'collectives pair by issue order'). First difference at call "
        f"{first + 1}:"
    ]
    for rank, calls in enumerate(per_rank):
        window = calls[max(0, first - 1) : first + _SHOWN - 1]
        shown = "; ".join(window) if window else "(no further call)"
        lines.append(f"  rank {rank} ({len(calls)} calls): {shown}")
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
