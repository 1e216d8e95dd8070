"""What the planner knows about the machines: per-device speed, memory and links.

Presets hold vendor peak figures; ``achieved`` says what share of the peak FLOP/s dense
matrix products reach in practice (the one figure that is not on a datasheet: large
bf16 GEMMs on A100/H100 reach about 75-85% of peak in public measurements; we take
0.8). Links are a collective's bus bandwidth per rank. ``cpu_cluster`` measures this
machine instead (``_calibrate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Cluster:
    """One kind of device, ``ranks_per_host`` of them per host, ``hosts`` hosts."""

    name: str
    memory_bytes: int  # per device
    flops: dict[torch.dtype, float]  # peak dense matrix-product FLOP/s per dtype
    memory_bandwidth: float  # bytes/s of device memory
    intra_bandwidth: float  # bytes/s per rank inside a host (collective bus bandwidth)
    inter_bandwidth: float  # bytes/s per rank across hosts (a ring's bus bandwidth)
    intra_latency: float = 10e-6  # s per ring step between ranks of one host
    inter_latency: float = 30e-6  # s per ring step that crosses to another host
    collective_latency: float = 0.0  # s per collective, whatever its size
    op_overhead: float = 5e-6  # s per kernel: launch and tail (CPU: dispatch)
    achieved: float = 0.8  # share of peak FLOP/s that matrix products reach
    overlap: bool = True  # communication runs beside compute (own engines/streams)
    # Ops touching at most cache_bytes run at cache_bandwidth (CPUs; 0: no such cache).
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0
    # The host, for CPU offload (0: the device is the host, as on a CPU cluster): its
    # memory per rank, each rank's host-device link (PCIe) and its share of the host's
    # memory bandwidth and fp32 FLOP/s (the offloaded optimizer steps there).
    host_memory_bytes: int = 0
    host_link_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0
    host_flops: float = 0.0
    backend: str = "nccl"
    device: str = "cuda"
    hosts: int = 1
    ranks_per_host: int = 8
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def sized(self, hosts: int, ranks_per_host: int) -> Cluster:
        return replace(self, hosts=hosts, ranks_per_host=ranks_per_host)

    @property
    def host(self) -> Cluster:
        """The host's figures as a device's (the device itself where it is the host)."""
        if not self.host_memory_bandwidth:
            return self
        return replace(
            self,
            memory_bytes=self.host_memory_bytes,
            flops={torch.float32: self.host_flops},
            memory_bandwidth=self.host_memory_bandwidth,
            cache_bytes=0,
        )

    @property
    def link_bandwidth(self) -> float:
        """Bytes/s between a rank's host memory and its device (memory itself on a CPU)."""
        return self.host_link_bandwidth or self.memory_bandwidth

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        return self.flops[torch.float32]


def _nvidia(
    name: str,
    memory_gib: int,
    bf16_tflops: float,
    fp32_tflops: float,
    hbm_tbs: float,
    nvlink_gbs: float,
    nic_gbits_per_host: float,
    host: tuple[int, float, float, float],
) -> Cluster:
    """``host``: (GiB of host memory, PCIe GB/s achieved, host memory GB/s and fp32
    TFLOP/s of the host CPUs), each per GPU of an 8-GPU server."""
    host_gib, pcie_gbs, host_gbs, host_tflops = host
    tf32 = {torch.bfloat16: bf16_tflops, torch.float16: bf16_tflops, torch.float32: fp32_tflops}
    return Cluster(
        name=name,
        # NCCL's tuning model (src/graph/tuning.cc), ring with the Simple protocol: 8.4 us
        # per collective, 3.4 us per NVLink step, 14 us per network step.
        collective_latency=8.4e-6,
        intra_latency=3.4e-6,
        inter_latency=14e-6,
        memory_bytes=memory_gib * GiB,
        flops={dtype: tflops * 1e12 for dtype, tflops in tf32.items()},
        memory_bandwidth=hbm_tbs * 1e12,
        intra_bandwidth=nvlink_gbs * GB,
        # NCCL runs one ring channel per NIC, so a ring crossing hosts moves its data on
        # all of a host's NICs at once: its bus bandwidth is the host's, up to NVLink's.
        inter_bandwidth=min(nic_gbits_per_host / 8, nvlink_gbs) * GB,
        host_memory_bytes=host_gib * GiB,
        host_link_bandwidth=pcie_gbs * GB,
        host_memory_bandwidth=host_gbs * GB,
        host_flops=host_tflops * 1e12,
    )


PRESETS: dict[str, Cluster] = {
    # The paper's cluster: A100 80GB (312 TFLOPS bf16, 156 TF32), NVLink, 2 Tb/s RoCE a host.
    # Host (CPU offload) per GPU: DGX A100, 1 TiB and two 64-core EPYC 7742 (8 channels of
    # DDR4-3200 each, 410 GB/s; 9.2 fp32 TFLOP/s peak), PCIe 4 x16 (25 GB/s achieved).
    "a100-80gb": _nvidia("a100-80gb", 80, 312, 156, 2.0, 240, 2000, (128, 25, 51, 1.15)),
    # H100 SXM: 989 TFLOPS bf16 dense, 3.35 TB/s HBM3, NVLink 4, 8 x 400 Gb/s a host.
    # Host per GPU: DGX H100, 2 TiB and two 56-core Xeon 8480C (8 channels of DDR5-4800
    # each, 614 GB/s; 14.3 fp32 TFLOP/s peak), PCIe 5 x16 (50 GB/s achieved).
    "h100-80gb": _nvidia("h100-80gb", 80, 989, 495, 3.35, 360, 3200, (256, 50, 77, 1.8)),
    # H200: the H100's compute with 141 GB of 4.8 TB/s HBM3e (host as the DGX H100's).
    "h200": _nvidia("h200", 141, 989, 495, 4.8, 360, 3200, (256, 50, 77, 1.8)),
    # This project's 2-core development machine, 2 gloo ranks, as ``cluster="cpu"``
    # measured it (fixed figures, so that every rank that plans decides alike).
    "cpu-dev": Cluster(
        name="cpu-dev",
        memory_bytes=12 * GiB,
        flops={torch.float32: 97e9, torch.bfloat16: 0.7e9, torch.float16: 0.7e9},
        memory_bandwidth=4.1e9,
        intra_bandwidth=0.4e9,
        inter_bandwidth=0.4e9,
        intra_latency=50e-6,
        inter_latency=50e-6,
        op_overhead=3.2e-6,
        achieved=1.0,
        overlap=False,
        backend="gloo",
        device="cpu",
        ranks_per_host=2,
        cache_bytes=12 << 20,
        cache_bandwidth=19e9,
    ),
}
