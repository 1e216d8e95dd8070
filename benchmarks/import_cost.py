"""What ``import flatshard`` costs a process, against importing PyTorch's ``fully_shard``.

Every rank pays its imports. Each statement runs in a fresh interpreter, interleaved
``--repeats`` times (the machine is shared and noisy); the medians of the resident memory
after the import (VmRSS) and of the import's wall time are printed, with their ratios to
``from torch.distributed.fsdp import fully_shard``.

    python benchmarks/import_cost.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

STATEMENTS = {
    "import torch": "import torch",
    "torch fully_shard": "from torch.distributed.fsdp import fully_shard",
    "import flatshard": "import flatshard",
}
_PROBE = """
import time
t = time.perf_counter()
{statement}
seconds = time.perf_counter() - t
rss = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]
print(int(rss) * 1024, seconds)
"""


def measure(statement: str) -> tuple[int, float]:
    """(resident bytes, seconds) of one fresh interpreter that ran ``statement``."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(statement=statement)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):
        for name, statement in STATEMENTS.items():
            runs[name].append(measure(statement))
    base_rss = statistics.median(r for r, _ in runs["torch fully_shard"])
    base_s = statistics.median(s for _, s in runs["torch fully_shard"])
    print(f"{'':20} {'RSS MB':>8} {'x fsdp':>7} {'seconds':>8} {'x fsdp':>7}")
    for name, values in runs.items():
        rss = statistics.median(r for r, _ in values)
        seconds = statistics.median(s for _, s in values)
        print(
            f"{name:20} {rss / 1e6:8.1f} {rss / base_rss:7.3f} {seconds:8.2f} "
            f"{seconds / base_s:7.3f}"
        )


if __name__ == "__main__":
    main()
