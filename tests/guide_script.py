"""Runs every Python block of docs/guide.md in order, in one namespace (the guide's blocks
build on each other), for test_guide.py: ``torchrun --nproc-per-node 2 guide_script.py``.
A failing block is reported with its first line in the guide."""

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


def main() -> None:
    namespace: dict[str, object] = {"__name__": "__guide__"}
    for line, code in blocks(GUIDE.read_text()):
        try:
            exec(compile(code, f"docs/guide.md:{line}", "exec"), namespace)
        except Exception as error:
            raise SystemExit(f"the block at docs/guide.md:{line} failed: {error!r}") from error
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
