"""Run a function on two local gloo ranks and return what rank 0 put in its queue.

Shared by the small collective benchmarks here (``group_queueing.py``,
``agreement_cost.py``): ``run(rank, world, init_method, results)`` joins the group at
``init_method`` and puts its result in ``results`` (rank 0 only).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def on_two_ranks(run: Callable[[int, int, str, Any], None]) -> Any:
    return on_ranks(run, 2)


def on_ranks(run: Callable[[int, int, str, Any], None], world: int) -> Any:
    """``run`` on ``world`` local gloo ranks; what rank 0 put in its queue."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address = f"tcp://127.0.0.1:{port}"
    procs = [ctx.Process(target=run, args=(r, world, address, results)) for r in range(world)]
    for p in procs:
        p.start()
    result = results.get()
    for p in procs:
        p.join()
    return result
