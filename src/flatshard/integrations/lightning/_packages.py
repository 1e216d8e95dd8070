"""Which Lightning: ``lightning`` (``lightning.pytorch``, ``lightning.fabric``) or the
standalone ``pytorch_lightning`` and ``lightning_fabric``.

[Note: one integration, two Lightning packages]
The two ship the same code under two names, and their ``Trainer`` accepts only strategies
derived from its own package's classes. So the modules of this folder are loaded once per
package: as ``flatshard.integrations.lightning`` (for ``lightning``, or for
``pytorch_lightning`` where only that one is installed) and as
``flatshard.integrations.pytorch_lightning`` (always ``pytorch_lightning``), whose package
points its ``__path__`` here. Each module asks ``lightning_for(__name__)`` for its
package's modules; type checkers read the ``lightning`` names, under ``TYPE_CHECKING``.
Imports between the modules here are relative, so that each copy uses its own.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

STANDALONE = "flatshard.integrations.pytorch_lightning"


@dataclass(frozen=True)
class Lightning:
    """The roots of one Lightning package's trainer and Fabric modules."""

    trainer_root: str  # "lightning.pytorch" or "pytorch_lightning"
    fabric_root: str  # "lightning.fabric" or "lightning_fabric"

    def trainer(self, path: str = "") -> ModuleType:
        """The trainer side's module ``path`` (``"strategies"``; ``""``: its root)."""
        return importlib.import_module(".".join(filter(None, (self.trainer_root, path))))

    def fabric(self, path: str = "") -> ModuleType:
        """The Fabric side's module ``path`` (``"plugins.precision"``; ``""``: its root)."""
        return importlib.import_module(".".join(filter(None, (self.fabric_root, path))))


UNIFIED = Lightning("lightning.pytorch", "lightning.fabric")
STANDALONE_PACKAGES = Lightning("pytorch_lightning", "lightning_fabric")


def lightning_for(module: str) -> Lightning:
    """The Lightning package the module named ``module`` (a module of this folder, under
    either package name) works with (see the note)."""
    if module.startswith(STANDALONE + ".") or module == STANDALONE:
        return _installed(STANDALONE_PACKAGES, "pytorch_lightning", "pytorch-lightning")
    if not _has("lightning") and _has("pytorch_lightning"):
        return STANDALONE_PACKAGES  # only the standalone package is installed
    return _installed(UNIFIED, "lightning", "lightning")


def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked in sys.modules, or by an import hook
        return False


def _installed(packages: Lightning, name: str, pip_name: str) -> Lightning:
    if not _has(name):
        raise ImportError(
            f"flatshard.integrations: {name} is not installed: pip install '{pip_name}>=2.4' "
            "(or 'flatshard[lightning]')"
        )
    return packages
