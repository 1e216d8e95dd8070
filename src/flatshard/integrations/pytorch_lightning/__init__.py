"""flatshard as a strategy of the standalone ``pytorch_lightning`` package.

trainer = pytorch_lightning.Trainer(strategy=FlatshardStrategy(auto_wrap_policy={Block}))
fabric = lightning_fabric.Fabric(strategy=FlatshardFabricStrategy(auto_wrap_policy={Block}))

The same classes as ``flatshard.integrations.lightning``, from the same code, derived from
``pytorch_lightning``'s and ``lightning_fabric``'s classes (the ``Trainer`` of each package
takes only strategies of its own): this package loads the modules of
``integrations/lightning/`` under its own name ([Note: one integration, two Lightning
packages] in ``integrations/lightning/_packages.py``). docs/lightning.md has the rest.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

# The modules of this package are those of integrations/lightning/, loaded again here.
__path__ = [str(Path(__file__).resolve().parent.parent / "lightning")]

if TYPE_CHECKING:
    from flatshard.integrations.lightning import (
        FlatshardFabricPrecision,
        FlatshardFabricStrategy,
        FlatshardPrecision,
        FlatshardStrategy,
    )
else:
    _fabric = importlib.import_module(f"{__name__}._fabric")
    _precision = importlib.import_module(f"{__name__}._precision")
    _strategy = importlib.import_module(f"{__name__}._strategy")
    FlatshardFabricPrecision = _fabric.FlatshardFabricPrecision
    FlatshardFabricStrategy = _fabric.FlatshardFabricStrategy
    FlatshardPrecision = _precision.FlatshardPrecision
    FlatshardStrategy = _strategy.FlatshardStrategy

__all__ = [
    "FlatshardFabricPrecision",
    "FlatshardFabricStrategy",
    "FlatshardPrecision",
    "FlatshardStrategy",
]
