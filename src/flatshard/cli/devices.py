"""Where a command's ranks run: one GPU per rank with NCCL, or CPUs with gloo."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from flatshard.cli.config import fail

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, local_ranks: int, share_gpus: bool = False) -> str:
    """``cpu`` or ``cuda`` for ``--device`` (auto: cuda when a GPU is visible).

    NCCL needs a GPU of its own for every rank of a host: more local ranks than GPUs is
    an error here rather than NCCL's "duplicate GPU" failure inside every rank, unless
    ``share_gpus`` (``--share-gpus``, for testing: see ``share_gpu_environment``).
    """
    if device not in DEVICES:
        fail("device", f"must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            fail("device", "is cuda, but no GPU is visible here (use --device cpu)")
        if local_ranks > count and not share_gpus:
            fail(
                "nproc",
                f"({local_ranks}) exceeds the {count} GPU(s) of this host: NCCL needs one "
                f"GPU per rank (use --nproc {count}, or --device cpu for gloo; --share-gpus "
                "runs them anyway, for testing only)",
            )
    return device


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def share_gpu_environment(rank: int) -> None:
    """Let several NCCL ranks share one GPU: each poses as a host of its own.

    NCCL refuses two ranks of one communicator on one GPU of one host ("duplicate GPU").
    A host id of its own per rank (``NCCL_HOSTID``) makes them "remote" to each other, so
    NCCL talks over sockets on the loopback device, with InfiniBand, peer-to-peer and
    shared memory off. Time-sliced and slow: for correctness checks (``--share-gpus``,
    ``benchmarks/gpu_check.sh``), useless for timing. Set before the process group.
    """
    os.environ["NCCL_HOSTID"] = f"flatshard-rank-{rank}"
    os.environ.setdefault("NCCL_NET", "Socket")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    for switch in ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        os.environ.setdefault(switch, "1")


def init_rank(
    device: str,
    init_method: str,
    rank: int,
    world: int,
    local_rank: int,
    share_gpus: bool = False,
) -> torch.device:
    """Join the process group (NCCL on ``cuda``, gloo on ``cpu``); return this rank's device.

    On GPUs the rank's GPU becomes the current one (NCCL and FSDP2 use it) and is given to
    the process group, which would otherwise guess it from the global rank. With
    ``share_gpus`` local ranks go round the GPUs (``share_gpu_environment``).
    """
    on = torch.device("cpu")
    if device == "cuda":
        index = local_rank
        if share_gpus:
            index = local_rank % torch.cuda.device_count()
            share_gpu_environment(rank)
        torch.cuda.set_device(index)
        on = torch.device("cuda", index)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world,
        device_id=on if device == "cuda" else None,
    )
    return on


def peak_memory_label(device: torch.device) -> str:
    """What ``peak_memory_mib`` measures on ``device``, in a few words."""
    return "max allocated" if device.type == "cuda" else "peak RSS"


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: allocated by PyTorch on a GPU, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
