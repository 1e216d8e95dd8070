"""The planner: ``flatshard.plan`` and ``flatshard plan`` (see plan.py)."""
