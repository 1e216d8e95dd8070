"""Scripts run as a user runs them, for the integration tests (Hugging Face's ``Trainer``,
TRL): ``python script.py ARGS`` or, given ``ranks``, ``torchrun --standalone``.

``against_reference`` runs the usual pair: ``script reference OUT`` in one process, then
``script sharded OUT`` at 2 ranks, each writing ``OUT/<name>.json``.

The launch variables of the test process (a suite itself started under torchrun) are not
passed on: the script's ranks form their own group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

_LAUNCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"}


def run_script(
    script: Path, *args: str, cwd: Path, ranks: int | None = None, timeout: float = 600
) -> None:
    """Run ``script`` with ``args`` in ``cwd``; an AssertionError with its output's ends
    if it fails."""
    command = [sys.executable]
    if ranks is not None:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    done = subprocess.run(
        [*command, str(script), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def run_scripts_together(
    script: Path, runs: list[list[str]], cwd: Path, timeout: float = 600
) -> None:
    """Run ``script`` once for each argument list of ``runs``, all at once (runs that meet,
    such as replica groups), each alone (no launch variables); an AssertionError with the
    output's ends of any that fails. Outputs go to files: a full pipe would stall a run
    that another waits for."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    logs = [cwd / f"run{i}.out" for i in range(len(runs))]
    procs = []
    for args, log in zip(runs, logs, strict=True):
        with log.open("w") as out:
            command = [sys.executable, str(script), *args]
            procs.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=out))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            proc.kill()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-8000:]


def run_ranks(
    script: Path, *args: str, cwd: Path, ranks: int = 2, timeout: float = 120
) -> list[tuple[int, str]]:
    """Run ``script`` with ``args`` as ``ranks`` processes, each with the variables torchrun
    sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torchrun's agent: no rank
    is stopped because another ended. Each rank's (exit status, output)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    procs = []
    for rank in range(ranks):
        env = base | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outcomes = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        outcomes.append((proc.returncode, output))
    return outcomes


def against_reference(script: Path, out: Path) -> None:
    """The unsharded reference run, then the sharded one at 2 ranks (see the module)."""
    run_script(script, "reference", str(out), cwd=out)
    run_script(script, "sharded", str(out), cwd=out, ranks=2)


def run_results(out: Path) -> dict[str, Any]:
    """What the two runs of ``against_reference`` wrote: {"reference": ..., "sharded": ...}."""
    return {
        name: json.loads((out / f"{name}.json").read_text()) for name in ("reference", "sharded")
    }


def logged_rows(out_dir: Path) -> list[dict[str, Any]]:
    """The steps ``flatshard train`` logged so far in ``out_dir/metrics.jsonl`` (none yet
    where it has no file; a line being written is not read)."""
    try:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def last_logged_step(out_dir: Path) -> int:
    """The last step ``flatshard train`` logged in ``out_dir`` (0: none yet)."""
    return max((row["step"] for row in logged_rows(out_dir)), default=0)
