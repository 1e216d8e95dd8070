"""The flat parameter: the row-aligned layout, ``FlatParamGroup`` (the paper's
FlatParameter) and its gradient reduction, and what decides its contents.

Pure layout math (``_layout``), storage with unshard/reshard and views (``_flat_param``),
the gradient path (``_reduction``), dtypes and offload (``_mixed_precision``),
tensor-parallel (DTensor) parameters (``_tensor_parallel``), which unit owns each parameter
and which modules become units (``_partition``). How each parameter lies across the shard
group is its placement (``_placement``: the protocol, ``Rows``, ``Whole``, ``Unmanaged``;
the placements that install hooks and issue collectives of their own, ``RowSparse`` and
``Experts``, sit above the runtime in ``flatshard.placements``), and how gathers and
reductions travel its group's transport and its codec (``_transport``).

Layer 2: imports ``flatshard.comm`` and below.
"""

from flatshard.flat._layout import FlatLayout, ParamSlot, ShardRange, row_layout
from flatshard.flat._mixed_precision import CPUOffload, DtypeReport, DtypeRow, MixedPrecision
from flatshard.flat._partition import SizePolicy, SublayerPolicy
from flatshard.flat._placement import Rows, ShardPlacement, TableTraffic, Unmanaged, Whole
from flatshard.flat._reduction import CommHook

__all__ = [
    "CPUOffload",
    "CommHook",
    "DtypeReport",
    "DtypeRow",
    "FlatLayout",
    "MixedPrecision",
    "ParamSlot",
    "Rows",
    "ShardPlacement",
    "ShardRange",
    "SizePolicy",
    "SublayerPolicy",
    "TableTraffic",
    "Unmanaged",
    "Whole",
    "row_layout",
]
