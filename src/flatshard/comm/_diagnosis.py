"""What each rank was doing when a collective hung, as one table every rank prints alike,
and whether the table already proves that the wait can never end.

Pure functions over the statuses ranks publish through the c10d store (``_watchdog.py``).

[Note: a proven divergence]
A wait that runs long is either slow (a peer computes, a link is congested: only the
timeout can tell) or hopeless, and the statuses often prove which. ``proven`` names the
hopeless cases it can prove from the table alone:
- a rank of the group has ended (its exit record is in the store): it will never take
  part again, whether it returned, called ``sys.exit`` or raised;
- two ranks' records of the same collective (same group, same sequence number) differ:
  the backend paired different collectives, which can only hang or mix units;
- one rank waits for the others to reach a call every rank must make (``save_checkpoint``,
  ``summon_full_params``, ...) while another waits in a collective the first has not
  issued: each waits for the other. This is the rank-0-only save.
A rank that computes, or gives no answer and left no exit record, proves nothing: the
timeout stays for it. The first two come from history and hold whenever seen; the third
comes from snapshots of what ranks wait for, and a rank whose agreement has just
completed can still show it for a poll's time, so it must be seen in two probes a second
apart (``Proof.settled``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    waiting_on: Waited | None = None  # what it waits for, to compare with the others'
    ended: str | None = None  # how the process ended (its exit record), if it has
    debug: bool = False  # whether it agrees on every collective first (Checks(debug=True))
    # A torch.distributed collective flatshard did not issue that the program's thread is
    # blocked in (what, at which line; the global ranks of its group): see [Note: a
    # collective flatshard does not see]
    foreign: tuple[str, list[int]] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "host": self.host,
            "waiting": self.waiting,
            "waiting_s": self.waiting_s,
            "recent": [list(r) for r in self.recent],
            "waiting_on": None if self.waiting_on is None else list(self.waiting_on),
            "ended": self.ended,
            "debug": self.debug,
            "foreign": None if self.foreign is None else list(self.foreign),
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> Status:
        recent = data["recent"]
        assert isinstance(recent, list)
        on = data.get("waiting_on")
        ended = data.get("ended")
        foreign = data.get("foreign")
        return Status(
            rank=int(str(data["rank"])),
            host=str(data["host"]),
            waiting=None if data["waiting"] is None else str(data["waiting"]),
            waiting_s=float(str(data["waiting_s"])),
            recent=[(str(g), int(s), str(t), str(a)) for g, s, t, a in recent],
            waiting_on=None if not isinstance(on, list) else Waited(*on),
            ended=None if ended is None else str(ended),
            debug=data.get("debug") is True,
            foreign=(str(foreign[0]), [int(r) for r in foreign[1]])
            if isinstance(foreign, list)
            else None,
        )


class Waited(NamedTuple):
    """What a blocked rank waits for, in the terms ``proven`` compares."""

    group: str
    issued: int  # flatshard collectives this rank has issued on the group
    seq: int  # the collective waited for (0: none, a call every rank must make)
    agreed: str  # what every rank's record of it must say alike
    call: str  # the call it waits in ("" for a collective), e.g. "save_checkpoint"
    where: str  # the program's line that made the call ("" unknown)


class Proof(NamedTuple):
    """Why a wait can never end: the error every rank raises, and why in words."""

    error: str  # "PeerLostError" or "CollectiveMismatchError"
    why: str
    # From history (an exit, two records that differ): true whenever seen. From what ranks
    # wait for now: each status is a snapshot, and a rank whose agreement just completed
    # may still show it for a poll's time, so such a proof must be seen twice.
    settled: bool = True


def report(
    cause: str, group: str, ranks: list[int], statuses: dict[int, Status], settings: str
) -> str:
    """The whole message: the cause, one line per rank, where they diverged, what to do."""
    members = ", ".join(str(r) for r in ranks)
    lines = [cause, f"What each rank of the group was doing (group '{group}': ranks {members}):"]
    lines += [f"  rank {r}: {_doing(statuses.get(r))}" for r in ranks]
    proof = proven(group, ranks, statuses)
    if proof is not None:
        lines.append(proof.why)
    divergence = _divergence(group, ranks, statuses)
    if divergence:
        lines.append(divergence)
    lines += _hints(group, ranks, statuses)
    lines.append(settings)
    return "\n".join(lines)


def ended_as(status: Status | None) -> str:
    """How a rank ended, in the diagnosis's words (None: it gave no answer)."""
    if status is None or status.ended is None:
        return (
            "no answer and no exit record: killed by a signal (SIGKILL, the out-of-memory "
            "killer), its host or connection lost, or stuck without releasing the GIL"
        )
    return status.ended


def _doing(status: Status | None) -> str:
    if status is None:
        return ended_as(status)
    last = status.recent[-1][2] if status.recent else "none yet"
    if status.ended is not None:
        return f"{status.ended}; its last flatshard collective: {last}"
    if status.waiting is not None:
        return f"waiting {status.waiting_s:.1f} s for {status.waiting}"
    if status.foreign is not None:
        return f"in {status.foreign[0]}, a collective flatshard did not issue"
    return f"not in a flatshard collective; its last: {last}"


def proven(group: str, ranks: list[int], statuses: dict[int, Status]) -> Proof | None:
    """Why waits on ``group`` can never end, if the statuses prove it (see [Note: a proven
    divergence]); None when a rank may just be slow."""
    ended = [r for r in ranks if (s := statuses.get(r)) is not None and s.ended is not None]
    waits = {
        r: s.waiting_on
        for r, s in statuses.items()
        if r in ranks and s.waiting_on is not None and s.waiting_on.group == group
    }
    calls = {r: w for r, w in waits.items() if w.call}
    callers = _callers(calls)
    if ended:
        who = ", ".join(f"rank {r} {statuses[r].ended}" for r in ended)
        why = f"Proven: {who}, and will never take part again."
        return Proof("PeerLostError", why + callers + _if_uneven(waits, calls))
    mismatch = _mismatched(group, ranks, statuses)
    if mismatch:
        return Proof("CollectiveMismatchError", f"Proven: {mismatch}, which can never pair.")
    debug = {r: s.debug for r, s in statuses.items() if r in ranks}
    if len(set(debug.values())) > 1:  # one side waits in the store, the other in the backend
        on = ", ".join(str(r) for r, d in debug.items() if d)
        off = ", ".join(str(r) for r, d in debug.items() if not d)
        why = (
            f"Proven: ranks {on} agree on every collective through the store first "
            f"(flatshard.Checks(debug=True)) and ranks {off} do not, so each waits for "
            "the other. Turn debug mode on (FLATSHARD_DEBUG=1 or flatshard.set_checks) on "
            "every rank alike, before the first collective."
        )
        return Proof("CollectiveMismatchError", why)
    for a, call in calls.items():
        blocked = _blocked_apart(group, ranks, statuses, a, call)
        if blocked is not None:
            b, foreign = blocked
            why = (
                f"Proven: rank {a} waits for the other ranks to call {call.call} while "
                f"rank {b} waits in {foreign}, a collective flatshard did not "
                f"issue, which rank {a} will not join: each waits for the other."
            )
            return Proof("CollectiveMismatchError", why + callers, settled=False)
        for b, other in waits.items():
            if not other.call and other.seq > call.issued:
                why = (
                    f"Proven: rank {a} waits for the other ranks to call {call.call} while "
                    f"rank {b} waits in collective #{other.seq}, which rank {a} has not "
                    "issued: each waits for the other."
                )
                return Proof("CollectiveMismatchError", why + callers, settled=False)
    for a, wait in waits.items():
        blocked = None if wait.call else _blocked_apart(group, ranks, statuses, a, wait)
        if blocked is not None:
            b, foreign = blocked
            why = (
                f"Proven: rank {a} waits in collective #{wait.seq}, which rank {b} has "
                f"not issued, while rank {b} waits in {foreign}, a collective "
                f"flatshard did not issue, which rank {a} will not join: each waits for "
                "the other."
            )
            return Proof("CollectiveMismatchError", why, settled=False)
    return None


def _blocked_apart(
    group: str, ranks: list[int], statuses: dict[int, Status], a: int, wait: Waited
) -> tuple[int, str] | None:
    """A rank blocked in a collective of the program's own, over ranks that include ``a``,
    that ``a`` (waiting for ``wait``) will not join: where ``a`` waits for a call, any such
    rank; where it waits in collective #N, one that has not issued #N (it cannot until its
    own collective ends). That rank and its collective, in words."""
    for b, status in statuses.items():
        if b not in ranks or status.foreign is None or a not in status.foreign[1]:
            continue
        if wait.call or max(_by_seq(group, status), default=0) < wait.seq:
            return b, status.foreign[0]
    return None


def _callers(calls: dict[int, Waited]) -> str:
    """``save_checkpoint was called on rank 0 only ...`` for the calls ranks wait in."""
    by_call: dict[str, list[int]] = {}
    for rank, waited in sorted(calls.items()):
        by_call.setdefault(waited.call, []).append(rank)
    sentences = []
    for call, ranks in by_call.items():
        where = {calls[r].where for r in ranks if calls[r].where}
        at = f" (at {', '.join(sorted(where))})" if where else ""
        who = ", ".join(str(r) for r in ranks)
        sentences.append(
            f" {call} was called on rank{'s' if len(ranks) > 1 else ''} {who} only{at}: it "
            f"must be called on every rank of the group, {_HOW.get(call, _EVERY_RANK)}."
        )
    return "".join(sentences)


_EVERY_RANK = "in the same order"
_WRITES = "each rank takes part (write from rank 0 inside it if need be)"
_HOW = {
    "no_sync": "the same number of times per step (run as many micro-batches on every rank)",
    "train_step": "with the same number of micro-batches on every rank",
    "save_checkpoint": _WRITES,
    "summon_full_params": _WRITES,
    "full_state_dict": _WRITES,
    "export_safetensors": _WRITES,
    # (the two forwards ranks agree on: [Note: a forward only some ranks run])
    "an evaluation forward": (
        "each rank its share of the evaluation batches, as many on every rank "
        "(DistributedSampler pads them), or decode inside summon_full_params entered on "
        "every rank"
    ),
    "a training forward": (
        "after as many evaluation batches on every rank (DistributedSampler pads them)"
    ),
}


def _if_uneven(waits: dict[int, Waited], calls: dict[int, Waited]) -> str:
    if not waits or calls:
        return ""
    return (
        " If the ranks ran out of batches unevenly, wrap the loop in flatshard.join(model) "
        "(see the guide, 'Uneven inputs') or give every rank the same number of batches."
    )


def _mismatched(group: str, ranks: list[int], statuses: dict[int, Status]) -> str:
    """Two ranks' records of one collective that differ, in words ("" if none)."""
    seen = {r: _by_seq(group, s) for r, s in statuses.items() if r in ranks}
    for seq in sorted({seq for calls in seen.values() for seq in calls}):
        said = {r: calls[seq] for r, calls in seen.items() if seq in calls}
        if len({agreed for _, agreed in said.values()}) > 1:
            text = "; ".join(f"rank {r} issued {said[r][0]}" for r in sorted(said))
            return f"the ranks issued different collectives as #{seq} ({text})"
    return ""


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
    idle = [
        r
        for r, seq in last.items()
        if seq < max(last.values()) and not statuses[r].waiting and not statuses[r].foreign
    ]
    if idle:
        who = ", ".join(str(r) for r in idle)
        hints.append(
            f"Rank(s) {who} issued fewer collectives and wait for none: they skipped a "
            "step, a backward or a unit, or ran out of batches (wrap the loop in "
            "flatshard.join(model, optimizers), or give every rank the same number: "
            "DistributedSampler(..., drop_last=True))."
        )
    if any(r not in statuses for r in ranks):
        hints.append("A rank that gives no answer has usually died: look for its traceback.")
    hints.append(SAME_CALLS)
    return hints
