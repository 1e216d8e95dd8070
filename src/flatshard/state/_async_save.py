"""Asynchronous checkpoint saves: the state copied to host memory, written by a thread.

[Note: asynchronous saves]
``save_checkpoint(path, ..., async_op=True)`` does, on every rank, in the training thread:

1. waits for this process's previous asynchronous save (``settle_pending``) and raises its
   failure, if it failed;
2. collects the checkpoint's entries as the synchronous save does (its collectives run
   here, in the program's order);
3. stages them: every tensor copied into a host buffer kept for the next save of the same
   shapes (pinned when copied from an accelerator: ``non_blocking`` copies, one
   synchronize), Python values copied deeply, so that training may change the model,
   the optimizer and ``extra`` at once;
4. starts a writer thread and returns its ``CheckpointSave``.

The writer runs the synchronous path's write and commit (``_checkpoint.write_or_clean_up``:
DCP into ``<path>.partial``, checksums, manifest, rename) over a gloo group of its own,
made once per set of ranks: DCP's collectives then never interleave with the training thread's on a
group both use, and the watchdog, which records and diagnoses the training thread's
collectives in order, never sees them. Every failure after staging is agreed among the
ranks inside the write (DCP gathers each rank's failure, the checksums and the commit are
exchanged), so each rank's writer ends the same way and the failure is raised on every
rank at the same calls: ``wait()``, and the next ``save_checkpoint``/``load_checkpoint``
(which wait first, once: it is not raised again after).

Nothing half-written is ever a checkpoint: ``<path>`` appears only by the rename of a
whole directory, so a rank killed during the write leaves ``<path>.partial``, which
``--resume auto`` and ``load_checkpoint`` never take. The writer is not a daemon thread:
a process that ends normally or by an exception finishes the pending write first (Python
joins such threads before exiting); a failure nobody waited for is printed at exit.
``dist.destroy_process_group()`` destroys the writer's group too: call ``wait()`` first.

[Note: a save outlives SIGTERM]
SIGTERM is how SLURM, Kubernetes and torchrun stop a job (preemption, a scale-down), and
its default action ends the process at once: a write in the background thread would be
lost. So the first asynchronous save started from the main thread installs a SIGTERM
handler, kept for the process's life, that waits for the pending save to commit (or fail,
said on stderr), then does what the handler it replaced would have done: calls it (the
program's own, Lightning's), ignores the signal, or, for the default, ends the process by
SIGTERM as before, so the exit status a scheduler reads is unchanged. Every rank of a
preempted job gets the signal, and each rank's writer needs the others' for the commit:
each waits for its own. SIGINT needs none of this: it raises ``KeyboardInterrupt``, and
the exit joins the writer.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from flatshard.comm._collectives import all_gather_object
from flatshard.comm._watchdog import ended_peers, leave_exit_record
from flatshard.state._errors import CheckpointError
from flatshard.state._state_dict import RowShard


class Exchange(NamedTuple):
    """The collectives a save runs over its ranks: flatshard's own (watched, tagged) in the
    training thread; plain ones over the writer's group in the background."""

    gather: Callable[[object], list[object]]  # every rank's object, in rank order
    barrier: Callable[[], None]


# write(target, partial, state, group, exchange): the synchronous save's write and commit
Write = Callable[[Path, Path, dict[str, Any], "dist.ProcessGroup | None", Exchange], None]


class CheckpointSave:
    """A checkpoint being written in the background: ``save_checkpoint(..., async_op=True)``.

    ``wait()`` blocks until it is committed (or raises ``CheckpointError`` on every rank
    if the write failed); ``done()`` says whether the writer has finished.
    ``staged_bytes``: this rank's state copied to host memory for it.
    """

    def __init__(self, path: Path, staged_bytes: int) -> None:
        self.path = path
        self.staged_bytes = staged_bytes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._why = ""  # what explains the error, where something does (said once found)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is committed; raise if its write failed."""
        self._join()
        if self._error is not None:
            raise self.failure("CheckpointSave.wait") from self._error

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error else "committed"
        return f"CheckpointSave('{self.path}', {state})"

    def failure(self, caller: str) -> CheckpointError:
        return CheckpointError(
            f"flatshard.{caller}: the asynchronous save of {self.path} failed: "
            f"{str(self._error).rstrip('.')}. "
            f"{self._why}{self.path.name} was not written; the checkpoint there before it (if "
            "any) is untouched. Fix the cause and save again."
        )

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run(
        self, write: Write, partial: Path, state: dict[str, Any], group: dist.ProcessGroup | None
    ) -> None:
        try:
            write(self.path, partial, state, group, _plain_exchange(group))
        except BaseException as error:  # kept for wait() and the next call
            self._error = error
            self._why = _why_failed(group)


def _why_failed(group: dist.ProcessGroup | None) -> str:
    """What explains a write's failure, in the user's terms, where a cause other than the
    error's own text is found: the process group destroyed under the writer, or a rank of
    its group that has ended (the error is then gloo's "connection closed")."""
    if group is None:
        return ""
    if not dist.is_initialized() or not _alive(group):
        return (
            "The process group was destroyed while it was being written: call wait() on "
            "the save before dist.destroy_process_group() (a SIGTERM handler of the "
            "program's own that exits skips flatshard's wait: call it there too). "
        )
    ended = ended_peers(dist.get_process_group_ranks(group))
    return "".join(f"Rank {rank} of its group ended ({how}). " for rank, how in ended.items())


class _Staging:
    """Host copies of a save's tensors, kept for the next save (same names and shapes)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._used: dict[str, torch.Tensor] = {}
        self._from_device = False

    def stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """A copy of ``state`` whose tensors live in staging buffers; its bytes."""
        self._used, self._from_device = {}, False
        staged = {key: self._copy(key, value) for key, value in state.items()}
        if self._from_device:
            torch.accelerator.synchronize()  # the non_blocking copies are in the buffers
        self.buffers = self._used  # buffers of entries no longer saved are freed
        return staged, sum(b.numel() * b.element_size() for b in self._used.values())

    def _copy(self, key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(key, value)
        if isinstance(value, RowShard):
            return dataclasses.replace(value, local=self._tensor(key, value.local))
        if isinstance(value, dict):
            return {k: self._copy(f"{key}/{k}", v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._copy(f"{key}/{i}", v) for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        return copy.deepcopy(value)

    def _tensor(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        on_device = tensor.device.type != "cpu"
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_device)
        with torch.no_grad():
            buffer.copy_(tensor.detach(), non_blocking=on_device)
        self._from_device |= on_device
        self._used[key] = buffer
        return buffer


_STAGING = _Staging()
_PENDING: list[CheckpointSave] = []  # this process's save being written (at most one)
_WRITER_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def start_save(
    target: Path,
    partial: Path,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    write: Write,
) -> CheckpointSave:
    """Stage ``state`` and start ``write`` of it in the background (every rank calls it)."""
    writer_group = _writer_group(group)
    staged, nbytes = _STAGING.stage(state)
    save = CheckpointSave(target, nbytes)
    thread = threading.Thread(
        target=save._run, args=(write, partial, staged, writer_group), name="flatshard-checkpoint"
    )
    save._thread = thread
    _PENDING.append(save)
    thread.start()
    _finish_saves_on(signal.SIGTERM)
    return save


_REPLACED: dict[int, Any] = {}  # signal -> the handler ours replaced


def _finish_saves_on(signum: signal.Signals) -> None:
    """Install ``_on_signal`` for ``signum`` (once; from the main thread only: Python
    allows no other). See [Note: a save outlives SIGTERM]."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signum)
    if current is _on_signal or current is None:  # ours already, or set outside Python
        return
    _REPLACED[signum] = current
    signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    """Finish the pending save, then act as the replaced handler would have."""
    name = signal.Signals(signum).name
    for save in [s for s in _PENDING if not s.done()]:
        print(
            f"flatshard: {name} received while {save.path} was being written; finishing it "
            "before the process stops",
            file=sys.stderr,
            flush=True,
        )
        save._join()
        outcome = f"failed: {save._error}" if save._error is not None else "committed"
        print(f"flatshard: {save.path} {outcome}", file=sys.stderr, flush=True)
    replaced = _REPLACED.get(signum, signal.SIG_DFL)
    if callable(replaced):
        replaced(signum, frame)
    elif replaced != signal.SIG_IGN:  # the default: end by the signal, as without flatshard
        leave_exit_record(f"was stopped by {name}")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def settle_pending(caller: str) -> None:
    """Wait for this process's asynchronous save; raise its failure (on every rank: the
    writers agree on it)."""
    while _PENDING:
        save = _PENDING.pop()
        save._join()
        if save._error is not None:
            raise save.failure(caller) from save._error


def _writer_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The writer's gloo group over ``group``'s ranks, made once (by those ranks alone).

    torch names a group its members make alone (``use_local_synchronization``) after its
    ranks and the count of groups each member has registered, so members that joined
    different numbers of other groups (ranks 0-1 in a group that rank 1 is not in) would
    each wait at a rendezvous of another name. The members first agree on that count
    and each makes groups of itself alone (no peers, nothing sent) up to the largest.
    """
    if group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    found = _WRITER_GROUPS.get(ranks)
    if found is not None and _alive(found):
        return found
    registered = dist.distributed_c10d._world.pg_names  # what torch's group names count
    counts = cast(list[int], all_gather_object(len(registered), group))
    me = [dist.get_rank()]
    while len(registered) < max(counts):
        dist.new_group(me, backend="gloo", use_local_synchronization=True)
    made: dist.ProcessGroup | None = dist.new_group(
        list(ranks), backend="gloo", use_local_synchronization=True
    )
    assert made is not None  # every rank of ``ranks`` is in it
    _WRITER_GROUPS[ranks] = made
    return made


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` was not destroyed (``destroy_process_group`` and a new init)."""
    try:
        dist.get_world_size(group)
    except (ValueError, RuntimeError):
        return False
    return True


def _plain_exchange(group: dist.ProcessGroup | None) -> Exchange:
    """torch's collectives over the writer's group, unrecorded: they run beside the
    training thread's, which the watchdog records in order."""
    if group is None:
        return Exchange(lambda obj: [obj], lambda: None)

    def gather(obj: object) -> list[object]:
        out: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return Exchange(gather, lambda: dist.barrier(group=group))


def _report_at_exit() -> None:
    """At exit (the writer already joined): say a failure nobody waited for."""
    for save in _PENDING:
        save._join()
        if save._error is not None:
            print(f"{save.failure('save_checkpoint')}", file=sys.stderr, flush=True)


atexit.register(_report_at_exit)
