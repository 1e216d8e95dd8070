"""Runs every Python block of docs/guide.md in order, in one namespace (the guide's blocks
build on each other), for test_guide.py: ``torchrun --nproc-per-node 2 guide_script.py``;
``--section TITLE``: the setup block and that section's blocks alone. A failing block is
reported with its first line in the guide."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch.distributed as dist

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def blocks(text: str) -> list[tuple[int, str]]:
    """(line in the guide, dedented code) of each ```python block."""
    found = []
    for match in re.finditer(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M):
        indent = len(match.group(1))
        code = "\n".join(line[indent:] for line in match.group(2).splitlines())
        found.append((text.count("\n", 0, match.start()) + 2, code))
    return found


def section(text: str, title: str) -> list[tuple[int, str]]:
    """The guide's first block (its setup: imports, the process group) and the blocks of
    the section whose heading starts with ``title``."""
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    first, *rest = blocks(text)
    lo, hi = text.count("\n", 0, start), text.count("\n", 0, end if end >= 0 else len(text))
    return [first, *(b for b in rest if lo < b[0] <= hi)]


def main() -> None:
    """Every block, or with ``--section TITLE`` that section's alone (after the setup)."""
    namespace: dict[str, object] = {"__name__": "__guide__"}
    text = GUIDE.read_text()
    chosen = section(text, sys.argv[2]) if sys.argv[1:2] == ["--section"] else blocks(text)
    for line, code in chosen:
        try:
            exec(compile(code, f"docs/guide.md:{line}", "exec"), namespace)
        except Exception as error:
            raise SystemExit(f"the block at docs/guide.md:{line} failed: {error!r}") from error
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
