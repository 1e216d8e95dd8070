"""Shared fixtures: one worker pool for the whole session, one local process group."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from flatshard.testing.workers import WorkerPool

POOL_SIZE = 4  # world sizes 1 to 4 run as subgroups of one pool


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool(POOL_SIZE)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def local_group() -> Iterator[dist.ProcessGroup]:
    """A world of one process (this one), for checks that need no peers."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        yield dist.group.WORLD
        dist.destroy_process_group()
