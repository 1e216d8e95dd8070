"""Step time from the simulated step's ops: a compute stream and a communication stream.

Each compute op takes the launch overhead plus the longer of its FLOPs at the achieved
matrix-product rate and its bytes at memory bandwidth (a roofline; on a CPU, ops whose
bytes fit the cache run at the cache's bandwidth). Each collective runs as a ring over
its group, priced as NCCL's own tuning model prices one: a base latency, then (n - 1)
steps, of which the ``hosts`` that cross a host boundary pay the network's latency and
the others the host's, and (n - 1) / n of the buffer over the slowest link it crosses;
an all-reduce twice the steps and the bytes. Ops wait for what they read: a unit's
compute for its all-gather, a reduce-scatter for its gradient. A collective is issued
where the runtime issued it, so it cannot start before the compute issued ahead of it
has finished (prefetch overlaps the next unit's all-gather with this unit's compute, as
the runtime intends). Reductions on a process group of their own
(``set_separate_reduce_scatter_group``) run on a communication stream of their own, so an
all-gather does not queue behind them (their bandwidth is not shared: an optimistic
bound). Where communication cannot overlap compute (``Cluster.overlap`` False: gloo on a
few CPU cores, ``design/PEERS.md``), everything runs on one timeline.

With CPU offload, ops that write the host's storages run at the host's speed (the
optimizer's step, ``Cluster.host``), and an op that reads storages of the other side
(the shard's copy to the device, the gradient's copy back) takes at least those bytes
over the host-device link. Both stay on the compute timeline: the runtime blocks on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flatshard.planner._cluster import Cluster
from flatshard.planner._recorder import Op

_RING_PASSES = {"all_reduce": 2.0}


@dataclass(frozen=True)
class StepTime:
    """The simulated step on a cluster."""

    seconds: float
    compute_s: float  # the compute stream's busy time
    communication_s: float  # the communication stream's busy time
    exposed_communication_s: float  # step time the compute stream spent waiting
    flops: float  # FLOPs executed by this rank (recomputation included)


def compute_time(op: Op, cluster: Cluster, host: frozenset[int] = frozenset()) -> float:
    """One compute op's time; ``host``: the storages on the host (CPU offload)."""
    on_host = any(s in host for s in op.writes)
    where = cluster.host if on_host else cluster
    rate = where.peak_flops(op.dtype) * where.achieved
    bandwidth = where.memory_bandwidth
    if where.cache_bandwidth and op.io_bytes <= where.cache_bytes:
        bandwidth = where.cache_bandwidth
    own = max(op.flops / rate, op.io_bytes / bandwidth)
    crossing = sum(
        b for s, b in zip(op.reads, op.read_bytes, strict=True) if (s in host) != on_host
    )
    return cluster.op_overhead + max(own, crossing / cluster.link_bandwidth)


def collective_time(op: Op, cluster: Cluster) -> float:
    n = op.group_size
    if n <= 1:
        return 0.0
    across = op.hosts if op.hosts > 1 else 0  # ring steps that cross a host boundary
    bandwidth = cluster.inter_bandwidth if across else cluster.intra_bandwidth
    steps = (n - 1 - across) * cluster.intra_latency + across * cluster.inter_latency
    passes = _RING_PASSES.get(op.collective or "", 1.0)
    transfer = op.io_bytes * (n - 1) / n / bandwidth
    return cluster.collective_latency + passes * (steps + transfer)


def step_time(ops: Sequence[Op], cluster: Cluster, host: frozenset[int] = frozenset()) -> StepTime:
    ready: dict[int, float] = {}  # storage serial -> when its last writer finishes
    compute_at = 0.0
    comm_at = [0.0, 0.0]  # the communication streams: the shard group's, the reductions'
    busy_compute = busy_comm = waited = 0.0
    for op in ops:
        after = max((ready.get(s, 0.0) for s in op.reads), default=0.0)
        if op.collective is None:
            cost = compute_time(op, cluster, host)
            start = max(compute_at, after)
            waited += start - compute_at
            compute_at = start + cost
            busy_compute += cost
            end = compute_at
        else:
            cost = collective_time(op, cluster)
            stream = int(op.own_group)
            start = max(comm_at[stream], after, compute_at)
            comm_at[stream] = start + cost
            busy_comm += cost
            end = comm_at[stream]
            if not cluster.overlap:  # one timeline: compute waits for the collective
                waited += end - compute_at
                compute_at = end
        for serial in op.writes:
            ready[serial] = end
    total = max(compute_at, *comm_at)
    flops = sum(op.flops for op in ops)
    exposed = waited + (total - compute_at)
    return StepTime(total, busy_compute, busy_comm, exposed, flops)
