"""The types behind flatshard's reports, and the layout arithmetic they describe.

``flatshard.sharding_summary(model)`` returns a ``ShardingSummary``; ``flatshard.
dtype_report(model)`` a ``DtypeReport``. ``row_layout`` computes the row-aligned layout of a
list of shapes cut across F ranks without any process group (e.g. to see the padding a
sharding factor would cost). ``describe_collectives(group)`` says which implementation each
collective uses on a group's backend. ``plan_layout`` and ``DtypePlan``, their old names,
still work for now, with a FutureWarning.
"""

import warnings
from typing import Any

from flatshard.comm import ShardGroups
from flatshard.comm._collectives import describe as describe_collectives
from flatshard.flat import DtypeReport, DtypeRow, FlatLayout, ParamSlot, ShardRange, row_layout
from flatshard.runtime import FlatParamSummary, ShardingSummary

__all__ = [
    "DtypeReport",
    "DtypeRow",
    "FlatLayout",
    "FlatParamSummary",
    "ParamSlot",
    "ShardGroups",
    "ShardRange",
    "ShardingSummary",
    "describe_collectives",
    "row_layout",
]

_RENAMED = {"plan_layout": "row_layout", "DtypePlan": "DtypeReport"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"flatshard.report.{name} is now flatshard.report.{new}", FutureWarning, stacklevel=2
        )
        return globals()[new]
    raise AttributeError(f"module 'flatshard.report' has no attribute {name!r}")
