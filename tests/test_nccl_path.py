"""What the NCCL path does differently from gloo, checked on CPU by its structure.

On NCCL ``work.wait()`` only makes the current stream wait and the host runs ahead; on
gloo it blocks the host. No GPU runs in CI, so these tests record where flatshard waits,
which stream it issues from, and how often it reads device values on the host, with the
accelerator-only branches forced onto the CPU path where the branch is a device test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing.internals import RateLimiter, context_of, units_of
from flatshard.testing.internals import comm_agreement as ledger
from flatshard.testing.internals import comm_collectives as collectives
from flatshard.testing.models import ReluLinear, build
from flatshard.testing.parity import batches, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

# ---------------------------------------------------------------- item 1: hybrid overlap


def hybrid_waits_job(ctx: WorkerContext) -> dict[str, int] | None:
    """A backward under HYBRID_SHARD (F = 2 at 4 ranks), with every ``wait_work`` recorded
    as inside or outside the chained (side) stream."""
    group = ctx.group(4)
    if group is None:
        return None
    model: Any = build("gpt")
    model = flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        strategy="HYBRID_SHARD",
        sharding_factor=2,
        process_group=group,
    )
    batch = slice_batch(next(batches(model, 1)), ctx.rank, 4)
    model.loss(batch).backward()  # warm-up: the same waits every step
    inside = [False]
    waits: Counter[str] = Counter()
    real_wait, real_chain = collectives.wait_work, collectives.chain_stream

    @contextlib.contextmanager
    def chain(device: torch.device) -> Iterator[None]:
        inside[0] = True
        try:
            with real_chain(device):
                yield
        finally:
            inside[0] = False

    def wait(work: Any) -> None:
        waits["chained" if inside[0] else "compute stream"] += 1
        real_wait(work)

    with (
        mock.patch.object(collectives, "wait_work", wait),
        mock.patch.object(collectives, "chain_stream", chain),
    ):
        model.loss(batch).backward()
    reductions = sum(len(unit.trainable) for unit in units_of(model, "test"))
    return {**waits, "reductions": reductions}


def test_hybrid_reduce_scatters_are_waited_for_off_the_compute_stream(pool: WorkerPool) -> None:
    """Each reduce-scatter is waited for on the chained stream, which then issues the
    all-reduce across replicas: the compute stream waits for neither in the unit's
    post-backward (it used to wait for every reduce-scatter there)."""
    for waits in pool.run(hybrid_waits_job)[:4]:
        assert waits["chained"] == waits["reductions"] > 0, waits


# ---------------------------------------------------------------- item 3: the digest


class Experts(nn.Module):
    """Four experts, each a unit; the caller says which run (as in test_ledger.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(ReluLinear() for _ in range(4))

    def forward(self, x: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        return sum((self.experts[i](x) for i in chosen), torch.zeros_like(x))


def deferred_mismatch_job(ctx: WorkerContext, then: str) -> tuple[str, str] | None:
    """The accelerators' digest path (compared before the next step) on gloo: step 1 runs
    other experts on each rank; the error must come before anything else is issued
    (``then``: the next forward, or a full state dict between steps)."""
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    model = flatshard.fully_shard(Experts(), auto_wrap_policy={ReluLinear}, process_group=group)
    x = torch.randn(4, 8)
    with mock.patch.object(ledger, "defers_digest", lambda device: True):
        chosen = [0, 2] if ctx.rank == 0 else [1, 3]
        model(x, chosen).sum().backward()  # mismatched: no error yet
        first = "no error at the end of step 1"
        try:
            if then == "backward":
                model(x, [0, 1, 2, 3]).sum().backward()
            else:
                flatshard.full_state_dict(model)
        except flatshard.CollectiveMismatchError as error:
            return first, str(error)
    return first, "no error"


@pytest.mark.parametrize("then", ["backward", "full_state_dict"])
def test_a_deferred_digest_reports_at_the_next_check(pool: WorkerPool, then: str) -> None:
    for first, message in pool.run(deferred_mismatch_job, then)[:2]:
        assert first == "no error at the end of step 1"
        assert (
            "ranks issued different collectives in one backward pass (found before the next "
            "step" in message
        ), message
        assert "all_gather of unit 'experts.0'" in message


def test_the_digest_is_deferred_on_accelerators_only() -> None:
    assert ledger.defers_digest(torch.device("cuda", 0))
    assert not ledger.defers_digest(torch.device("cpu"))


# ---------------------------------------------------------------- the sync audit

# Reading a device value on the host waits for the device: the calls that do so.
SYNC_POINTS: list[tuple[Any, str]] = [
    (torch.Tensor, "item"),
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"),
    (torch.accelerator, "synchronize"),
    (torch, "Event"),  # flatshard makes events only to wait for them
]


def _flatshard_caller() -> str | None:
    """The function two frames up if it is flatshard's (not a test's, not torch's)."""
    code = sys._getframe(2).f_code
    path = code.co_filename
    return code.co_name if "/flatshard/" in path and "/flatshard/testing/" not in path else None


def sync_audit_job(ctx: WorkerContext, option: str) -> dict[str, int] | None:
    """Host syncs flatshard makes in two steady-state steps at 2 ranks, with the
    accelerators' digest path (the CPU path compares at once: gloo blocks anyway)."""
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    extra: dict[str, Any] = {}
    if option == "offload":
        extra["cpu_offload"] = flatshard.CPUOffload()
    model = flatshard.fully_shard(
        model, auto_wrap_policy=set(model.UNIT_CLASSES), process_group=group, **extra
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts: Counter[str] = Counter()
    waits = [0]
    real_wait_copies = type(context_of(model)).wait_host_copies

    def step(batch: Any) -> None:
        model.loss(slice_batch(batch, ctx.rank, 2)).backward()
        if option == "clip":
            flatshard.clip_grad_norm_(model, 1.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()

    def counted(owner: Any, name: str) -> Any:
        real = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            caller = _flatshard_caller()
            if caller is not None:
                counts[f"{getattr(owner, '__name__', owner)}.{name} in {caller}"] += 1
            return real(*args, **kwargs)

        return call

    with mock.patch.object(ledger, "defers_digest", lambda device: True):
        steps = list(batches(model, 4))
        for batch in steps[:2]:  # warm-up
            step(batch)
        with contextlib.ExitStack() as patches:
            for owner, name in SYNC_POINTS:
                patches.enter_context(mock.patch.object(owner, name, counted(owner, name)))

            def wait_copies(self: Any) -> None:
                waits[0] += 1
                real_wait_copies(self)

            patches.enter_context(
                mock.patch.object(type(context_of(model)), "wait_host_copies", wait_copies)
            )
            for batch in steps[2:]:
                step(batch)
        flatshard.full_state_dict(model)  # settles the last step's digests
    return {**counts, "wait_host_copies": waits[0]}


@pytest.mark.parametrize("option", ["defaults", "clip", "offload"])
def test_no_host_sync_in_a_steady_step(pool: WorkerPool, option: str) -> None:
    """No host read of a device value in a steady-state step (the digest's comparison
    reads a buffer whose event completed, at the next check). CPU offload waits once per
    step for its copies, on accelerators (``wait_host_copies``: an event on the compute
    stream; not a sync on a CPU run). ``torch.amp.GradScaler`` (fp16) reads its found-inf
    flag in ``step`` on the host: one sync per step, torch's own."""
    for counts in pool.run(sync_audit_job, option)[:2]:
        # The last step's digests are read in ``settle``, once per step: from the pinned
        # host copy whose event completed (on an accelerator: no wait for the device).
        host_only = {"Tensor.__bool__ in settle": 2, "wait_host_copies": counts["wait_host_copies"]}
        syncs = {k: v for k, v in counts.items() if host_only.get(k) != v}
        assert syncs == {}, syncs
        assert counts["wait_host_copies"] == 2  # once per step: at the end of backward


# ---------------------------------------------------------------- items 6 and 7


def test_the_rate_limiter_never_waits_for_the_device() -> None:
    """It bounds what the host keeps gathered ahead, and records no event (see [Note: no
    host sync in the rate limiter])."""
    limiter = RateLimiter(2)
    with mock.patch.object(torch, "Event", side_effect=AssertionError("an event")):
        limiter.resharded()
        limiter.before_prefetch()
    assert limiter.frees == 1


def test_collective_calls_run_on_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch puts on "the current device" (object collectives and barriers on NCCL)
    goes to the unit's device, not to cuda:0 on every rank."""
    entered: list[int] = []

    @contextlib.contextmanager
    def device_index(index: int) -> Iterator[None]:
        entered.append(index)
        yield

    monkeypatch.setattr(torch.accelerator, "device_index", device_index)
    with collectives.on_device(torch.device("cuda", 3)):
        pass
    with collectives.on_device(torch.device("cpu")), collectives.on_device(None):
        pass
    assert entered == [3]


# ---------------------------------------------------------------- item 9: the GPU check

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "gpu_check: no NVIDIA GPU here" in result.stderr


@pytest.mark.parametrize("stage", ["smoke", "audit"])
def test_the_gpu_check_stages_rehearse_on_gloo(tmp_path: Path, stage: str) -> None:
    """The stages run on CPUs with gloo too (``--device cpu``), so the script a lent GPU
    runs once is known to work up to what only a GPU can show."""
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            stage,
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (tmp_path / f"{stage}.txt").read_text().splitlines()
    assert lines and all(line.startswith("ok ") for line in lines), lines
