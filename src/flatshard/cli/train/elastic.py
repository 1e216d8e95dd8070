"""``flatshard train --max-restarts N``: the ranks under torch's elastic agent.

The agent (the one ``torchrun`` runs) starts ``--nproc`` ranks, and when one fails it
stops the others and starts them all again, up to N times; each restart resumes from the
newest whole checkpoint (``--resume auto``). flatshard adds no agent of its own.

[Note: restarts and the shared store]
By default the agent hands its rendezvous TCP store to the ranks, and every restart
reuses it; restarts then can fail with gloo's "connectFullMesh failed ... Connection
refused", or hang in ``init_process_group`` (docs/performance.md, "Restarts", has the
tries). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` the ranks make a fresh store on a
fresh port for every attempt. So the launcher sets it, and the torchrun recipe in
docs/cli.md does too.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def run_elastic(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Run ``flatshard.cli.main <argv>`` on ``nproc`` local ranks under the elastic agent;
    the exit code for the command."""
    os.environ[FRESH_STORE_ENV] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"flatshard-{uuid.uuid4()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port
        max_restarts=max_restarts,
        monitor_interval=0.2,  # seconds between looks at the ranks: a failure is seen fast
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "flatshard.cli.main", *argv)
    except ChildFailedError as error:
        print(
            f"flatshard train: {_first_failure(error)}; gave up after {max_restarts} restarts",
            file=sys.stderr,
        )
        return 1
    return 0


def _first_failure(error: ChildFailedError) -> str:
    """The rank that failed first, with its exit code or the signal that killed it."""
    rank, failure = min(error.failures.items(), key=lambda item: item[1].timestamp)
    code = failure.exitcode
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"
