"""``flatshard train --ft-replicas N --ft-replica-id I``: this run as one replica group of a
fault-tolerant run on torchft (``flatshard.integrations.torchft``).

The group shards the model over its own ranks as any run does; torchft's manager (one per
rank) joins the quorum of the live groups before every step, averages each reduced
gradient shard over it, and commits the step only where it went through. A group that
comes back (its torchrun restarts it, or it starts late) copies a live group's model,
optimizer state and step count at its first quorum. The step count is the manager's: the
data and the learning rate of a step follow from it, so a healed group reads on where the
others are.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.cli.config import ConfigError
from flatshard.integrations.torchft import replicate_with, state_dict_fns

QUORUM_TIMEOUT = timedelta(seconds=60)


class FaultTolerance:
    """This rank's torchft manager and its optimizer wrapper; the quorum's size by step."""

    def __init__(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        group: int,
        min_replicas: int,
        lighthouse: str,
        device: torch.device,
    ) -> None:
        try:
            from torchft import Manager  # type: ignore[import-untyped]
            from torchft.optim import OptimizerWrapper  # type: ignore[import-untyped]
            from torchft.process_group import (  # type: ignore[import-untyped]
                ProcessGroupGloo,
                ProcessGroupNCCL,
            )
        except ImportError:
            raise ConfigError("--ft-replicas needs torchft: pip install 'flatshard[ft]'") from None
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ConfigError(
                "--ft-replicas needs torchft's Lighthouse: --ft-lighthouse http://host:29510 "
                "or TORCHFT_LIGHTHOUSE (start one with: torchft_lighthouse --min_replicas 1)"
            )
        self._store, address, port = _group_store()  # (served as long as it lives)
        load, save = state_dict_fns(model, [optim])
        across = ProcessGroupNCCL() if device.type == "cuda" else ProcessGroupGloo()
        self.manager = Manager(
            pg=across,
            min_replica_size=min_replicas,
            load_state_dict=load,
            state_dict=save,
            replica_id=f"group{group}",
            store_addr=address,
            store_port=port,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            lighthouse_addr=lighthouse,
            use_async_quorum=False,  # a heal applies before the step's forward
            quorum_timeout=QUORUM_TIMEOUT,
        )
        replicate_with(model, self.manager)
        self.optim: torch.optim.Optimizer = OptimizerWrapper(self.manager, optim)
        self.members: int | None = None  # replica groups in the last committed step
        self.fewer = 0  # committed steps taken with fewer groups than --ft-replicas

    def start(self, step: int) -> None:
        """The first quorum (a late or restarted group heals in it), from ``step`` (a
        resumed checkpoint's)."""
        if step:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.optim.zero_grad()

    @property
    def step(self) -> int:
        """Optimizer steps committed so far (the manager's count, healed ones included)."""
        return int(self.manager.current_step())

    def committed(self, members: int, replicas: int) -> str | None:
        """A step committed with ``members`` groups: what changed, in words (or None)."""
        before, self.members = self.members, members
        if members < replicas:
            self.fewer += 1
        if before is None or before == members:
            return None
        return (
            f"step {self.step}: {members} of {replicas} replica groups in the quorum (was {before})"
        )

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _group_store() -> tuple[Any, str, int]:
    """A store of this group's own for its managers (rank 0's, None elsewhere): rank 0
    serves it, every rank learns where (torchrun's store would do too, but
    ``flatshard train``'s own launch uses a file)."""
    store = None
    if dist.get_rank() == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]  # exported, not in __all__
            "0.0.0.0", 0, dist.get_world_size(), is_master=True, wait_for_workers=False
        )
    where: list[Any] = [(os.environ.get("MASTER_ADDR", "localhost"), store.port if store else 0)]
    dist.broadcast_object_list(where, src=0)
    return store, where[0][0], int(where[0][1])
