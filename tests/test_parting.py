"""Ranks that part ways fail within seconds, saying how: a call made on some ranks only, a
divergence already proven, a peer that ended normally, raised, or was killed.

Each case runs ``parting_script.py`` as two processes started the way torchrun starts them
(``run_ranks``), with a 120-s timeout: an error within ``PROVEN_S`` came from a proof
(``flatshard``'s [Note: a proven divergence]), not from the timeout. Before, each of these
waited for the process group's timeout (30 minutes by default) and printed two c10d socket
lines a second meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import flatshard
from flatshard.testing.isolated import run_isolated
from flatshard.testing.models import ReluLinear, ReluNet
from flatshard.testing.scripts import run_ranks

SCRIPT = Path(__file__).with_name("parting_script.py")
PROVEN_S = 30.0


def _run(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's result (its error and how long it took), after checking the output has
    no flood of torch's c10d socket lines."""
    outcomes = run_ranks(SCRIPT, case, str(tmp_path), cwd=tmp_path)
    for rank, (_, output) in enumerate(outcomes):
        flood = [line for line in output.splitlines() if "waitForInput" in line]
        assert not flood, f"rank {rank} printed {len(flood)} c10d lines:\n{output[-3000:]}"
    results = []
    for rank, (status, output) in enumerate(outcomes):
        found = tmp_path / f"rank{rank}.json"
        ended = {"status": status, "output": output[-3000:]}  # what it said, for the report
        results.append(json.loads(found.read_text()) if found.exists() else ended)
    return results


def _raised_fast(result: dict[str, Any], error: str) -> str:
    assert result.get("error") == error, result
    assert result["seconds"] < PROVEN_S, result
    return str(result["message"])


def test_a_save_on_rank_0_only_is_named_when_the_others_have_ended(tmp_path: Path) -> None:
    """The DDP habit ``if rank == 0: save_checkpoint(...)``, rank 1 done and gone."""
    rank0, rank1 = _run("save-on-rank-0-then-exit", tmp_path)
    message = _raised_fast(rank0, "PeerLostError")
    assert "rank 1: ended normally" in message
    assert "save_checkpoint was called on rank 0 only (at parting_script.py:" in message
    assert "must be called on every rank" in message
    assert rank1["error"] == ""


def test_a_call_after_the_store_host_ended_is_named(tmp_path: Path) -> None:
    """Rank 0 (the c10d store's host, as under torchrun's default) has ended when rank 1
    calls save_checkpoint. Before: torch's bare DistNetworkError ("Connection reset by
    peer") from the store, raised through the agreement's first look."""
    rank0, rank1 = _run("save-on-rank-1-after-rank-0-ended", tmp_path)
    assert rank0["error"] == "", rank0
    message = _raised_fast(rank1, "PeerLostError")
    assert "rank 1 waited for the other ranks to reach save_checkpoint" in message, message
    assert "the c10d store did not answer either" in message, message


def test_a_save_on_rank_0_only_is_named_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 trains on, into its next forward: each rank waits for the other."""
    for result in _run("save-on-rank-0-then-train", tmp_path):
        message = _raised_fast(result, "CollectiveMismatchError")
        assert "Proven: rank 0 waits for the other ranks to call save_checkpoint" in message
        assert "rank 1 waits in collective #" in message
        assert "save_checkpoint was called on rank 0 only" in message


def test_different_accumulation_counts_are_named_on_every_rank(tmp_path: Path) -> None:
    for result in _run("accumulation", tmp_path):
        message = _raised_fast(result, "CollectiveMismatchError")
        assert "no_sync was called on rank 1 only" in message
        assert "run as many micro-batches on every rank" in message


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("return", "rank 1: ended normally (its program returned or called sys.exit)"),
        ("raise", "rank 1: ended by an exception, ValueError: bad batch 7"),
        ("kill", "rank 1: no answer and no exit record: killed by a signal (SIGKILL"),
    ],
)
def test_how_a_peer_ended_is_told_apart(case: str, said: str, tmp_path: Path) -> None:
    rank0, rank1 = _run(case, tmp_path)
    message = _raised_fast(rank0, "PeerLostError")
    assert said in message
    assert ("Proven:" in message) == (case != "kill")  # a killed process leaves no record
    expected = {"return": {"error": "", "message": "", "seconds": 0.0}, "raise": {"status": 1}}
    rank1.pop("output", None)  # a rank that wrote no result: its output's tail
    assert rank1 == expected.get(case, {"status": -9})


def _raises_into_its_launcher(rank: int) -> str:
    """Rank 1 raises at its second step, out of its function: the launcher
    (multiprocessing, as torch.multiprocessing.spawn) catches it. Rank 0's error."""
    torch.manual_seed(0)
    model = flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear})
    for step in range(3):
        if step == 1 and rank == 1:
            raise ValueError("bad batch on rank 1")
        try:
            model(torch.randn(3, 4)).sum().backward()
        except flatshard.PeerLostError as error:
            return str(error)
    return "no error"


def test_a_peer_whose_launcher_caught_its_exception_is_not_said_to_have_ended_normally() -> None:
    """multiprocessing (and torch.multiprocessing.spawn) catch what the rank's function
    raised: no exception reaches the interpreter, and a process forked from a server ends
    without the interpreter's exit. Before: "rank 1: no answer and no exit record: killed
    by a signal" here; under torch's spawn, "rank 1 ended normally"."""
    message = run_isolated(_raises_into_its_launcher)[0]
    assert "Proven: rank 1 ended by an exception, ValueError: bad batch on rank 1" in message
