"""What ``placement=flatshard.Whole()`` costs in padding: unsharded bytes over parameter
bytes, per unit.

With ``Whole()`` no parameter is cut into rows: each lies whole in one rank's shard
and every shard is as large as the most loaded rank's (see [Note: whole-parameter layout]).
That ratio is what the shards, the all-gathers and the reduce-scatters pay over the row
layout. Computed from the layout alone (no processes), for the GPT shapes of ``flatshard
bench --preset byte-gpt`` and ``--preset llm-32k``, at F = 2, 4 and 8:

    python benchmarks/whole_params_padding.py
"""

from __future__ import annotations

import math

import torch

from flatshard.cli.bench.config import PRESETS
from flatshard.models import GPT
from flatshard.report import row_layout


def ratio(shapes: list[torch.Size], factor: int, whole: bool) -> float:
    layout = row_layout(shapes, factor, whole=whole)
    return layout.unsharded_numel / sum(math.prod(s) for s in shapes)


def main() -> None:
    print("preset    F  block rows  block whole  root rows  root whole")
    for name in ("byte-gpt", "llm-32k"):
        shape = PRESETS[name]
        with torch.device("meta"):
            model = GPT(*(shape[k] for k in ("vocab", "dim", "heads", "layers", "seq_len")))
        in_blocks = {id(p) for p in model.blocks.parameters()}
        block = [p.shape for p in model.blocks[0].parameters()]
        root = [p.shape for p in model.parameters() if id(p) not in in_blocks]
        for factor in (2, 4, 8):
            print(
                f"{name:9} {factor}  {ratio(block, factor, False):10.3f}  "
                f"{ratio(block, factor, True):11.3f}  {ratio(root, factor, False):9.3f}  "
                f"{ratio(root, factor, True):10.3f}"
            )


if __name__ == "__main__":
    main()
