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


def against_reference(script: Path, out: Path) -> None:
    """The unsharded reference run, then the sharded one at 2 ranks (see the module)."""
    run_script(script, "reference", str(out), cwd=out)
    run_script(script, "sharded", str(out), cwd=out, ranks=2)


def run_results(out: Path) -> dict[str, Any]:
    """What the two runs of ``against_reference`` wrote: {"reference": ..., "sharded": ...}."""
    return {
        name: json.loads((out / f"{name}.json").read_text()) for name in ("reference", "sharded")
    }
