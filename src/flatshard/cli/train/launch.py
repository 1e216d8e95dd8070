"""``flatshard train``'s own launcher: one process per local rank, stopped together.

Without torchrun, ``flatshard train --nproc N`` starts its ranks here. A rank that fails
stops the others (they would wait in a collective forever) and is named with its exit
code or signal; SIGTERM / SIGINT to the launcher stop every rank; a launcher killed with
SIGKILL takes its ranks with it.

The ranks are forked from a server that imported torch and flatshard once ([Note: fast
ranks] in ``comm/_processes.py``), not spawned (each importing them again: seconds of CPU
per rank). Their parent is then that server, so each rank watches the launcher itself
(``stop_with_launcher``), and writes where the launcher writes when it starts them
(``CallerOutput``: the server's own output may be elsewhere by then).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from flatshard.cli.internals import CallerOutput, adopt_environment, fast_context

STOP_GRACE_S = 5.0  # how long stopped ranks may take before SIGKILL
PREEMPT_GRACE_S = 300.0  # ... when they finish a step and save first (--ckpt-on-preempt)


def run_local_ranks(
    nproc: int, worker: Callable[..., None], args: tuple[Any, ...], grace_s: float = STOP_GRACE_S
) -> int:
    """Run ``worker(rank, *args)`` in one process per local rank (with the launcher's
    environment); stop them all at the first failure or signal; the exit code for the
    command.

    SIGTERM / SIGINT to the launcher are passed to every rank, which then have ``grace_s``
    seconds before SIGKILL; the launcher returns once every rank has ended ([Note: ranks
    watched by process descriptor]); a launcher killed outright takes its ranks with it
    (``stop_with_launcher``). The rank that failed first is named, with its exit code or
    the signal that killed it.
    """
    ctx = fast_context()
    launcher, env = os.getpid(), dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(worker, r, args, (launcher, env, CallerOutput())))
        for r in range(nproc)
    ]
    for proc in procs:
        proc.start()
    ranks = [_Rank(proc) for proc in procs]
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: received.append(s)) for sig in _STOP}
    try:
        first = _supervise(ranks, received, grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for each in ranks:
            each.close()
    if received:
        print(f"flatshard train: stopped all ranks on {signal.Signals(received[0]).name}")
        return 128 + received[0]
    if first is not None and first[1] == 128 + signal.SIGTERM:  # stopped itself on SIGTERM
        print(f"flatshard train: rank {first[0]} stopped on SIGTERM; stopped the other ranks")
        return first[1]
    if first is not None:
        rank, code = first
        print(
            f"flatshard train: rank {rank} {_how(code)}; stopped the other ranks", file=sys.stderr
        )
        return 1
    return 0


_STOP = (signal.SIGTERM, signal.SIGINT)


class _Rank:
    """A rank's process, watched and signalled through a descriptor of the process itself
    where the kernel has them (Linux 5.3).

    [Note: ranks watched by process descriptor]
    The ranks are forked by multiprocessing's fork server, and a ``Process`` learns of its
    end from that server, over a pipe. A signal to the launcher's whole process group
    (what ``timeout``, a batch scheduler's cancel or a closed terminal send) reaches the
    server too, and ends it: its pipes then read as "every rank ended, status 255" while
    the ranks are still finishing their step and saving (``--ckpt-on-preempt``). The
    launcher took that for their end and returned at once; the ranks outlived it, and
    hung where they next used the rendezvous folder it had removed. A process descriptor
    reads as ended only when the process has, and signals sent through it cannot reach
    another process that took over the number. The exit status still comes from the
    server, where it is alive to tell it.
    """

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # ended already (its status is the server's)
            self._ended = True
        except (AttributeError, OSError):  # no process descriptors here: the server's pipe
            self._ended = False
        else:
            self._ended = False

    def waitable(self) -> Any:
        """What ``multiprocessing.connection.wait`` waits on for this rank's end."""
        return self._fd if self._fd is not None else self.proc.sentinel

    def ended(self, timeout: float | None = 0.0) -> bool:
        """Whether the process has ended, waiting up to ``timeout`` seconds for it (None:
        until it has)."""
        if not self._ended:
            if self._fd is not None:
                self._ended = bool(select.select([self._fd], [], [], timeout)[0])
            else:
                self.proc.join(timeout)
                self._ended = not self.proc.is_alive()
        return self._ended

    def exitcode(self) -> int | None:
        """The exit status of an ended rank (255 where the server was gone before it told
        it), or None while it runs."""
        if not self.ended():
            return None
        self.proc.join(timeout=1.0)  # the server tells the status just after the end
        code: int | None = self.proc.exitcode
        return 255 if code is None else code

    def send(self, sig: int) -> None:
        """Send ``sig`` to the rank, if it still runs."""
        if self.ended():
            return
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._ended = True


def _supervise(ranks: list[_Rank], received: list[int], grace_s: float) -> tuple[int, int] | None:
    """Wait for the ranks; at a failure or a signal, stop the rest. The first failure.

    Woken by any rank's end, so that the rank that failed first is usually the only one
    ended when looked at. Where several are (a peer's connection error follows a rank's
    death within milliseconds), one killed by a signal is named before one that exited
    with an error: the error is what the death caused.
    """
    while True:
        # Checked once more after the last rank ended: ranks that all fail at once (a bad
        # option every rank finds) must not look like a success.
        failed = [(r, code) for r, rank in enumerate(ranks) if (code := rank.exitcode())]
        if failed or received:
            _stop(ranks, grace_s)  # a rank failed: the others would wait forever
            failed.sort(key=lambda rank_code: rank_code[1] > 0)  # (stable: then by rank)
            return failed[0] if failed else None
        running = [rank.waitable() for rank in ranks if not rank.ended()]
        if not running:
            return None
        wait(running, timeout=0.2)


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """SIGTERM every rank still running, then SIGKILL whatever is left after ``grace_s``;
    returns once every rank has ended."""
    for rank in ranks:
        rank.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for rank in ranks:
        if not rank.ended(max(0.0, deadline - time.monotonic())):
            rank.send(signal.SIGKILL)
            rank.ended(timeout=None)


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _rank_main(
    worker: Callable[..., None],
    rank: int,
    args: tuple[Any, ...],
    caller: tuple[int, dict[str, str], CallerOutput],
) -> None:
    launcher, env, output = caller
    adopt_environment(env)  # the server's is the one it started with
    output.adopt()  # ... and so is its output
    stop_with_launcher(launcher)  # never outlive the launcher
    try:
        worker(rank, *args)
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's group, the ranks too: the
        # launcher stops them and says so once, without a traceback from each rank.
        sys.exit(128 + signal.SIGINT)


def stop_with_launcher(launcher: int) -> None:
    """Have this process receive SIGTERM when the launcher dies, so that ranks never
    outlive a launcher killed with SIGKILL.

    Not the parent's death signal (``prctl``): a rank's parent is the fork server, which
    outlives the launcher as long as any process it forked does (every child holds the
    server's "alive" pipe open, by design). So a thread waits on the launcher itself: on
    a process descriptor of it where the kernel has them (Linux 5.3), else by polling.
    """
    try:
        descriptor = os.pidfd_open(launcher)
    except ProcessLookupError:  # it died already
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):  # no process descriptors here
        threading.Thread(target=_watch_launcher, args=(launcher,), daemon=True).start()
        return
    threading.Thread(target=_wait_for_exit, args=(descriptor,), daemon=True).start()


def _wait_for_exit(descriptor: int) -> None:
    select.select([descriptor], [], [])  # readable once the process ended
    os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_launcher(launcher: int) -> None:
    while _alive(launcher):
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
