"""Every relative link in the repository's Markdown files points at a path inside it.

A link to a file outside the repository (a sibling folder on the development machine,
say ``../shared/``) resolves for no reader of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SKIPPED = {"build", "dist", "runs", "node_modules"}  # plus every folder whose name starts "."


def markdown_files(root: Path) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*.md")
        if not any(p.startswith(".") or p in _SKIPPED for p in path.relative_to(root).parts)
    )


def broken_links(root: Path) -> list[str]:
    """``file:line -> target`` for each relative link that is missing or leaves ``root``."""
    root = root.resolve()
    broken = []
    for path in markdown_files(root):
        text = re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), path.read_text(), flags=re.S)
        for match in _LINK.finditer(text):
            target = match[1].split("#", 1)[0]
            if not target or re.match(r"(https?|mailto):", target):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(root) or not resolved.exists():
                line = text.count("\n", 0, match.start()) + 1
                broken.append(f"{path.relative_to(root)}:{line} -> {match[1]}")
    return broken


def test_every_relative_link_resolves_inside_the_repository() -> None:
    assert not broken_links(ROOT), "\n".join(broken_links(ROOT))


def test_a_link_outside_the_repository_is_reported(tmp_path: Path) -> None:
    (tmp_path / "repo" / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "USERS.md").write_text("users\n")
    (tmp_path / "repo" / "docs" / "a.md").write_text(
        "[b](b.md#x) [web](https://x.org) [top](#top)\n"
        "[users](../../shared/USERS.md) [gone](missing.md)\n"
    )
    (tmp_path / "repo" / "docs" / "b.md").write_text("b\n")
    assert broken_links(tmp_path / "repo") == [
        "docs/a.md:2 -> ../../shared/USERS.md",
        "docs/a.md:2 -> missing.md",
    ]
