"""``flatshard train`` as an operator meets it when things go wrong: restarts after a crash
(``--resume auto``, one metrics line per step), a launcher stopped or killed, a rank that
dies, a checkpoint directory that cannot hold the checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flatshard.testing.isolated import alive
from in_process import run_command

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4"]
TRAIN = [sys.executable, "-m", "flatshard.cli.main", "train"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    """``flatshard train <argv>`` in this process (tests/in_process.py)."""
    code, out, err = run_command(["train", *argv])
    return subprocess.CompletedProcess([*TRAIN, *argv], code, out, err)


def _steps(out_dir: Path) -> list[tuple[int, float]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [((row := json.loads(line))["step"], row["loss"]) for line in lines if line]


def test_resume_auto_after_a_crash_logs_every_step_once(tmp_path: Path) -> None:
    common = [*TINY, "--ckpt-every", "3", "--keep-ckpts", "2", "--sample-bytes", "0"]
    common += ["--resume", "auto", "--out-dir", str(tmp_path)]
    first = _run(*common, "--steps", "6")
    assert first.returncode == 0, first.stderr
    assert "--resume auto: no whole checkpoint" in first.stdout  # the first start is fresh
    before = dict(_steps(tmp_path))
    # A crash while step 6 was being saved: its checkpoint is not whole (no manifest), and
    # the metrics already hold step 6 (logged before the save).
    (tmp_path / "checkpoints" / "step_000006" / "flatshard.json").unlink()
    with (tmp_path / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 7, "lo')  # and a line cut short by the kill
    again = _run(*common, "--steps", "9")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "step_000003 at step 3" in again.stdout
    steps = _steps(tmp_path)
    assert [s for s, _ in steps] == list(range(1, 10))  # each step once, in order
    for step, loss in steps[3:6]:  # steps 4-6 trained again from step 3: the same losses
        assert loss == pytest.approx(before[step], rel=1e-6), (step, before, steps)


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def _start_long_run(
    tmp_path: Path, *extra: str, own_group: bool = False
) -> tuple[subprocess.Popen[str], list[int]]:
    """A run that would take minutes; returns once its ranks are training. ``own_group``:
    the launcher in a process group of its own, as a terminal or a scheduler starts it."""
    argv = [*TINY, "--steps", "100000", "--log-every", "1", "--sample-bytes", "0", *extra]
    proc = subprocess.Popen(
        [*TRAIN, *argv, "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step "):
            break
    # The ranks are forked from the launcher's fork server (a child of the launcher)
    servers = [
        c for c in _children(proc.pid) if "forkserver" in Path(f"/proc/{c}/cmdline").read_text()
    ]
    ranks = [rank for server in servers for rank in _children(server)]
    assert len(ranks) == 2, ranks
    return proc, ranks


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_launcher_stops_its_ranks(tmp_path: Path, sig: signal.Signals) -> None:
    proc, ranks = _start_long_run(tmp_path)
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=20) == 128 + sig
    assert _gone_within(ranks, 10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launchers_whole_group_ends_every_rank_before_the_launcher(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """What ``timeout``, a scheduler's cancel and a terminal's Ctrl-C do: the signal
    reaches every process of the group, the ranks and the fork server they were forked
    from too. Before: the server died of SIGTERM, the launcher took that for the end of
    every rank and returned within 0.1 s, and its ranks outlived it (saving, or hung on
    the rendezvous folder it had removed); on Ctrl-C each rank printed a traceback."""
    proc, ranks = _start_long_run(tmp_path, "--ckpt-on-preempt", own_group=True)
    os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert not any(alive(rank) for rank in ranks)  # (a zombie is not alive)
    assert f"stopped all ranks on {sig.name}" in stdout
    assert "Traceback" not in stderr, stderr[-3000:]
    if sig == signal.SIGTERM:  # --ckpt-on-preempt: the step they agreed to stop at, saved
        stopped = int(stdout.split("SIGTERM at step ")[1].split(":")[0])
        assert (tmp_path / "checkpoints" / f"step_{stopped:06d}" / "flatshard.json").exists()


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path: Path) -> None:
    proc, ranks = _start_long_run(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=20)
    assert _gone_within(ranks, 10)


def test_a_rank_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    proc, ranks = _start_long_run(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "was killed by SIGKILL; stopped the other ranks" in err, err[-2000:]
    assert _gone_within(ranks, 10)


def test_checkpoint_dir_problems_are_found_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = _run(*TINY, "--ckpt-every", "1", "--ckpt-dir", str(blocker / "ckpts"))
    assert unwritable.returncode == 2
    assert "--ckpt-dir" in unwritable.stderr and "cannot write there" in unwritable.stderr
    assert "step " not in unwritable.stdout  # nothing was trained first
    # The tiny GPT has over 30,000 parameters, so a checkpoint over 12 * 30,000 bytes:
    # this many cannot fit in the free space.
    keep = str(shutil.disk_usage(tmp_path).free // (12 * 30_000) + 1)
    too_small = _run(*TINY, "--ckpt-every", "1", "--keep-ckpts", keep, "--out-dir", str(tmp_path))
    assert too_small.returncode != 0
    assert "MiB free, but --keep-ckpts" in too_small.stderr, too_small.stderr[-2000:]
    assert "step " not in too_small.stdout
