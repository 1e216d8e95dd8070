"""torch.distributed.checkpoint (DCP) planners that save and load ``RowShard`` values.

DCP already reshards: each saved tensor is a set of chunks (offsets, sizes), and a loader
asks for the chunk it holds and reads the overlapping parts. These planners teach DCP's
default planners one more kind of value, a ``RowShard``: its chunk is
``offsets (first_row, 0, ...)``, ``sizes local.shape`` (see [Note: sharded state dicts are
row ranges]). Everything else (plain tensors, Python objects) is left to the defaults, which
deduplicate replicated values across ranks. ``write`` and ``read`` run DCP with them. DCP
takes about a second to import, so ``_checkpoint`` imports this module only when used.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from flatshard.state._state_dict import RowShard


def _chunk(value: RowShard) -> ChunkStorageMetadata:
    offsets = [value.first_row] + [0] * (len(value.full_shape) - 1)
    if value.base:  # a tensor-parallel shard: rows count from its place in the whole
        offsets = [o + b for o, b in zip(offsets, value.base, strict=True)]
    return ChunkStorageMetadata(
        offsets=torch.Size(offsets[: len(value.full_shape)]), sizes=value.local.shape
    )


def _is_chunked(value: object) -> bool:
    """A RowShard with rows (a fully empty tensor is saved plainly, by every rank)."""
    return isinstance(value, RowShard) and value.full_shape.numel() > 0


def _plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The values DCP's defaults handle: everything but chunked RowShards."""
    return {
        key: (value.local if isinstance(value, RowShard) else value)
        for key, value in state_dict.items()
        if not _is_chunked(value)
    }


class RowShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner plus one write item per ``RowShard`` with rows."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(_plain(self.state_dict), self.is_coordinator)
        items = list(plan.items)
        for key, value in self.state_dict.items():
            if _is_chunked(value) and value.rows:
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, _chunk(value).offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=_chunk(value),
                            properties=TensorProperties.create_from_tensor(value.local),
                            size=value.full_shape,
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, RowShard):
            return value.local.contiguous()
        return super().lookup_object(index)


class RowShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner plus reads for the rows each ``RowShard`` holds.

    Tensors are read in place into the given tensors (for a model: its shards). Python
    objects are unpickled with ``weights_only=True``: a checkpoint cannot run code.
    """

    def __init__(self) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True
        )

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # The default would pass every value through DCP's meta-tensor initialization,
        # which turns values it does not know (RowShard) into None. Ours are allocated.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plan = create_default_local_load_plan(_plain(self.state_dict), self.metadata, strict=False)
        items = list(plan.items)
        for key, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if _is_chunked(value) and value.rows and isinstance(saved, TensorStorageMetadata):
                items += create_read_items_for_chunk_list(key, saved, [_chunk(value)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, RowShard):
            return value.local
        found: torch.Tensor = super().lookup_tensor(index)
        return found

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def write(directory: Path, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """DCP's save of ``state`` (row shards as chunks) into ``directory``."""
    with _single_process_is_intended():
        dcp_save(
            state,
            storage_writer=FileSystemWriter(directory),
            planner=RowShardSavePlanner(),
            process_group=group,
            no_dist=group is None,
        )


def read(directory: Path, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """DCP's load of ``state`` (in place) from ``directory``; one process if no group."""
    with _single_process_is_intended():
        dcp_load(
            state,
            storage_reader=FileSystemReader(directory),
            planner=RowShardLoadPlanner(),
            process_group=group,
            no_dist=group is None,
        )


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: for a plain model we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
