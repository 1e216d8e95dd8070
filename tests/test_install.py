"""The README's install lines: an extra added to the `make train` environment keeps flatshard
editable (its code is the checkout's src/) and torch the pinned build."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_WHERE = "import inspect, flatshard, torch; print(inspect.getfile(flatshard), torch.__version__)"


def _readme_extras_command() -> list[str]:
    """The README's `make extras EXTRAS=...` line, as words."""
    found = re.search(r"^make extras EXTRAS=\S+", (ROOT / "README.md").read_text(), re.M)
    assert found is not None, "the README shows no `make extras EXTRAS=...` line"
    return found.group(0).split()


def test_readme_pip_lines_install_editable() -> None:
    lines = re.findall(r"^pip install .*$", (ROOT / "README.md").read_text(), re.M)
    assert lines, "the README shows no pip install line"
    for line in lines:
        assert line.startswith("pip install -e "), f"not editable: {line}"


def test_an_extra_added_to_the_train_environment_keeps_flatshard_editable(
    tmp_path: Path,
) -> None:
    """A fresh environment made by `make train`'s install step, then the README's extras
    command (with the cheapest extra: tensorboard). The fresh environment sees this one's
    site-packages through a .pth line, so torch is not downloaded again (a minute); the
    line comes after the environment's own site-packages, so a copy of flatshard installed
    there (what `pip install '.[x]'` does) would be the one imported, and the test fail."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    fresh = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(fresh) / "dev-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    command = [w for w in _readme_extras_command() if not w.startswith("EXTRAS=")]
    result = subprocess.run(
        [*command, f"VENV={venv}", "EXTRAS=tensorboard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    where = subprocess.run(
        [str(python), "-c", _WHERE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(ROOT / "src"), where
    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None and where[1].split("+")[0] == pinned.group(1), where
