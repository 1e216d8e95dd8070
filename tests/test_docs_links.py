"""Every relative link in the repository's Markdown files points at a path inside it.

A link to a file outside the repository (a sibling folder on the development machine,
say ``../shared/``) resolves for no reader of the repository. And the user docs (the README
and docs/, but for design.md and performance.md) point at nothing a user cannot open: no
test file, source path or issue number.
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


USER_DOCS = (
    "README.md",
    "docs/guide.md",
    "docs/troubleshooting.md",
    "docs/cli.md",
    "docs/lightning.md",
    "docs/transformers.md",
    "docs/migration.md",
)
_URL = re.compile(r"https?://\S+")
_INTERNAL = re.compile(
    r"(?<![\w./-])tests/"  # the test suite
    r"|\btest_\w+\.py\b"  # a test file
    r"|\bsrc/flatshard\b|(?<![\w./-])flatshard/[\w/]*\.py\b"  # the package's source
    r"|(?<!\w)_[A-Za-z]\w*\.py\b"  # a private module (`runtime/_unit.py`), not `__init__.py`
    r"|\[Note: "  # a note in the source
)
# Outside code blocks, whose printed errors number collectives ("collective #18"). Not the
# verb ("ranks issue 2 collectives": a word follows the number), nor an upstream project's
# issue (`pytorch/pytorch#173608`), which a reader can look up.
_ISSUE = re.compile(r"\bissues? (?:#\d+|\d+\b(?!\s+[a-z]))|(?<![\w/&])#\d+\b", re.IGNORECASE)


def internal_references(root: Path, names: tuple[str, ...] = USER_DOCS) -> list[str]:
    """``file:line: text`` for each mention of a test, a source path or an issue number."""
    found: list[str] = []
    for name in names:
        in_code = False
        for number, line in enumerate((root / name).read_text().splitlines(), start=1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            text = _URL.sub(" ", line)
            hits = [m[0] for m in _INTERNAL.finditer(text)]
            if not in_code:
                hits += [m[0] for m in _ISSUE.finditer(text)]
            found += [f"{name}:{number}: {hit}" for hit in hits]
    return found


def test_user_docs_point_only_at_what_a_user_can_open() -> None:
    """A user reads the README and docs/, not the test suite, the package's private modules
    or the project's issue tracker: "(`tests/test_x.py`)" or "issue 59" tells them nothing
    they can act on. What was tested is said in words; how it works is in docs/design.md.
    """
    assert not internal_references(ROOT), "\n".join(internal_references(ROOT))


def test_internal_references_are_found_and_user_text_is_not(tmp_path: Path) -> None:
    """The check flags each kind of pointer, and none of the text a user can act on."""
    (tmp_path / "a.md").write_text(
        "Tested (`tests/test_x.py`), see test_y.py, `src/flatshard/z.py`, flatshard/cli/a.py.\n"
        "It lives in `runtime/_unit.py` ([Note: fast ranks]); fixed in issue 59 (#60).\n"
        "Run `make test`, `benchmarks/gpu_check.sh` or `python benchmarks/bench.py`; import\n"
        "`flatshard.testing`; put it in your `__init__.py`; see [cli](cli.md#options), the\n"
        "checkpoint's `checkpoint-2/flatshard/` folder,\n"
        "pytorch/pytorch#173608 and https://github.com/o/r/blob/main/tests/test_q.py.\n"
        "Ranks issue 2 collectives in issue order.\n"
        "```\n"
        "rank 1: waiting for collective #18\n"
        "```\n"
    )
    assert internal_references(tmp_path, ("a.md",)) == [
        "a.md:1: tests/",
        "a.md:1: test_x.py",
        "a.md:1: test_y.py",
        "a.md:1: src/flatshard",
        "a.md:1: flatshard/cli/a.py",
        "a.md:2: _unit.py",
        "a.md:2: [Note: ",
        "a.md:2: issue 59",
        "a.md:2: #60",
    ]
