"""--optimizer: AdamW, Muon (with AdamW for what is not a block's matrix) or Adafactor.

Muon and Adafactor update each parameter as a whole matrix, so a run with either keeps the
parameters they step whole (``fully_shard(placement=...)`` with ``Whole()``, see
``shard_language_model``): each lies whole on one rank, which steps it. Muon takes the
blocks' 2-D weights, kept whole; the embeddings, the output head, norms and biases go to
AdamW, as Muon is used, and stay row-sharded. Adafactor steps, and keeps whole, everything.
Muon's learning rate is scaled to match AdamW's update size (``adjust_lr_fn=
"match_rms_adamw"``), so one --lr schedule drives both.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.cli.internals import PlacementRule, WholeChoice, muon_matrices, placement_rule
from flatshard.flat import ShardPlacement
from flatshard.placements import Experts, RowSparse

OPTIMIZERS = ("adamw", "muon", "adafactor")


def needs_whole_params(kind: str) -> bool:
    """Whether ``kind`` updates whole matrices (and the run must shard whole parameters)."""
    return kind != "adamw"


def placement_for(
    kind: str, model: nn.Module, unit_classes: set[type[nn.Module]], row_sparse: bool
) -> PlacementRule:
    """``fully_shard``'s ``placement`` for optimizer ``kind`` over ``model`` (unsharded):
    the matrices it updates whole kept whole, the embedding tables row-sparse if asked."""
    whole: WholeChoice = needs_whole_params(kind)
    if kind == "muon":
        matrices = muon_matrices(model, unit_classes)
        whole = lambda name, param: id(param) in matrices  # noqa: E731
    return placement_rule(model, whole, tables_placement(row_sparse))


def tables_placement(row_sparse: bool) -> ShardPlacement | None:
    """--row-sparse-tables as a placement for the whole model: its tables row-sparse."""
    return RowSparse() if row_sparse else None


def with_experts(rule: PlacementRule, model: nn.Module, degree: int) -> PlacementRule:
    """``rule`` with the stacked expert weights (``.experts.`` in their names) placed
    ``Experts(degree)`` (--ep)."""
    if isinstance(rule, ShardPlacement):  # one value for the parameters it serves
        rule = placement_rule(model, lambda name, param: False, rule)
    others = rule

    def experts_first(name: str, param: nn.Parameter) -> ShardPlacement | None:
        if ".experts." in f".{name}":
            return Experts(degree)
        return others(name, param) if callable(others) else None

    return experts_first


def build_optimizers(
    model: nn.Module,
    unit_classes: set[type[nn.Module]],
    kind: str,
    lr: float,
    weight_decay: float,
) -> list[torch.optim.Optimizer]:
    """The run's optimizers over ``model``'s trainable parameters (built after sharding)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)]
    matrices = muon_matrices(model, unit_classes) if kind == "muon" else set()
    rest = [p for p in params if id(p) not in matrices]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )
    if kind != "muon":
        return [adamw]
    muon = torch.optim.Muon(
        [p for p in params if id(p) in matrices],
        lr=lr,
        weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return [muon, adamw]
