"""The README's Python example runs as printed, at 2 ranks on gloo.

The code is read from the README itself (the block under "Shard your own model"), so the
example cannot drift from what the suite checks.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import flatshard
from flatshard.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Shard your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one Python block in the section, found {len(blocks)}"
    return str(blocks[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_example_trains_and_saves_at_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env |= {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", outputs[0], re.M)]
    assert len(losses) == 10, outputs[0]
    assert losses[-1] < losses[0], losses  # it trains
    assert "step" not in outputs[1], outputs[1]  # rank 0 alone prints
    checkpoint = tmp_path / "checkpoints" / "step_10"
    assert (checkpoint / "flatshard.json").is_file()
    assert main(["ckpt", "inspect", str(checkpoint)]) == 0  # every file checks out


def test_every_listing_of_strategies_names_them_all() -> None:
    """A line of the README or docs that lists strategies (names four or more) names all
    of them: a strategy left out of a list reads as unsupported."""
    names = [s.name for s in flatshard.ShardingStrategy]
    short = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = {n for n in names if re.search(rf"\b{n}\b", line)}
            if len(found) >= 4 and len(found) < len(names):
                short.append(f"{path.name}:{number} lacks {sorted(set(names) - found)}")
    assert not short, "\n".join(short)
