"""Shared fixtures: one worker pool for the whole session, one local process group."""

from __future__ import annotations

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
def local_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    """A world of one process (this one), for checks that need no peers. Its store's
    folder is pytest's (removed by a later session), not removed at teardown: flatshard's
    watchdog thread still polls the store's file after the group is destroyed."""
    store = tmp_path_factory.mktemp("local_group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
