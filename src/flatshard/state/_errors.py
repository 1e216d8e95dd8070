"""The error of checkpoints that cannot be saved or loaded."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, foreign, truncated, corrupt) or saved."""
