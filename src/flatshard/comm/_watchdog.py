"""The watchdog: every flatshard collective named (``Tag``), recorded, waited for with a
timeout and diagnosed, as its settings (``flatshard.Checks``) say.

[Note: diagnosing a hang]
A rank that waits on a collective its peers never issue waits for the process group's
timeout (30 minutes by default) and then gets the backend's words ("Connection closed by
peer", "Timed out waiting 1800000ms"), which name neither the step nor the unit nor who
stopped. flatshard's waits on host-blocking backends (gloo) run in slices of ``SLICE_S``;
when one has waited past the timeout (``flatshard.Checks``), the rank asks every rank what
it is doing through the c10d store that ``init_process_group`` (or torchrun) already made.
The store is out of band: it answers while a peer is blocked in a native collective, and
a dead peer simply gives no answer. Each rank's responder thread polls the store for
requests every ``POLL_S`` and publishes its status: the collective it waits for, if any,
and its last collectives. A waiting rank that sees a request does not wait out its own
timeout: it takes part at once. So every rank in a flatshard wait raises the same
``CollectiveTimeoutError`` (or ``PeerLostError`` when the backend reports a closed
connection) within seconds of the first timeout.

A wait need not last until the timeout when the statuses already prove it can never end
([Note: a proven divergence] in ``_diagnosis.py``): a waiting rank probes every rank's
status after ``PROBE_S`` and then at doubling intervals, and where the table proves a peer
ended, a mismatch, or a call made on some ranks only, it starts the diagnosis at once with
that error. To prove that a peer ended, each rank leaves an exit record in the store as its
interpreter exits (how: returned, raised and what, or stopped by a signal it handled); a
process killed outright leaves none, and proves nothing. A process that multiprocessing
started (``torch.multiprocessing.spawn`` among them) leaves it as its function ends
instead: multiprocessing catches what the function raised (torch's ``spawn`` catches it
first and exits with status 1), so the interpreter never sees it, and a process forked
from a server ends without running the interpreter's exit at all.

[Note: no thread in torch at the interpreter's teardown]
A daemon thread that returns from a torch call once the interpreter's teardown has begun
(Python 3.11 and 3.12) is ended by ``pthread_exit`` on its way back into Python; the
unwinding passes a C++ destructor and the process aborts ("terminate called without an
active exception"), whatever its program did. flatshard's threads are in torch only for
store calls: the responder's, and the exit record's (a store client sends one call at a
time, so even a ``set`` waits while another thread's call waits for an answer). A call
answered late (a loaded machine, a stalled store host) returns whenever the host answers,
so the exit waits until both threads have left their calls, up to ``_EXIT_JOIN_S`` in all:
a store silent for that long is not expected to answer in the instants the teardown takes,
and an exit must not hang on a store that never answers.

The store is polled with ``check``, never waited on with a timeout: each timed-out
``Store.wait`` makes torch's c10d log two lines, a flood over a long wait.

On backends whose wait does not block the host (NCCL: it makes the stream wait), the wait
is left to the backend's own watchdog.

``Record``: one flatshard collective as the watchdog keeps it and the reports name it.

``flatshard.Checks``, the settings: how long a collective may wait, and whether to check
each one first.

[Note: what the checks cost]
Always on: every flatshard collective is recorded (a few hundred nanoseconds), waited for
in slices of ``SLICE_S`` on backends whose wait blocks the host (gloo), and compared across
ranks by one 8-byte digest per step (the ledger of ``_agreement.py``). Calls that a program
may make on some ranks only (``summon_full_params``, state dicts, ``clip_grad_norm_``,
checkpoints) first agree through the c10d store, so a rank that calls one alone waits there
instead of sending mismatched buffers to the backend (gloo aborts the process on a size
mismatch). Debug mode agrees through the store before every collective: a few store round
trips each, which a training step notices (``benchmarks/watchdog_overhead.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from datetime import timedelta
from types import FrameType
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist

from flatshard.comm._diagnosis import SAME_CALLS, Status, Waited, ended_as, proven, report
from flatshard.comm._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    SlowCollectiveWarning,
)

TIMEOUT_ENV = "FLATSHARD_TIMEOUT"  # seconds
DEBUG_ENV = "FLATSHARD_DEBUG"  # "1": check every collective's descriptor first
_DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo and NCCL groups
# A wait this many times the slowest step (and at least this long) gets a warning first.
WARN_AFTER_STEPS = 10
MIN_WARN_AFTER_S = 60.0


@dataclass(frozen=True)
class Checks:
    """How flatshard watches its collectives, in this process (``flatshard.set_checks``).

    Args:
        timeout: seconds a flatshard collective may wait before every rank raises
            ``flatshard.CollectiveTimeoutError`` with what each rank was doing. None: the
            ``FLATSHARD_TIMEOUT`` environment variable, else the process group's own
            timeout (``init_process_group(timeout=...)``, 30 minutes by default).
        debug: agree on every collective's descriptor (op, unit, sizes, dtype, sequence
            number) through the c10d store before issuing it, so the first mismatch is
            reported before it reaches the backend. Slower; for finding a desync. None:
            the ``FLATSHARD_DEBUG`` environment variable ("1" turns it on).
        warn_after: seconds a flatshard collective may wait before every waiting rank
            prints, as a ``flatshard.SlowCollectiveWarning``, the diagnosis the timeout
            would raise, and waits on. None: 10 times the slowest step so far, and at
            least a minute. No warning where it would come at or after the timeout.
    """

    timeout: float | None = None
    debug: bool | None = None
    warn_after: float | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"flatshard.Checks: timeout must be > 0 seconds, got {self.timeout}")
        if self.warn_after is not None and not self.warn_after > 0:
            raise ValueError(
                f"flatshard.Checks: warn_after must be > 0 seconds, got {self.warn_after}"
            )

    def warn_after_s(self, slowest_step_s: float) -> float:
        """When a wait is worth a warning, given the slowest step seen so far."""
        if self.warn_after is not None:
            return self.warn_after
        return max(MIN_WARN_AFTER_S, WARN_AFTER_STEPS * slowest_step_s)

    def timeout_s(self, group: dist.ProcessGroup) -> float:
        """The timeout in force for a collective over ``group``."""
        if self.timeout is not None:
            return self.timeout
        if (env := os.environ.get(TIMEOUT_ENV)) is not None:
            try:
                return float(env)
            except ValueError:
                raise ValueError(
                    f"{TIMEOUT_ENV} must be a number of seconds, got {env!r}"
                ) from None
        return _group_timeout(group)

    @property
    def debug_on(self) -> bool:
        if self.debug is not None:
            return self.debug
        return os.environ.get(DEBUG_ENV, "") not in ("", "0")


Checks.__module__ = "flatshard"


@dataclass(frozen=True)
class Tag:
    """What a collective is for, in the user's terms: the ledger's and the reports' words."""

    phase: str  # "forward", "backward", "clip_grad_norm_", "summon_full_params", ...
    unit: str = ""  # the unit's name, "" when the collective is not for one unit
    step: int = 0  # backward passes completed by the model's root (NO_STEP: none)


NO_STEP = -1  # a call that belongs to no one model's steps (a pipeline's schedule step)


_SETTINGS = [Checks()]  # this process's, set by set_checks


def set_checks(checks: Checks) -> None:
    """Use ``checks`` for every flatshard collective of this process from now on.

    One setting per process, like ``init_process_group``'s timeout: the watchdog that
    applies it serves every model of the process.
    """
    if not isinstance(checks, Checks):
        raise TypeError(f"flatshard.set_checks: expected a flatshard.Checks, got {checks!r}")
    _SETTINGS[0] = checks
    _DEBUG.clear()


def current_checks() -> Checks:
    """The ``Checks`` in force (``set_checks``; by default the environment's and the group's)."""
    return _SETTINGS[0]


_DEBUG: list[bool] = []  # debug_on of the Checks in force, once read (set_checks resets it)


def debug_enabled() -> bool:
    """Whether debug mode is on: asked before every collective, so read once."""
    if not _DEBUG:
        _DEBUG.append(current_checks().debug_on)
    return _DEBUG[0]


_CURRENT: ContextVar[Tag | None] = ContextVar("flatshard_tag", default=None)
_UNTAGGED = Tag("flatshard")


def current_tag() -> Tag:
    """The tag of the flatshard call running now (for collectives not issued by a unit)."""
    return _CURRENT.get() or _UNTAGGED


@contextmanager
def tagged(tag: Tag) -> Iterator[None]:
    """Tag the collectives issued inside (that do not name a tag of their own)."""
    token = _CURRENT.set(tag)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The timeout ``group`` was created with (torch's default if it cannot be read)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            backend = group._get_backend(device)
            timeout = backend.options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
    return _DEFAULT_TIMEOUT_S


SLICE_S = 1.0  # a wait looks for diagnosis requests this often
PROBE_S = 2.0  # a wait this long asks every rank's status, to look for a proof; then doubling
_RECHECK_S = 1.0  # a proof from a snapshot of waits is looked at again this much later
_MAX_PROBE_GAP_S = 30.0
POLL_S = 0.5  # a responder thread looks for diagnosis requests this often
_GRACE_S = 3 * POLL_S + 2.5  # how long answers are awaited (slack for a loaded machine)
_KEPT = 16  # collectives a rank reports
_REQUESTS = "flatshard/diagnosis/requests"
_WARNINGS = "flatshard/warning/requests"  # early words: asked for, answered, nobody raises
_PROBES = "flatshard/probe/requests"  # looks for a proof: asked for, answered, nobody raises
_EXITS = "flatshard/exit/"  # + rank: the exit record
_EXIT_JOIN_S = 10.0  # the longest an exit waits for its threads to leave their store calls
_ERRORS: dict[str, type[CollectiveError]] = {
    e.__name__: e for e in (CollectiveTimeoutError, PeerLostError, CollectiveMismatchError)
}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_Attempt = Callable[[float], bool]  # wait up to this many seconds: True if done


class _Tracked(NamedTuple):
    """A collective in flight: waited for through ``Watchdog.wait``."""

    work: dist.Work
    record: Record
    group: dist.ProcessGroup


class Watchdog:
    """The collectives of this process, and its side of the out-of-band diagnosis."""

    def __init__(self, world: dist.ProcessGroup) -> None:
        self.world: dist.ProcessGroup | None = world  # None once released at exit
        self.store = dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank()
        self.recent: deque[Record] = deque(maxlen=_KEPT)
        self._seq: dict[str, int] = {}  # group name -> collectives issued on it
        self._agreements: dict[str, int] = {}  # group name -> agreements made on it
        self._tracked: list[_Tracked] = []
        self.waiting: tuple[str, float, Waited | None] | None = None  # what, since, in terms
        self.seen_requests = self._requests()  # earlier incidents are not ours
        self._suspected: str | None = None  # a proof seen once in a snapshot of waits
        # The slowest interval between two ends of a backward pass: a wait far longer
        # than that is worth a word before the timeout (Checks.warn_after).
        self.slowest_step_s = 0.0
        self._last_step_end: float | None = None
        self.failed = False  # raised: collectives may be left in flight
        self._stop = threading.Event()
        self._answered = self.seen_requests
        self._warnings_answered = int(self.store.add(_WARNINGS, 0))
        self._probes_answered = int(self.store.add(_PROBES, 0))
        self._answer_lock = threading.Lock()
        self._thread = threading.Thread(target=self._respond, name="flatshard-watchdog")
        self._thread.daemon = True
        self._thread.start()
        self._exit_recorded = False
        atexit.register(self._at_exit)
        if multiprocessing.parent_process() is not None:  # see the module's note
            multiprocessing.util.Finalize(None, self._at_function_end, exitpriority=10)

    # ------------------------------------------------------------------ recording
    def issue(self, group: dist.ProcessGroup, op: str, numel: int, dtype: str, tag: Tag) -> Record:
        """Record a collective about to be issued (debug mode: agree on it first)."""
        name = group.group_name
        seq = self._seq[name] = self._seq.get(name, 0) + 1
        record = Record(seq, name, op, numel, dtype, tag.phase, tag.unit, tag.step)
        if debug_enabled():
            self.agree(group, record)
        self.recent.append(record)
        return record

    def track(self, work: dist.Work, record: Record, group: dist.ProcessGroup) -> None:
        self._tracked.append(_Tracked(work, record, group))
        del self._tracked[:-_KEPT]  # works dropped unwaited must not pile up

    def entry(self, group: dist.ProcessGroup, tag: Tag) -> None:
        """A call every rank of ``group`` must make (summon, state dict, clip, checkpoint):
        agree on it through the store before any of its collectives reach the backend."""
        if group.size() == 1:
            return
        seq = self._seq.get(group.group_name, 0)
        record = Record(seq, group.group_name, "call", 0, "", tag.phase, tag.unit, tag.step)
        call = tag.phase.split("(")[0].strip()  # without its values
        self.agree(group, record, Waited(group.group_name, seq, 0, "", call, _program_line()))

    def step_ended(self) -> None:
        """A backward pass ended: the slowest step so far sets when a wait is worth a
        warning."""
        now = time.monotonic()
        if self._last_step_end is not None:
            self.slowest_step_s = max(self.slowest_step_s, now - self._last_step_end)
        self._last_step_end = now

    # ------------------------------------------------------------------ waiting
    def wait(self, work: dist.Work) -> None:
        """Wait for ``work``: with a timeout and a diagnosis where the wait blocks the host."""
        found = next((t for t in self._tracked if t.work is work), None)
        if found is not None:  # a work holds its tensors: never kept past its wait
            self._tracked.remove(found)
        if found is None or dist.get_backend(found.group) != dist.Backend.GLOO:
            work.wait()
            return
        start = time.monotonic()
        try:
            if _try_wait(work, SLICE_S):  # the common case, kept cheap: done within a slice
                return
        except RuntimeError:
            pass  # a peer left: waited for again below, which says so
        timeout = current_checks().timeout_s(found.group)
        what = found.record.describe()
        record = found.record
        seq = self._seq.get(record.group, 0)
        waited = Waited(record.group, seq, record.seq, record.agreed(), "", "")
        try:
            attempt = lambda s: _try_wait(work, s)  # noqa: E731
            self._waiting_for(what, found.group, timeout, attempt, start, waited)
        except CollectiveError:
            self._tracked.append(found)  # left in flight: the exit must not wait for it
            raise

    def _waiting_for(
        self,
        what: str,
        group: dist.ProcessGroup,
        timeout: float,
        attempt: _Attempt,
        start: float | None = None,
        terms: Waited | None = None,
    ) -> None:
        """Call ``attempt`` in slices until it succeeds; diagnose a timeout, a request from
        another rank, a proof that the wait can never end, or a failed collective (a peer
        that left)."""
        start = time.monotonic() if start is None else start
        self.waiting = (what, start, terms)
        warn_after = current_checks().warn_after_s(self.slowest_step_s)
        warned = warn_after >= timeout  # the timeout comes first: no warning
        probe_gap = PROBE_S
        probe_at = start + probe_gap
        try:
            while True:
                try:
                    requested = self._requests() > self.seen_requests
                except RuntimeError as error:  # the store went with its host
                    cause = f"flatshard: the c10d store stopped answering; rank {self.rank}"
                    self._diagnose(group, f"{cause} waited for {what}", PeerLostError, error)
                if requested:
                    self._join_diagnosis(group, what)
                waited = time.monotonic() - start
                if not warned and waited >= warn_after:
                    warned = True
                    self._warn(group, what, waited, timeout)
                remaining = timeout - waited
                if time.monotonic() >= probe_at and remaining > 0:
                    again = self._probe(group, what, attempt)
                    probe_gap = min(2 * probe_gap, _MAX_PROBE_GAP_S)
                    probe_at = time.monotonic() + (_RECHECK_S if again else probe_gap)
                if remaining <= 0:
                    cause = f"flatshard: {what} did not complete within {timeout:g} s"
                    self._diagnose(group, f"{cause} (seen on rank {self.rank})")
                try:
                    if attempt(max(0.001, min(SLICE_S, remaining))):
                        return
                except RuntimeError as error:
                    cause = f"flatshard: a peer left while rank {self.rank} waited for {what}"
                    self._diagnose(group, cause, PeerLostError, error)
        finally:
            self.waiting = None

    def _probe(self, group: dist.ProcessGroup, what: str, attempt: _Attempt) -> bool:
        """Ask every rank's status; where it proves that the wait can never end, start the
        diagnosis with that proof's error (see the module's note). Nothing else happens:
        a probe is cheap, and a rank that is merely slow is left to the timeout. True when
        a proof from what ranks wait for was seen once and wants a second look."""
        ranks = dist.get_process_group_ranks(group)
        try:
            generation = int(self.store.add(_PROBES, 1))
            self._publish(generation, "probe")
            statuses = self._collect(generation, ranks, "probe")
        except Exception:  # the store went with its host: the next slice says so
            return False
        proof = proven(group.group_name, ranks, statuses)
        suspected, self._suspected = self._suspected, None
        if proof is None or attempt(0.001):  # (a peer that ended may have finished it)
            return False
        if not proof.settled and proof.why != suspected:  # seen once: look again soon
            self._suspected = proof.why
            return True
        cause = f"flatshard: rank {self.rank} waited for {what}, which can never complete"
        self._diagnose(group, cause, _ERRORS[proof.error])

    def ended_peers(self, ranks: list[int]) -> dict[int, str]:
        """See the module function ``ended_peers``."""
        try:
            generation = int(self.store.add(_PROBES, 1))
            self._publish(generation, "probe")
            statuses = self._collect(generation, ranks, "probe")
        except Exception:  # the store went with its host: nothing more to say
            return {}
        found = {r: statuses.get(r) for r in ranks if r != self.rank}
        return {
            r: ended_as(status) for r, status in found.items() if status is None or status.ended
        }

    # ------------------------------------------------------------------ agreement
    def agree(self, group: dist.ProcessGroup, record: Record, waited: Waited | None = None) -> None:
        """Every rank of ``group`` shows the same ``record`` through the store, or raises."""
        name = group.group_name
        count = self._agreements[name] = self._agreements.get(name, 0) + 1
        prefix = f"flatshard/agree/{name}/{count}/"
        ranks = dist.get_process_group_ranks(group)
        keys = [prefix + str(r) for r in ranks]
        what = f"the other ranks to reach {record.describe()}"
        try:
            self.store.set(prefix + str(self.rank), record.descriptor())
            done = _try_keys(self.store, keys, SLICE_S)  # the common case, kept cheap
        except RuntimeError as error:  # the store went with its host (rank 0 has ended)
            self.waiting = (what, time.monotonic(), waited)  # (this rank's line of the table)
            cause = f"flatshard: the c10d store stopped answering; rank {self.rank}"
            self._diagnose(group, f"{cause} waited for {what}", PeerLostError, error)
        if not done:
            timeout = current_checks().timeout_s(group)
            attempt = lambda s: _try_keys(self.store, keys, s)  # noqa: E731
            self._waiting_for(what, group, timeout, attempt, None, waited)
        values = self.store.multi_get(keys)  # one round trip for every rank's record
        seen = {r: v.decode() for r, v in zip(ranks, values, strict=True)}
        if count > 2:  # every rank has read agreement count - 2 before writing this one
            self.store.delete_key(f"flatshard/agree/{name}/{count - 2}/{self.rank}")
        if len(set(seen.values())) > 1 and (  # alike: the common case, nothing decoded
            len({Record.from_descriptor(text).agreed() for text in seen.values()}) > 1
        ):
            raise CollectiveMismatchError(_mismatch(seen, self.rank))

    def _warn(self, group: dist.ProcessGroup, what: str, waited: float, timeout: float) -> None:
        """The diagnosis a timeout would raise, as a warning; the wait goes on. Every
        rank's status comes through the store, as for the error, but under a key of its
        own: no rank raises for it. Where the store does not answer, no warning."""
        ranks = dist.get_process_group_ranks(group)
        try:
            generation = int(self.store.add(_WARNINGS, 1))
            self._publish(generation, "warning")
            statuses = self._collect(generation, ranks, "warning")
        except Exception:  # the timeout will say what happened
            return
        given = current_checks().warn_after
        if given is not None:
            why = f"past Checks(warn_after={given:g})"
        elif self.slowest_step_s:
            why = f"over {WARN_AFTER_STEPS}x the slowest step so far, {self.slowest_step_s:.1f} s"
        else:
            why = f"over {MIN_WARN_AFTER_S:g} s, and no two steps have ended yet"
        cause = (
            f"flatshard: rank {self.rank} has waited {waited:.0f} s for {what} ({why}). It "
            f"waits on until the timeout ({timeout:g} s), then raises on every rank."
        )
        settings = (
            "This early word comes after flatshard.Checks(warn_after=...) seconds (by "
            "default 10x the slowest step, at least 60 s); the timeout after "
            "Checks(timeout=...) or FLATSHARD_TIMEOUT."
        )
        warnings.warn(
            report(cause, group.group_name, ranks, statuses, settings),
            SlowCollectiveWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ diagnosis
    def _requests(self) -> int:
        return int(self.store.add(_REQUESTS, 0))

    def _diagnose(
        self,
        group: dist.ProcessGroup,
        cause: str,
        error: type[Exception] = CollectiveTimeoutError,
        original: BaseException | None = None,
    ) -> NoReturn:
        """Ask every rank what it is doing; raise ``error`` with the table on this rank."""
        ranks = dist.get_process_group_ranks(group)
        self.failed = True
        try:
            statuses = self._ask_everyone(ranks, error)
        except Exception as unreachable:  # its host (rank 0, or the launcher) is gone
            statuses = {self.rank: self._status()}  # (what this rank knows of itself)
            cause += f" (the c10d store did not answer either: {unreachable})"
        timeout = current_checks().timeout_s(group)
        settings = (
            f"Timeout in force: {timeout:g} s (flatshard.set_checks(flatshard.Checks(timeout=...)) "
            "or FLATSHARD_TIMEOUT; by default the process group's own). FLATSHARD_DEBUG=1 "
            "checks every collective across ranks before it is issued."
        )
        # A peer that timed out too asks as well: answer before this rank can exit (unless
        # the store is gone: then nobody is left to ask).
        with contextlib.suppress(Exception):
            self._answer_pending()
        raise error(report(cause, group.group_name, ranks, statuses, settings)) from original

    def _ask_everyone(self, ranks: list[int], error: type[Exception]) -> dict[int, Status]:
        """Every answering rank's status, through the store (see the module's note)."""
        current = self._requests()
        generation = current
        if current <= self.seen_requests:  # the first to ask: say why, for those who join
            generation = int(self.store.add(_REQUESTS, 1))
            self.store.set(f"flatshard/diagnosis/{generation}/cause", error.__name__)
        self._publish(generation)
        statuses = self._collect(generation, ranks)
        self.seen_requests = max(self.seen_requests, generation)
        return statuses

    def _join_diagnosis(self, group: dist.ProcessGroup, what: str) -> NoReturn:
        """Another rank asked: raise its kind of error (a lost peer, or a timeout)."""
        try:
            key = f"flatshard/diagnosis/{self._requests()}/cause"
            found = _try_keys(self.store, [key], SLICE_S)
            name = self.store.get(key).decode() if found else CollectiveTimeoutError.__name__
        except RuntimeError:  # the store went with its host: someone is gone
            name = PeerLostError.__name__
        seen = {
            PeerLostError.__name__: "a peer left",
            CollectiveMismatchError.__name__: "another rank found the ranks' calls differ",
        }.get(name, "another rank timed out")
        cause = f"flatshard: {seen}; rank {self.rank} waited for {what}"
        self._diagnose(group, cause, _ERRORS.get(name, CollectiveTimeoutError))

    def _status(self, ended: str | None = None) -> Status:
        waiting = self.waiting
        return Status(
            rank=self.rank,
            host=socket.gethostname(),
            waiting=None if waiting is None else waiting[0],
            waiting_s=0.0 if waiting is None else time.monotonic() - waiting[1],
            recent=[(r.group, r.seq, r.describe(), r.agreed()) for r in list(self.recent)],
            waiting_on=None if waiting is None else waiting[2],
            ended=ended,
            debug=debug_enabled(),
            foreign=None if waiting is not None else _foreign_collective(),
        )

    def _publish(self, generation: int, kind: str = "diagnosis") -> None:
        status = self._status()
        self.store.set(f"flatshard/{kind}/{generation}/{self.rank}", json.dumps(status.to_json()))

    def _collect(
        self, generation: int, ranks: list[int], kind: str = "diagnosis"
    ) -> dict[int, Status]:
        """Every rank's answer, or its exit record where it has ended; within the grace."""
        keys = {r: f"flatshard/{kind}/{generation}/{r}" for r in ranks}
        exits = {r: _EXITS + str(r) for r in ranks}
        found: dict[int, Status] = {}
        deadline = time.monotonic() + _GRACE_S
        while True:
            for rank in ranks:
                if rank in found:
                    continue
                for key in (keys[rank], exits[rank]):
                    if self.store.check([key]):
                        found[rank] = Status.from_json(json.loads(self.store.get(key)))
                        break
            if len(found) == len(ranks) or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _respond(self) -> None:
        """The responder thread: answer diagnosis requests until stopped or the store goes."""
        while not self._stop.wait(POLL_S):
            try:
                self._answer_pending()
            except Exception:  # the store went away: the job is over
                return

    def _answer_pending(self) -> None:
        """Publish this rank's status for every diagnosis asked for so far. Also called by
        a rank about to raise or exit after a diagnosis: its responder thread might not
        look again before the process ends, and a peer's table would lack this rank."""
        with self._answer_lock:
            requested = self._requests()
            while self._answered < requested:
                self._answered += 1
                self._publish(self._answered)
            warnings_requested = int(self.store.add(_WARNINGS, 0))
            while self._warnings_answered < warnings_requested:
                self._warnings_answered += 1
                self._publish(self._warnings_answered, "warning")
            probes_requested = int(self.store.add(_PROBES, 0))
            while self._probes_answered < probes_requested:
                self._probes_answered += 1
                self._publish(self._probes_answered, "probe")

    def leave_exit_record(self, how: str, deadline: float | None = None) -> None:
        """Say in the store how this process ends (see the module's note), giving up at
        ``deadline`` (by default ``_EXIT_JOIN_S`` from now): the exit must not hang on a
        store that does not answer ([Note: no thread in torch at the interpreter's
        teardown])."""
        if self.world is None:
            return
        record = json.dumps(self._status(how).to_json())

        def write() -> None:
            with contextlib.suppress(Exception):  # (the store may have gone with its host)
                self.store.set(_EXITS + str(self.rank), record)

        writer = threading.Thread(target=write, name="flatshard-exit-record", daemon=True)
        writer.start()
        deadline = time.monotonic() + _EXIT_JOIN_S if deadline is None else deadline
        writer.join(timeout=max(0.0, deadline - time.monotonic()))

    def _at_function_end(self) -> None:
        """The exit record of a process multiprocessing started, as its function ends
        (multiprocessing's finalizers run while what it raised is still in flight). Only
        the process's latest watchdog: an earlier one's world is gone."""
        if _WATCHDOG is not self:
            return
        self.leave_exit_record(_how_the_function_ended(sys.exc_info()[1]))
        self._exit_recorded = True

    def _at_exit(self) -> None:
        deadline = time.monotonic() + _EXIT_JOIN_S
        if self.failed:
            with contextlib.suppress(Exception):  # (the store may have gone with its host)
                self._answer_pending()
        self._stop.set()
        if not self._exit_recorded:
            self.leave_exit_record(_how_it_ended(), deadline)
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.failed and any(not t.work.is_completed() for t in self._tracked):
            # A collective left in flight after the error would hold the process at exit
            # until the backend's own timeout (its worker thread cannot be joined).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if not dist.is_initialized():
            # Process groups must not outlive the interpreter's teardown: see
            # StepContext.release_process_groups (gloo's workers would abort the exit).
            self._tracked.clear()
            self.world = None


def _try_wait(work: dist.Work, seconds: float) -> bool:
    """Wait up to ``seconds``: True if done. A failed collective raises RuntimeError."""
    try:
        work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as error:
        if "Operation timed out" in str(error):
            return False
        raise
    return True


def _try_keys(store: dist.distributed_c10d.Store, keys: list[str], seconds: float) -> bool:
    """Whether ``keys`` are all set within ``seconds``: polled, never waited on (see the
    module's note)."""
    deadline = time.monotonic() + seconds
    pause = 0.00005
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return True


def _how_it_ended() -> str:
    """This process's end, in the words of the exit record."""
    error = getattr(sys, "last_value", None)  # an uncaught exception ends the program
    if error is not None:
        return _by_exception(error)
    return "ended normally (its program returned or called sys.exit)"


def _how_the_function_ended(error: BaseException | None) -> str:
    """How the function of a process multiprocessing started ended, ``error`` what it
    raised (in flight): torch's ``spawn`` catches an exception and calls ``sys.exit(1)``,
    so the exit carries the exception it was handling."""
    if isinstance(error, SystemExit):
        if error.code in (0, None):
            return "ended normally (its function returned or called sys.exit)"
        cause = error.__context__
        if cause is None or isinstance(cause, SystemExit):
            return f"exited with status {error.code}"
        return f"{_by_exception(cause)} (caught by its launcher, which exited with status 1)"
    if error is not None:
        return _by_exception(error)
    return "ended normally (its function returned)"


def _by_exception(error: BaseException) -> str:
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return f"ended by an exception, {type(error).__name__}: {text}"


# torch.distributed's functions that wait for the group's other ranks when called
TORCH_COLLECTIVES = frozenset(
    [
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
    ]
)
# The collectives a thread can be waiting in: not those that return objects, which
# (un)pickle them after their communication, in frames of their own or of the objects'
# classes (a __setstate__ that rebuilds an index): a rank there has done its part. Only a
# thread whose innermost frame is one of these waits.
_WAITING_COLLECTIVES = TORCH_COLLECTIVES - frozenset(
    ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]
)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
# flatshard's parts that are programs calling it (the CLI's loop, the integrations' trainers,
# the test harness), not calls of it
_PROGRAMS = tuple(
    os.path.join(_PACKAGE, part) + os.sep for part in ("cli", "integrations", "testing")
)


def _foreign_collective() -> tuple[str, list[int]] | None:
    """[Note: a collective flatshard does not see]
    A program may issue torch.distributed collectives of its own (a metric's all-reduce,
    Accelerate's gather of the losses) between flatshard's calls. One made on some ranks
    while another waits in a flatshard call agreed through the store, or in a collective
    of flatshard's that the first has not issued, can never complete: the waiting rank
    joins no collective until the others reach the call or issue the collective. So a rank's
    status says which of torch's blocking collectives its program's (main) thread is in,
    where no call of flatshard is above it (flatshard waits for its own in slices, outside
    torch's functions; a collective inside a flatshard call is flatshard's; its CLI,
    integrations and test harness are programs), with the ranks of its group; ``proven``
    in ``_diagnosis.py`` then names both sides. Only a thread whose innermost frame is the
    collective waits in it: one inside ``broadcast_object_list`` unpickling what it
    received (seconds, for an object that rebuilds an index) has done its part."""
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    stack: list[FrameType] = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    stack.reverse()  # outermost first
    innermost = stack[-1].f_code if stack else None
    if (
        innermost is None
        or not innermost.co_filename.endswith(_C10D)
        or innermost.co_name not in _WAITING_COLLECTIVES
    ):
        return None  # not waiting in a collective now (e.g. unpickling what one received)
    for index, frame in enumerate(stack):
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(_PROGRAMS):
            return None  # inside a flatshard call: its collectives are flatshard's
        if path.endswith(_C10D) and frame.f_code.co_name in TORCH_COLLECTIVES:
            callers = [f for f in stack[:index] if "/torch/" not in f.f_code.co_filename]
            at = callers[-1] if callers else frame
            where = f"{os.path.basename(at.f_code.co_filename)}:{at.f_lineno}"
            try:
                ranks = dist.get_process_group_ranks(
                    frame.f_locals.get("group") or dist.group.WORLD
                )
            except (ValueError, RuntimeError):
                return None
            return f"torch.distributed.{frame.f_code.co_name} (called at {where})", ranks
    return None


def _program_line() -> str:
    """The line of the program that called flatshard: the first frame outside flatshard,
    torch and installed packages (transformers' ``generate`` calling a forward is not the
    program's line; the line that called ``generate`` is), else outside flatshard and
    torch."""
    frame: FrameType | None = sys._getframe(1)
    fallback = ""
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_PACKAGE) and "/torch/" not in path and "contextlib" not in path:
            line = f"{os.path.basename(path)}:{frame.f_lineno}"
            if "-packages/" not in path:
                return line
            fallback = fallback or line
        frame = frame.f_back
    return fallback


def _mismatch(seen: dict[int, str], rank: int) -> str:
    lines = [
        f"flatshard: ranks are about to issue different collectives (seen on rank {rank}); "
        "nothing was sent:"
    ]
    records = {r: Record.from_descriptor(d) for r, d in sorted(seen.items())}
    lines += [f"  rank {r}: {record.describe()}" for r, record in records.items()]
    calls = {record.phase.split("(")[0].strip() for record in records.values()}
    if len(calls) == 1 and len({record.phase for record in records.values()}) > 1:
        (call,) = calls  # one call, other arguments: say so rather than "the same calls"
        lines.append(
            f"Every rank called {call} at the same point, with other arguments (above): "
            f"pass the same values to {call} on every rank (a path built from the rank, or "
            "a setting read on one rank only, differs)."
        )
    else:
        lines.append(SAME_CALLS)
    return "\n".join(lines)


_WATCHDOG: Watchdog | None = None


def ended_peers(ranks: list[int]) -> dict[int, str]:
    """How each rank of ``ranks`` that has ended did (its exit record), or that it gives no
    answer (killed); nothing for the ranks that answer. For an error that a peer's end
    would explain, met outside a watched collective (an asynchronous save's writer):
    one probe, within the grace."""
    if _WATCHDOG is None or _WATCHDOG.world is None:
        return {}
    return _WATCHDOG.ended_peers(ranks)


def leave_exit_record(how: str) -> None:
    """Say in the store how this process ends, where it has a watchdog: for a process about
    to end by a signal, which runs no exit handler."""
    if _WATCHDOG is not None:
        _WATCHDOG.leave_exit_record(how)


def watchdog() -> Watchdog | None:
    """This process's watchdog (made on first use); None outside a distributed job."""
    global _WATCHDOG
    world = dist.group.WORLD  # None before init_process_group and after destroy
    if _WATCHDOG is not None and _WATCHDOG.world is world and world is not None:
        return _WATCHDOG  # the common case, on every collective: no backend lookup
    if world is None or dist.get_backend(world) == dist.Backend.FAKE:
        return None  # (fake: the planner's simulated world, where no peer runs)
    _WATCHDOG = Watchdog(world)
    return _WATCHDOG


# ---------------------------------------------------------------- a record of one collective
@dataclass(frozen=True)
class Record:
    """One collective (or one call every rank must make) on a group, in issue order."""

    seq: int  # this rank's count of flatshard collectives on the group, this one included
    group: str  # the group's name
    op: str  # "all_gather", "reduce", "all_reduce", "broadcast", ... ("call": an entry)
    numel: int  # elements this rank sends
    dtype: str
    phase: str  # "forward", "backward", "clip_grad_norm_", ...
    unit: str  # the unit's name, "" if none
    step: int  # backward passes the model's root completed (NO_STEP: none to tell)

    def describe(self, sizes: bool = True, step: bool = True) -> str:
        """In user terms, e.g. collective #7 (step 1, forward): all_gather of unit 'b' ...
        (``sizes=False``: without the elements this rank sends; ``step=False``: without
        the step)."""
        step = step and self.step != NO_STEP
        if self.op == "call":
            at = f" at step {self.step}" if step else ""
            return f"{self.phase}{at} (after collective #{self.seq})"
        unit = f" of unit '{self.unit}'" if self.unit else ""
        data = f"{self.numel:,} {self.dtype}" if sizes else self.dtype
        when = f"step {self.step}, " if step else ""
        return f"collective #{self.seq} ({when}{self.phase}): {self.op}{unit} ({data})"

    def agreed(self) -> str:
        """What every rank's record of this collective must say alike: ``describe()``
        without the step, and for an all-to-all without the elements this rank sent
        (uneven by design: each rank sends what the others asked of it).

        [Note: the step is not agreed] The step says where in training a collective
        fell, each model counting its own root's backward passes; the ranks of a
        pipeline's group hold different stages (different models), whose counts differ
        by design (a last stage's root completes a backward per micro-batch). The
        collective itself, its sequence number, kind, call, unit and size, is what every
        rank must issue alike; a rank at another step issues another collective sooner or
        later, and that is compared."""
        return self.describe(sizes=self.op != "all_to_all", step=False)

    def descriptor(self) -> str:
        """What every rank must agree on, as text that travels through the store."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_descriptor(text: str) -> Record:
        return Record(**json.loads(text))
