"""Ranks that stop agreeing end with a flatshard error on every rank: no hang, no abort.

Each job runs in fresh processes (``run_isolated``): a fault leaves collectives in flight.
The timeout is 2 s (``flatshard.Checks``); every rank must end within timeout + 15 s.
Without the watchdog each of these hung until the group's timeout (60 s here, 30 min by
default) or aborted inside gloo.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.testing.isolated import Died, run_isolated
from flatshard.testing.models import ReluLinear, ReluNet, Trunk, VocabGPT

CHECKS = flatshard.Checks(timeout=2.0)
# A wait that can never complete ends at the timeout, or, where the watchdog's first look
# for a proof (at 2 s too) comes first and finds the ranks' collectives can never pair, as
# a proven mismatch: the same table and divergence either way, whichever a loaded machine
# lets come first.
HOPELESS = ("CollectiveTimeoutError", "CollectiveMismatchError")
LIMIT_S = 2.0 + 15.0


def _net(**options: Any) -> nn.Module:
    flatshard.set_checks(CHECKS)
    torch.manual_seed(0)
    return flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear}, **options)


def _step(model: nn.Module, backward: bool = True) -> None:
    loss = model(torch.randn(3, 4)).sum()
    if backward:
        loss.backward()


def _outcome(run: Any) -> tuple[str, str, float]:
    """(error class, message, seconds) of ``run()``; ("", "", s) if it ended normally."""
    start = time.monotonic()
    try:
        run()
    except flatshard.CollectiveError as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "", "", time.monotonic() - start


def _all_raised(outcomes: list[Any], error: str, *or_: str) -> list[str]:
    """Every rank's message, each rank having raised ``error`` (or one of ``or_``)."""
    messages = []
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, tuple), f"rank {rank}: {outcome}"
        name, message, seconds = outcome
        assert name in (error, *or_), f"rank {rank} ended with {name or 'no error'}: {message}"
        assert seconds < LIMIT_S, f"rank {rank} took {seconds:.1f} s"
        messages.append(message)
    return messages


def skip_backward_job(rank: int) -> tuple[str, str, float]:
    model = _net()

    def run() -> None:
        _step(model)
        _step(model, backward=rank == 0)  # rank 1 skips one backward
        _step(model)

    return _outcome(run)


def test_a_rank_that_skips_a_backward_is_reported_on_every_rank() -> None:
    for message in _all_raised(run_isolated(skip_backward_job), *HOPELESS):
        assert "What each rank of the group was doing" in message
        assert "rank 0: waiting" in message and "rank 1: waiting" in message
        assert "(step 1, backward)" in message  # rank 0, in the backward rank 1 skipped
        # rank 1 agrees first, out of band, before its next forward issues anything that
        # would pair with rank 0's backward ([Note: a backward one rank skipped])
        assert "rank 1: waiting" in message
        assert "the other ranks to reach forward after no backward at step 1" in message
        assert "Where the ranks diverged, at collective #" in message
        assert "Timeout in force: 2 s" in message and "FLATSHARD_TIMEOUT" in message


def clip_alone_job(rank: int) -> tuple[str, str, float]:
    model = _net()

    def run() -> None:
        _step(model)
        if rank == 1:
            flatshard.clip_grad_norm_(model, 1.0)
        _step(model)

    return _outcome(run)


def test_clip_on_one_rank_is_reported_on_every_rank() -> None:
    for message in _all_raised(run_isolated(clip_alone_job), *HOPELESS):
        assert "rank 1: waiting" in message
        assert "clip_grad_norm_(max_norm=1.0, norm_type=2.0) at step 1" in message
        assert "rank 0: waiting" in message and "(step 1, forward): all_gather" in message


def warned_first_job(rank: int) -> tuple[tuple[str, str, float], list[str]]:
    """Rank 1 computes for 8 s outside any collective (slow, not different: nothing proves
    the wait hopeless), with an early word after 1.5 s and the timeout at 5 s."""
    model = _net()
    flatshard.set_checks(flatshard.Checks(timeout=5.0, warn_after=1.5))

    def run() -> None:
        _step(model)
        if rank == 1:
            time.sleep(8.0)
        _step(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = _outcome(run)
    words = [str(w.message) for w in caught if w.category is flatshard.SlowCollectiveWarning]
    return outcome, words


def test_a_long_wait_prints_the_diagnosis_early_then_raises_at_the_timeout() -> None:
    """A waiting rank prints what the timeout would raise as a warning, once, and waits on;
    where nothing proves the wait hopeless (a peer computes), the error comes at the
    timeout, on the slow rank too as soon as it reaches a collective."""
    results = run_isolated(warned_first_job)
    (name, message, seconds), words = results[0]
    assert name == "CollectiveTimeoutError" and 5.0 <= seconds < 5.0 + 15.0, results[0]
    assert "Proven" not in message
    assert "rank 1: not in a flatshard collective" in message
    assert len(words) == 1, words
    word = words[0]
    assert re.search("flatshard: rank 0 has waited [0-9]+ s for", word), word
    assert "It waits on until the timeout (5 s), then raises on every rank." in word
    assert "rank 1: not in a flatshard collective" in word
    assert "rank 0: waiting" in word and "(step 1, forward): all_gather" in word
    assert "flatshard.Checks(warn_after=...)" in word
    (name, message, seconds), words = results[1]
    assert name == "CollectiveTimeoutError" and 8.0 <= seconds < 8.0 + 15.0, results[1]
    assert words == []


def switches_disagree_job(rank: int) -> tuple[str, str, float]:
    model = _net()
    return _outcome(lambda: flatshard.set_reshard_after_backward(model, rank == 1))


def test_ranks_that_set_a_switch_differently_are_told_before_anything_is_sent() -> None:
    """Before: the next micro-batch issued different collectives and gloo aborted a rank."""
    for message in _all_raised(run_isolated(switches_disagree_job), "CollectiveMismatchError"):
        assert "rank 0: set_reshard_after_backward(False)" in message
        assert "rank 1: set_reshard_after_backward(True)" in message


@pytest.mark.parametrize("call", ["summon_full_params", "full_state_dict", "save_checkpoint"])
def test_a_call_on_rank_0_only_never_reaches_gloo(call: str, tmp_path: Path) -> None:
    """Before: rank 0 died with SIGABRT inside gloo (mismatched sizes), or hung."""
    outcomes = run_isolated(rank0_only_job, call, str(tmp_path))
    for message in _all_raised(outcomes, *HOPELESS):
        assert "rank 0: waiting" in message and f"reach {call}" in message
        arguments = r"\(path='[^']*/step_1'[^)]*\)" if call == "save_checkpoint" else ""
        if call == "summon_full_params":
            arguments = r"\(writeback=True\)"
        assert re.search(rf"{call}{arguments} at step 1", message), message
        assert "rank 1: waiting" in message


def foreign_collective_job(rank: int, flatshard_side: str) -> tuple[str, str, float]:
    """Rank 0 enters summon_full_params (a store agreement) or a forward (flatshard's
    all-gathers) while rank 1 all-reduces a metric of its own; a timeout of 30 s, which
    the proof comes well before."""
    model = _net()
    flatshard.set_checks(flatshard.Checks(timeout=30.0))

    def run() -> None:
        _step(model)
        if rank == 1:
            dist.all_reduce(torch.ones(1))  # the program's own collective
        elif flatshard_side == "summon":
            with flatshard.summon_full_params(model):
                pass
        else:
            _step(model)

    try:
        return _outcome(run)
    except RuntimeError as error:  # rank 1: gloo's, once rank 0 has ended
        return type(error).__name__, str(error), 0.0


@pytest.mark.parametrize("flatshard_side", ["summon", "forward"])
def test_a_collective_of_the_programs_own_against_a_flatshard_call_is_proven(
    flatshard_side: str,
) -> None:
    """Before: rank 0 waited in the store for the other ranks to reach the summon (or in
    its forward's all-gather), and rank 1 in its all-reduce, each until the timeout (30
    minutes by default), with nothing proven. Now rank 1's status names the collective its
    program is blocked in, and rank 0 raises within the probe; rank 1's all-reduce then
    ends as rank 0 leaves."""
    first, second = run_isolated(foreign_collective_job, flatshard_side)
    assert isinstance(first, tuple) and isinstance(second, tuple), (first, second)
    name, message, seconds = first
    assert name == "CollectiveMismatchError", message
    assert "rank 1 waits in torch.distributed.all_reduce (called at test_hangs.py:" in message
    assert "a collective flatshard did not issue" in message and seconds < LIMIT_S, message
    assert second[0] == "RuntimeError", second  # gloo's: its peer is gone


class SlowToUnpickle:
    """An object whose unpickling takes seconds (as a vocabulary rebuilding its index)."""

    def __init__(self) -> None:
        self.index = {"rebuilt": "on unpickling"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        time.sleep(5.0)
        self.__dict__.update(state)


def slow_object_job(rank: int) -> tuple[str, str, float]:
    """Every rank broadcasts an object from rank 0, then trains on; rank 1 unpickles it for
    5 s inside broadcast_object_list while rank 0 is already in its next forward."""
    model = _net()
    flatshard.set_checks(flatshard.Checks(timeout=30.0))

    def run() -> None:
        _step(model)
        dist.broadcast_object_list([SlowToUnpickle() if rank == 0 else None], src=0)
        _step(model)

    return _outcome(run)


def test_a_rank_unpickling_what_it_received_is_not_blocked() -> None:
    """A correct program, alike on every rank: before, rank 0 raised CollectiveMismatchError
    ("rank 1 waits in torch.distributed.broadcast_object_list") about 3 s into its forward,
    while rank 1 had done its part of the broadcast and was unpickling."""
    for name, message, _ in run_isolated(slow_object_job):
        assert name == "", message


def rank0_only_job(rank: int, call: str, directory: str) -> tuple[str, str, float]:
    model = _net()

    def run() -> None:
        _step(model)
        if rank == 0:
            if call == "summon_full_params":
                with flatshard.summon_full_params(model):
                    pass
            elif call == "full_state_dict":
                flatshard.full_state_dict(model)
            else:
                flatshard.save_checkpoint(f"{directory}/step_1", model)
        _step(model)

    return _outcome(run)


def extra_step_job(rank: int, sparse: bool) -> tuple[str, str, float]:
    """Rank 1 got one batch more (uneven data); rank 0 then waits in its own barrier.
    ``sparse``: a GPT with row-sparse tables, whose all-to-alls are uneven by design (each
    rank sends what the others asked of it): not where the ranks diverged."""
    if sparse:
        flatshard.set_checks(CHECKS)
        torch.manual_seed(0)
        gpt = VocabGPT()
        model = flatshard.fully_shard(
            gpt, auto_wrap_policy=set(gpt.UNIT_CLASSES), placement=flatshard.RowSparse()
        )
    else:
        model = _net()
    gen = torch.Generator().manual_seed(rank)

    def run() -> None:
        for _ in range(3 if rank == 1 else 2):
            if sparse:
                model(torch.randint(0, 512, (2, 8), generator=gen)).sum().backward()
            else:
                _step(model)

    outcome = _outcome(run)
    if rank == 0:
        time.sleep(6)  # still alive (not in a flatshard collective) when rank 1 asks
    return outcome


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "row_sparse_tables"])
def test_a_rank_with_one_batch_more_is_told_the_others_ran_out(sparse: bool) -> None:
    done, (name, message, seconds) = run_isolated(extra_step_job, sparse)
    assert done[0] == "", done  # rank 0 finished its batches
    assert name == "CollectiveTimeoutError" and seconds < LIMIT_S, message
    assert "rank 0: not in a flatshard collective; its last: " in message
    assert re.search(r"diverged, at collective #\d+: rank 0 issued nothing \(yet\)", message)
    assert "Rank(s) 0 issued fewer collectives and wait for none" in message
    assert "ran out of batches" in message and "drop_last=True" in message


def dying_job(rank: int, how: str, world: int) -> tuple[str, str, float]:
    model = _net()

    def run() -> None:
        _step(model)
        if rank == world - 1:
            if how == "killed":
                os._exit(3)  # dies like an OOM kill, mid-training
            raise ValueError("a data error on the last rank")  # the process then ends
        _step(model)

    return _outcome(run)


@pytest.mark.parametrize(("how", "world"), [("killed", 2), ("raises", 2), ("killed", 3)])
def test_a_rank_that_dies_is_named_by_the_survivors(how: str, world: int) -> None:
    *survivors, dead = run_isolated(dying_job, how, world, world_size=world)
    assert dead == Died(3 if how == "killed" else 1)
    for rank, (name, message, seconds) in enumerate(survivors):
        assert name == "PeerLostError" and seconds < LIMIT_S, message
        assert "a peer left" in message, message  # seen by this rank, or by another
        assert f"rank {rank} waited for collective #" in message
        if how == "killed":
            assert f"rank {world - 1}: no answer and no exit record: killed by a signal" in message
        else:  # (before: the same as killed; multiprocessing caught what it raised)
            said = "ended by an exception, ValueError: a data error on the last rank"
            assert f"rank {world - 1} {said}" in message, message


def moe_unequal_job(rank: int) -> tuple[str, str, float]:
    """Experts are units; rank 0 routed tokens to 2 experts, rank 1 to 1 (counts differ)."""
    model = _net()

    def run() -> None:
        x = torch.randn(3, 8)
        chosen = [0, 2] if rank == 0 else [1]
        blocks: Any = model.blocks
        sum((blocks[i](x) for i in chosen), torch.zeros(3, 8)).sum().backward()

    return _outcome(run)


def test_experts_that_run_on_some_ranks_only_are_reported() -> None:
    for message in _all_raised(run_isolated(moe_unequal_job), *HOPELESS):
        assert "Where the ranks diverged, at collective #" in message
        assert "all_gather of unit 'blocks.0'" in message
        assert "all_gather of unit 'blocks.1'" in message
        assert "Run conditional units (e.g. experts that got no tokens) on every rank" in message


def test_debug_mode_reports_before_sending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLATSHARD_DEBUG", "1")
    for message in _all_raised(run_isolated(skip_backward_job), "CollectiveMismatchError"):
        assert "ranks are about to issue different collectives" in message
        assert "nothing was sent" in message
        assert "rank 0: collective #22 (step 1, backward): all_gather of unit 'blocks.1'" in message
        assert "rank 1: forward after no backward at step 1 (after collective #21)" in message


def test_the_timeout_comes_from_checks_the_environment_or_the_group(
    local_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert flatshard.Checks(timeout=3).timeout_s(local_group) == 3
    monkeypatch.setenv("FLATSHARD_TIMEOUT", "7")
    assert flatshard.Checks().timeout_s(local_group) == 7
    monkeypatch.delenv("FLATSHARD_TIMEOUT")
    assert flatshard.Checks().timeout_s(local_group) == 1800  # init_process_group's default
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        flatshard.Checks(timeout=0)
    with pytest.raises(TypeError, match=r"expected a flatshard\.Checks, got 5"):
        flatshard.set_checks(5)  # type: ignore[arg-type]


def unused_output_job(rank: int) -> tuple[str, str, float]:
    """Head c's output reaches the loss on rank 0 only, under FULL_SHARD: rank 0 re-gathers
    and reduces c mid-backward, rank 1 only reduces it at the end. The gathers and
    reductions interleave differently, so this hung before the watchdog (the equal-count
    case under SHARD_GRAD_OP is caught by the end-of-step check: test_ledger.py)."""
    flatshard.set_checks(CHECKS)
    torch.manual_seed(0)
    model = flatshard.fully_shard(Trunk(), auto_wrap_policy={nn.Linear})

    def run() -> None:
        b, c = model(torch.randn(4, 8))
        (b.sum() + (c.sum() if rank == 0 else 0)).backward()

    return _outcome(run)


def test_an_output_that_reaches_the_loss_on_one_rank_only_is_reported() -> None:
    for message in _all_raised(run_isolated(unused_output_job), *HOPELESS):
        assert "Where the ranks diverged, at collective #" in message
        assert "unit 'c'" in message
