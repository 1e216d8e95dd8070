"""Lightning Fabric runs for test_lightning.py: ``python fabric_script.py OUT_DIR``.

Fabric (devices=2) launches the second rank itself. The same model and batches under
``strategy="ddp"`` and ``FlatshardFabricStrategy``, with accumulation over 2 micro-batches
(``fabric.no_backward_sync``) and clipping (``fabric.clip_gradients``); then a run saved
after 2 steps (``fabric.save``) and resumed (``fabric.load``). Each rank writes its losses
to OUT_DIR/fabric<r>.json. ``python fabric_script.py OUT_DIR replica GROUP LIGHTHOUSE``: one
rank, replica group GROUP of two on torchft (``replica_groups``), writing
OUT_DIR/replica<GROUP>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from flatshard.integrations.lightning import FlatshardFabricStrategy
from lightning_script import Block, Layers, loader

STEPS = 4
_last_model: list[Any] = []  # the model of the last run (flatshard's)


class Net(Layers):
    def __init__(self) -> None:
        super().__init__()
        self.add_layers()


def train(
    kind: str,
    first: int = 0,
    last: int = STEPS,
    load: Path | None = None,
    save: Path | None = None,
    replica: Any = None,
) -> list[float]:
    """Optimizer steps ``first`` to ``last`` (2 micro-batches each); this rank's losses.
    ``replica``: a ``ReplicaGroups`` of one rank each."""
    strategy: Any = "ddp"
    if kind != "ddp":
        strategy = FlatshardFabricStrategy(auto_wrap_policy={Block}, replica_groups=replica)
    fabric = Fabric(accelerator="cpu", devices=1 if replica else 2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    if kind == "ddp":
        optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        model, optim = fabric.setup(model, optim)
    else:
        model = fabric.setup_module(model)
        _last_model[:] = [model]
        optim = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    state: dict[str, Any] = {"model": model, "optimizer": optim, "step": 0}
    if load is not None:
        fabric.load(load, state)
        assert state["step"] == first, state["step"]
    batches = list(fabric.setup_dataloaders(loader()))
    losses = []
    for step in range(first, last):
        for micro in range(2):
            tokens, targets = batches[2 * step + micro]
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                fabric.backward(loss / 2)
            losses.append(float(loss))
        fabric.clip_gradients(model, optim, max_norm=0.05)
        optim.step()
        optim.zero_grad()
        state["step"] = step + 1
    if save is not None:
        fabric.save(save, state)
    return losses


def main(out: Path) -> None:
    results = {kind: train(kind) for kind in ("ddp", "flatshard")}
    saved = out / "fabric.ckpt"
    train("flatshard", last=2, save=saved)
    results["resumed"] = train("flatshard", first=2, load=saved)
    results["kind"] = "dir" if saved.is_dir() else "file"  # type: ignore[assignment]
    rank = torch.distributed.get_rank()
    (out / f"fabric{rank}.json").write_text(json.dumps(results))


def replica(out: Path, group: int, lighthouse: str) -> None:
    """Replica group ``group`` of two on torchft: trains as rank ``group`` of the 2-rank
    runs; writes its losses and its full parameters."""
    import flatshard
    from flatshard.integrations.torchft import ReplicaGroups

    losses = train("flatshard", replica=ReplicaGroups(2, group, lighthouse))
    with flatshard.summon_full_params(_last_model[0]):
        params = [p.detach().flatten().tolist() for p in _last_model[0].parameters()]
    (out / f"replica{group}.json").write_text(json.dumps({"losses": losses, "params": params}))


if __name__ == "__main__":
    if sys.argv[2:3] == ["replica"]:
        replica(Path(sys.argv[1]), int(sys.argv[3]), sys.argv[4])
    else:
        main(Path(sys.argv[1]))
