"""Ranks that part ways, as a user's script makes them: ``python parting_script.py CASE OUT``
on every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun sets them).

Each rank writes ``OUT/rank<r>.json``: the flatshard error it raised (class, message, seconds
from the divergence to the error) or none. The timeout is 120 s, so an error within
seconds came from a proof, not from the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flatshard
from flatshard.testing.models import ReluLinear, ReluNet


def main(case: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    flatshard.set_checks(flatshard.Checks(timeout=120.0))
    torch.manual_seed(0)
    model = flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(micro_batches: int = 1) -> None:
        for index in range(micro_batches):
            with flatshard.no_sync(model) if index < micro_batches - 1 else _nothing():
                model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    result: dict[str, object] = {"error": "", "message": "", "seconds": 0.0}
    start = time.monotonic()
    try:
        if case == "save-on-rank-0-then-exit":
            if rank == 0:
                flatshard.save_checkpoint(out / "ckpt", model, optimizer)
        elif case == "save-on-rank-0-then-train":
            if rank == 0:
                flatshard.save_checkpoint(out / "ckpt", model, optimizer)
            step()
        elif case == "save-on-rank-1-after-rank-0-ended":
            if rank == 1:  # rank 0, the c10d store's host, ends meanwhile: the store with it
                time.sleep(1.0)
                flatshard.save_checkpoint(out / "ckpt", model, optimizer)
        elif case == "accumulation":
            step(micro_batches=2 + rank)
            step()
        elif case in ("raise", "kill", "return"):
            if rank == 1:
                if case == "raise":
                    raise ValueError("bad batch 7")
                if case == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                return _finish(out, rank, result)  # ends early: the normal way
            step()
        else:
            raise SystemExit(f"unknown case {case}")
    except flatshard.CollectiveError as error:
        result = {"error": type(error).__name__, "message": str(error)}
        result["seconds"] = time.monotonic() - start
    _finish(out, rank, result)


def _finish(out: Path, rank: int, result: dict[str, object]) -> None:
    """Write this rank's result; rank 0 (the c10d store's host) then waits for the others'
    results, so that its exit does not take the store from a rank still diagnosing."""
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end = time.monotonic() + 30
    others_diagnose = result["error"] == "CollectiveMismatchError"
    while rank == 0 and others_diagnose and time.monotonic() < end:
        if all((out / f"rank{r}.json").exists() for r in range(dist.get_world_size())):
            break
        time.sleep(0.1)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
