"""Placements that are features: they install hooks and issue collectives of their own.

``RowSparse`` (``_row_sparse``): an embedding table whose lookups fetch only their rows
from the ranks that hold them, and whose gradients travel as rows. ``Experts``
(``_experts``): a mixture of experts' stacked weights, each rank keeping its experts, with
the token all-to-all around them.

They sit above the runtime and reach it only through the placement protocol of
``flatshard.flat`` (``ShardPlacement`` at build time, ``GroupPlacement`` at run time: [Note:
one placement protocol]), so the unit, step and hook code cannot know they exist
(``tests/test_layers.py`` checks the direction of every import).

Layer 4: imports ``flatshard.runtime`` and below.
"""

from flatshard.placements._experts import Experts
from flatshard.placements._row_sparse import RowSparse

__all__ = ["Experts", "RowSparse"]
