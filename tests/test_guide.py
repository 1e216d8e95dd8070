"""docs/guide.md's examples run as printed: every Python block, in order, at 2 ranks on
gloo (``guide_script.py``), so the guide cannot drift from the library."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the pretrained-weights example builds a Llama
from flatshard.testing.scripts import run_script

SCRIPT = Path(__file__).with_name("guide_script.py")


def test_every_example_of_the_guide_runs_at_two_ranks(tmp_path: Path) -> None:
    run_script(SCRIPT, cwd=tmp_path, ranks=2)


def test_the_pipeline_section_runs_at_four_ranks(tmp_path: Path) -> None:
    """ "Pipeline parallelism" as printed at PP2 x DP2 (its mesh takes the world's ranks)."""
    run_script(SCRIPT, "--section", "Pipeline parallelism", cwd=tmp_path, ranks=4)


def test_the_guide_has_its_examples() -> None:
    from guide_script import GUIDE, blocks  # tests/ is on the path (rootdir conftest)

    assert len(blocks(GUIDE.read_text())) >= 7
