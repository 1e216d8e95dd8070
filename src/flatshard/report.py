"""The types behind flatshard's reports, and the layout arithmetic they describe.

``flatshard.sharding_summary(model)`` returns a ``ShardingSummary``; ``flatshard.
dtype_plan(model)`` a ``DtypePlan``. ``plan_layout`` computes the row-aligned layout of a
list of shapes cut across F ranks without any process group (e.g. to see the padding a
sharding factor would cost). ``describe_collectives(group)`` says which implementation each
collective uses on a group's backend.
"""

from flatshard.comm import ShardGroups
from flatshard.comm import describe as describe_collectives
from flatshard.flat import DtypePlan, DtypeRow, FlatLayout, ParamSlot, ShardRange, plan_layout
from flatshard.runtime import FlatParamSummary, ShardingSummary

__all__ = [
    "DtypePlan",
    "DtypeRow",
    "FlatLayout",
    "FlatParamSummary",
    "ParamSlot",
    "ShardGroups",
    "ShardRange",
    "ShardingSummary",
    "describe_collectives",
    "plan_layout",
]
