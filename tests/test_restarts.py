"""Crash and restart as an operator meets it: a rank SIGKILLed mid-run and once more while
a checkpoint is being written, under ``flatshard train --max-restarts`` (torch's elastic
agent) and under the torchrun recipe of docs/cli.md; and a rank SIGKILLed while
``--ckpt-async``'s writer thread writes (training having gone on): ``--resume auto`` takes
the checkpoint before it. The ranks restart, resume from the last
whole checkpoint, and log exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flatshard.testing.isolated import alive, rank_pid, wait_until
from flatshard.testing.scripts import last_logged_step
from in_process import train

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "128", "--batch", "16"]
RUN = [*TINY, "--steps", "24", "--ckpt-every", "8", "--keep-ckpts", "3", "--sample-bytes", "0"]
MAIN = [sys.executable, "-m", "flatshard.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
TORCHRUN += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--max-restarts", "2"]
KILL_AT_STEP = 15  # after the checkpoint of step 8, before that of step 16
SAVE_PAUSE_S = 1.0
# Loaded first by every Python process of a killed run (PYTHONPATH): each save pauses
# while its checkpoint is still '.partial', so the kill during a save cannot miss the
# window (a tiny model's save lasts milliseconds: on a loaded machine the test's polling
# could miss every save of the run and time out).
SLOW_SAVES = f"""
from flatshard.testing.internals import checkpoint_saves_pause

checkpoint_saves_pause({SAVE_PAUSE_S})
"""


def _losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line]
    steps = [row["step"] for row in rows]
    assert steps == sorted(set(steps)), f"each step once, in order: {steps}"
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    train(*RUN, "--out-dir", str(out))  # in this process (tests/in_process.py)
    return _losses(out)


def _kill(root: int, rank: int) -> float:
    """SIGKILL rank ``rank``; returns once it is dead (the time of the kill)."""
    pid = rank_pid(root, rank)
    assert pid is not None, f"no process for rank {rank}"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not alive(pid), 10.0)
    return killed


def _being_saved(ckpt_dir: Path) -> str | None:
    """The checkpoint being written now (its directory ends in .partial), if any."""
    partial = [p.name for p in ckpt_dir.glob("*.partial")]
    return partial[0].removesuffix(".partial") if partial else None


def _slow_saves(tmp: Path) -> dict[str, str]:
    """The environment of a run whose saves pause (``SLOW_SAVES``)."""
    shim = tmp / "slow_saves"
    shim.mkdir(parents=True)
    (shim / "sitecustomize.py").write_text(SLOW_SAVES)
    path = os.pathsep.join(p for p in [str(shim), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path}


def _kill_twice(command: list[str], out: Path) -> tuple[str, float]:
    """Run ``command``; SIGKILL rank 1 mid-run, then rank 0 while a checkpoint is being
    written. Returns the run's stdout, after checking it ended well, and the seconds from the
    first kill to the first step logged after it."""
    env = _slow_saves(out.parent / f"{out.name}-env")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_until(lambda: last_logged_step(out) >= KILL_AT_STEP)
    killed = _kill(proc.pid, 1)
    wait_until(lambda: last_logged_step(out) < KILL_AT_STEP)  # resumed: later lines dropped
    wait_until(lambda: last_logged_step(out) > 8)  # the first step trained again after step 8
    back_after = time.monotonic() - killed
    saving: list[str] = []
    wait_until(lambda: (name := _being_saved(out / "checkpoints")) and not saving.append(name))
    _kill(proc.pid, 0)
    # The save may have ended between the look and the kill; else it was cut short (the
    # rank is dead by now, so a .partial left is one no rename will complete).
    cut = (out / "checkpoints" / f"{saving[0]}.partial").exists()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("resumed from") == 2, stdout  # one resume per kill
    if cut:
        assert f"{saving[0]} at step" not in stdout  # a save cut short is never resumed from
    return stdout, back_after


def test_max_restarts_resumes_exactly_after_two_kills(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    command = [*MAIN, "train", *RUN, "--max-restarts", "2", "--out-dir", str(tmp_path)]
    _, back_after = _kill_twice(command, tmp_path)
    assert _losses(tmp_path) == uninterrupted  # bit-identical: same data, moments and RNG
    print(f"--max-restarts: first resumed step logged {back_after:.1f} s after the kill")


def test_torchrun_recipe_resumes_exactly_after_two_kills(
    tmp_path: Path, uninterrupted: dict[int, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    command = [*TORCHRUN, "-m", "flatshard.cli.main", "train", *RUN, "--resume", "auto"]
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # docs/cli.md says why
    _, back_after = _kill_twice([*command, "--out-dir", str(tmp_path)], tmp_path)
    assert _losses(tmp_path) == uninterrupted
    print(f"torchrun: first resumed step logged {back_after:.1f} s after the kill")


def test_a_kill_during_a_background_write_resumes_from_the_checkpoint_before(
    tmp_path: Path, uninterrupted: dict[int, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # docs/cli.md says why
    run = [*TORCHRUN[:-2], "-m", "flatshard.cli.main", "train", *RUN, "--ckpt-async"]
    run += ["--resume", "auto", "--out-dir", str(tmp_path)]
    ckpts = tmp_path / "checkpoints"
    env = _slow_saves(tmp_path.parent / f"{tmp_path.name}-env")  # each write lasts 1 s more
    proc = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    wait_until(lambda: (ckpts / "step_000016.partial").exists())  # step 8's is whole by then
    assert (ckpts / "step_000008" / "flatshard.json").exists()
    _kill(proc.pid, 0)
    proc.communicate(timeout=120)
    assert not (ckpts / "step_000016").exists()  # killed within the writer's pause
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_000008'} at step 8" in done.stdout, done.stdout
    assert _losses(tmp_path) == uninterrupted  # bit-identical


def test_sigterm_during_a_background_write_saves_once_more_and_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    """Preemption as SLURM or Kubernetes does it: SIGTERM while --ckpt-async's writer writes.
    The pending save commits, --ckpt-on-preempt saves the step the ranks agree to stop at,
    the exit status is 143, and --resume auto continues bit-identically. Before, the
    pending write was lost (its '.partial' left) and the steps since the last save too."""
    run = [*MAIN, "train", *RUN, "--ckpt-async", "--ckpt-on-preempt", "--out-dir", str(tmp_path)]
    ckpts = tmp_path / "checkpoints"
    env = _slow_saves(tmp_path.parent / f"{tmp_path.name}-env")  # each write lasts 1 s more
    proc = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    wait_until(lambda: (ckpts / "step_000016.partial").exists())
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr[-3000:]
    assert (ckpts / "step_000016" / "flatshard.json").exists(), stderr  # committed
    assert "step_000016 committed" in stderr
    stopped = int(stdout.split("SIGTERM at step ")[1].split(":")[0])
    assert 16 < stopped < 24, stdout
    whole = sorted(p.name for p in ckpts.iterdir() if (p / "flatshard.json").exists())
    assert whole == ["step_000008", "step_000016", f"step_{stopped:06d}"]  # --keep-ckpts 3
    done = subprocess.run([*run, "--resume", "auto"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpts / f'step_{stopped:06d}'} at step {stopped}" in done.stdout
    assert "options that differ" not in done.stdout, done.stdout
    assert _losses(tmp_path) == uninterrupted  # bit-identical
    whole = sorted(p.name for p in ckpts.iterdir() if (p / "flatshard.json").exists())
    assert whole == ["step_000016", f"step_{stopped:06d}", "step_000024"]


def test_two_torchrun_agents_as_two_nodes(tmp_path: Path) -> None:
    """Multi-node as torchrun runs it, two agents on this host (``--nnodes 2``)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    agent += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "flatshard.cli.main", "train"]
    agent += [*TINY, "--steps", "4", "--sample-bytes", "0", "--out-dir", str(tmp_path)]
    agents = [
        subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert "2 ranks (gloo, FULL_SHARD)" in "".join(out for out, _ in outputs)
    assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]
