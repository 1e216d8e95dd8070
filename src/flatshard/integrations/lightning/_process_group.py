"""The process group under both Lightning strategies (the ``Trainer``'s and Fabric's).

Connected and used with Lightning's own helpers, as its ``strategy="ddp"`` does, so that
``devices=N`` (Lightning spawns the ranks) and ``torchrun`` work as they do there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from flatshard.integrations.torchft import ReplicaGroups
from flatshard.runtime import agree

from ._packages import lightning_for

# This copy's Lightning package ([Note: one integration, two Lightning packages]).
if TYPE_CHECKING:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
        _sync_ddp_if_available,
    )
else:
    _distributed = lightning_for(__name__).fabric("utilities.distributed")
    _get_default_process_group_backend_for_device = (
        _distributed._get_default_process_group_backend_for_device
    )
    _init_dist_connection = _distributed._init_dist_connection
    _sync_ddp_if_available = _distributed._sync_ddp_if_available


class Placed(Protocol):
    """Where a strategy's process is: what both Lightning strategies know of it."""

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...


def set_world_ranks(strategy: Placed) -> None:
    """Tell the strategy's cluster environment this process's global rank and the world
    size (``num_processes`` per node)."""
    environment = strategy.cluster_environment
    if environment is not None:
        processes = strategy.num_processes
        environment.set_global_rank(strategy.node_rank * processes + strategy.local_rank)
        environment.set_world_size(strategy.num_nodes * processes)


def sampler_kwargs(strategy: Placed, rank: int, groups: ReplicaGroups | None) -> dict[str, Any]:
    """Lightning's DistributedSampler arguments for the strategy's process (global rank
    ``rank``): each rank its part of the data; with replica groups on torchft, each group
    its own share, and each rank its part of that."""
    world = strategy.num_nodes * strategy.num_processes
    if groups is None:
        return {"num_replicas": world, "rank": rank}
    return {"num_replicas": groups.count * world, "rank": groups.index * world + rank}


def connect(environment: ClusterEnvironment, backend: str | None, device: torch.device) -> str:
    """Join the default process group (``backend``: the device's default when None, e.g.
    gloo on CPU, NCCL on CUDA); returns the backend."""
    backend = backend or _get_default_process_group_backend_for_device(device)
    device_id = device if device.type != "cpu" else None
    _init_dist_connection(environment, backend, device_id=device_id)
    return backend


# [Note: Lightning's barriers and broadcasts, agreed]
# Lightning calls its strategy's barrier and broadcast around checkpoints, validation and
# setup (a checkpoint's path is broadcast from rank 0). Made on one rank alone (a
# save_checkpoint on rank 0 only, validation batches on one rank) they would meet another
# rank's flatshard collective or its exit: gloo's "Connection closed by peer", or a wait
# to the timeout. Once the model is sharded, the ranks agree on each through the store
# first, so such a rank is named on every rank within seconds.


def barrier(model: nn.Module | None, name: str | None = None) -> None:
    if dist.is_available() and dist.is_initialized():
        if model is not None:
            agree(model, f"Lightning's strategy.barrier({name or ''})")
        dist.barrier()


def broadcast(obj: Any, src: int, model: nn.Module | None) -> Any:
    """``obj`` as rank ``src`` has it (pickled), or as it is without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    if model is not None:
        agree(model, f"Lightning's strategy.broadcast(src={src})")
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(tensor: Any, group: Any, reduce_op: Any) -> Any:
    """A tensor reduced over ``group`` (Lightning's ``"mean"``/``"sum"`` or a ReduceOp);
    anything else as it is."""
    if isinstance(tensor, torch.Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
