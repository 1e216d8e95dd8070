"""What each rank was doing when a collective hung, as one table every rank prints alike.

Pure functions over the statuses ranks publish through the c10d store (``_watchdog.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

SAME_CALLS = (
    "Every rank must make the same flatshard calls in the same order: forward and backward of "
    "every unit, clip_grad_norm_, summon_full_params, state dicts and checkpoints. Run "
    "conditional units (e.g. experts that got no tokens) on every rank, or keep them in one unit."
)


@dataclass(frozen=True)
class Status:
    """One rank's answer to a diagnosis request."""

    rank: int
    host: str
    waiting: str | None  # what this rank waits for now, in user terms
    waiting_s: float
    # (group, sequence number, description, what every rank must say alike), oldest first
    recent: list[tuple[str, int, str, str]]

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "host": self.host,
            "waiting": self.waiting,
            "waiting_s": self.waiting_s,
            "recent": [list(r) for r in self.recent],
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> Status:
        recent = data["recent"]
        assert isinstance(recent, list)
        return Status(
            rank=int(str(data["rank"])),
            host=str(data["host"]),
            waiting=None if data["waiting"] is None else str(data["waiting"]),
            waiting_s=float(str(data["waiting_s"])),
            recent=[(str(g), int(s), str(t), str(a)) for g, s, t, a in recent],
        )


def report(
    cause: str, group: str, ranks: list[int], statuses: dict[int, Status], settings: str
) -> str:
    """The whole message: the cause, one line per rank, where they diverged, what to do."""
    members = ", ".join(str(r) for r in ranks)
    lines = [cause, f"What each rank of the group was doing (group '{group}': ranks {members}):"]
    lines += [f"  rank {r}: {_doing(statuses.get(r))}" for r in ranks]
    divergence = _divergence(group, ranks, statuses)
    if divergence:
        lines.append(divergence)
    lines += _hints(group, ranks, statuses)
    lines.append(settings)
    return "\n".join(lines)


def _doing(status: Status | None) -> str:
    if status is None:
        return "no answer (the process is gone, or stuck without releasing the GIL)"
    last = status.recent[-1][2] if status.recent else "none yet"
    if status.waiting is not None:
        return f"waiting {status.waiting_s:.1f} s for {status.waiting}"
    return f"not in a flatshard collective; its last: {last}"


def _by_seq(group: str, status: Status) -> dict[int, tuple[str, str]]:
    """(description, what ranks must say alike) by sequence number."""
    return {seq: (text, agreed) for g, seq, text, agreed in status.recent if g == group}


def _divergence(group: str, ranks: list[int], statuses: dict[int, Status]) -> str:
    """The first collective on ``group`` the answering ranks did not issue alike."""
    seen = {r: _by_seq(group, s) for r, s in statuses.items() if r in ranks}
    if len(seen) < 2:
        return ""
    for seq in sorted({seq for calls in seen.values() for seq in calls}):
        calls_at = {r: calls.get(seq) for r, calls in seen.items() if seq >= min(calls, default=0)}
        if len({c[1] if c else None for c in calls_at.values()}) > 1:
            said = "; ".join(
                f"rank {r} {'issued ' + c[0] if c else 'issued nothing (yet)'}"
                for r, c in sorted(calls_at.items())
            )
            return f"Where the ranks diverged, at collective #{seq}: {said}."
    return ""


def _hints(group: str, ranks: list[int], statuses: dict[int, Status]) -> list[str]:
    """The likely causes the table points to, in words."""
    last = {r: max(_by_seq(group, s), default=0) for r, s in statuses.items() if r in ranks}
    hints = []
    idle = [r for r, seq in last.items() if seq < max(last.values()) and not statuses[r].waiting]
    if idle:
        who = ", ".join(str(r) for r in idle)
        hints.append(
            f"Rank(s) {who} issued fewer collectives and wait for none: they skipped a "
            "step, a backward or a unit, or ran out of batches (give every rank the same "
            "number: DistributedSampler(..., drop_last=True); see docs/troubleshooting.md, "
            "'Uneven data')."
        )
    if any(r not in statuses for r in ranks):
        hints.append("A rank that gives no answer has usually died: look for its traceback.")
    hints.append(SAME_CALLS)
    return hints
