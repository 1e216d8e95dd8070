"""A sharded model's process at its exit, with its c10d store served by another process.

``python exit_script.py PORT DIR``: a one-rank process group over the store at ``PORT``,
a sharded model trained one step and still alive at exit. The script writes ``DIR/ready``
and waits for ``DIR/stopped`` (the test has stopped the store's host: the watchdog's
responder is then inside a store call that waits for an answer) before it ends. Its
teardown takes a while (an object in the program's globals whose finalizer sleeps), as a
large program's does; the model's own finalizer writes ``DIR/model-collected``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.testing.internals import watchdog

PORT, OUT = int(sys.argv[1]), Path(sys.argv[2])
TEARDOWN_S = 3.0


class SlowTeardown:
    """Deleted with the program's globals, in the interpreter's teardown."""

    def __del__(self, sleep=time.sleep, seconds=TEARDOWN_S) -> None:  # type: ignore[no-untyped-def]
        sleep(seconds)  # (the arguments: the module's globals are gone by then)


class Collected:
    """Attached to the model: its finalizer says the model was collected."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __del__(self, open=open) -> None:  # type: ignore[no-untyped-def]
        with open(self.path, "w") as f:
            f.write("yes")


store = dist.TCPStore("127.0.0.1", PORT, 1, False, timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
torch.manual_seed(0)
model = flatshard.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
model.collected = Collected(OUT / "model-collected")  # type: ignore[assignment]
model(torch.randn(4, 8)).sum().backward()
assert watchdog() is not None  # its responder polls the store
slow = SlowTeardown()
(OUT / "ready").write_text("yes")
while not (OUT / "stopped").exists():
    time.sleep(0.05)
time.sleep(1.0)  # the responder's next poll has begun, and waits for the store
