"""Shared fixtures: one worker pool for the whole session, one local process group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from flatshard.testing.workers import WorkerPool

POOL_SIZE = 4  # world sizes 1 to 4 run as subgroups of one pool

# [Note: the longest files first]
# `make test` hands each test file whole to one of two workers (--dist loadfile), in the
# order of the collection (--no-loadscope-reorder). xdist's own order, by number of tests,
# left the files of few long tests (restarts, Lightning, the Hugging Face trainer, the
# install) for last, one worker idle while the other ran them. Longest first, the rest
# after in their own order: both workers end within seconds of each other. The seconds
# behind this order: `pytest -n 2 --dist loadfile --durations=0` (2026-12-07), each file's
# tests summed; a file missing from the list only runs later.
LONGEST_FIRST = [
    "test_restarts.py",
    "test_cli.py",
    "test_torchft.py",
    "test_plan.py",
    "test_lightning.py",
    "test_strategies.py",
    "test_hangs.py",
    "test_agreement.py",
    "test_parting.py",
    "test_async_checkpoint.py",
    "test_parity.py",
    "test_transformers_trainer.py",
    "test_torchtitan.py",
    "test_pipelining.py",
    "test_features_meet.py",
    "test_cli_faults.py",
    "test_conformance.py",
    "test_guide.py",
    "test_join.py",
    "test_row_sparse.py",
    "test_install.py",
    "test_nccl_path.py",
    "test_trl.py",
    "test_checkpoint.py",
]
_missing = [name for name in LONGEST_FIRST if not Path(__file__).with_name(name).exists()]
assert not _missing, f"LONGEST_FIRST names test files that are gone: {_missing}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


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
