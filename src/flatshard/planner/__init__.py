"""``flatshard.plan``: per-rank peak memory, collectives and step time, before launch.

It runs flatshard itself on the meta device in a simulated world (``_simulate``, recorded
op by op by ``_recorder``: [Note: simulated step]), prices the ops (``_timing``) on a
``Cluster`` (``_cluster``: presets; ``_calibrate``: this machine measured), and recommends
the fastest setup that fits a memory budget (``_recommend``).

Layer 7: imports ``flatshard.state`` and below. The public types users plan with are here:
``plan``, ``Plan``, ``Setup``, ``Cluster``, ``PRESETS``, ``recommend``, ``Pipeline`` (a
pipelined layout to plan; ``_pipeline``).
"""

from flatshard.planner._calibrate import cpu_cluster
from flatshard.planner._cluster import PRESETS, Cluster
from flatshard.planner._pipeline import Pipeline, PipelineCost, PipelineRank
from flatshard.planner._plan import Plan, plan
from flatshard.planner._recommend import Candidate, Problem, best_fit, recommend
from flatshard.planner._simulate import Setup

__all__ = [
    "PRESETS",
    "Candidate",
    "Cluster",
    "Pipeline",
    "PipelineCost",
    "PipelineRank",
    "Plan",
    "Problem",
    "Setup",
    "best_fit",
    "cpu_cluster",
    "plan",
    "recommend",
]
