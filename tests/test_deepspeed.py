"""DeepSpeed ZeRO-3 as a bench system (``flatshard bench --systems deepspeed``).

Its numerics are checked as every other system's: at 2 ranks, each rank its half of the
global batch, it trains as the unsharded GPT on the whole batch with the same AdamW (the
losses of the first steps and the weights after them), with and without micro-batches,
while holding half of the parameters on each rank (ZeRO stage 3). The bench puts it in the
same table, and refuses by name what would not compare like with like.

The jobs run in a pool of their own: DeepSpeed's process-wide state (its accelerator,
chosen at import from the environment, and its communication backend) stays out of the
suite's shared workers.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flatshard.cli.bench.zero3 import ZeRO3
from flatshard.cli.lm.optimizers import build_optimizers
from flatshard.cli.main import main
from flatshard.models import GPT, GPTBlock
from flatshard.testing.workers import WorkerContext, WorkerPool

SHAPE = (64, 32, 4, 2, 16)  # vocab, dim, heads, layers, seq_len
ROWS, STEPS = 8, 3  # the global batch

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[WorkerPool]:
    workers = WorkerPool(2)
    yield workers
    workers.close()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, SHAPE[0], (ROWS, SHAPE[-1] + 1), generator=gen) for _ in range(STEPS)]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The bench's AdamW, with an epsilon that keeps round-off in near-zero gradients
    from becoming whole updates (as in the parity suite)."""
    (optim,) = build_optimizers(model, {GPTBlock}, "adamw", 1e-4, 0.0)
    for group in optim.param_groups:
        group["eps"] = 1e-5
    return optim


def _reference(micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded GPT on the whole batch: each step's loss and the final weights."""
    torch.manual_seed(0)
    model = GPT(*SHAPE)
    optim = _adamw(model)
    losses = []
    for idx in _batches():
        total = torch.zeros(())
        for part in idx.chunk(micro_batches):
            logits = model(part[:, :-1]).flatten(0, 1)
            loss = nn.functional.cross_entropy(logits, part[:, 1:].flatten())
            (loss / micro_batches).backward()
            total += loss.detach() / micro_batches
        optim.step()
        optim.zero_grad()
        losses.append(total.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_zero3(ctx: WorkerContext, micro_batches: int) -> dict[str, Any]:
    """Each rank its rows of the batch, through the bench's engine; every rank's mean loss
    per step, the weights gathered whole, and the elements this rank holds."""
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(0)
    gpt = GPT(*SHAPE)
    total = sum(p.numel() for p in gpt.parameters())
    rows = ROWS // ctx.world_size
    engine = ZeRO3(gpt, rows, micro_batches, torch.device("cpu"), _adamw(gpt))
    losses = []
    for idx in _batches():
        loss = engine.step(idx[ctx.rank * rows : (ctx.rank + 1) * rows])
        dist.all_reduce(loss)
        losses.append(loss.item() / ctx.world_size)
    params = list(gpt.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        weights = {name: p.detach().clone() for name, p in params}
    return {"losses": losses, "weights": weights, "held": engine.local_numel(), "total": total}


@needs_deepspeed
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_zero3_trains_as_the_unsharded_model(two_ranks: WorkerPool, micro_batches: int) -> None:
    losses, weights = _reference(micro_batches)
    for result in two_ranks.run(_train_zero3, micro_batches):
        assert result["held"] * 2 == result["total"]  # stage 3: half the parameters each
        torch.testing.assert_close(result["losses"], losses, rtol=1e-5, atol=1e-6)
        assert result["weights"].keys() == weights.keys()
        for name, expected in weights.items():
            torch.testing.assert_close(result["weights"][name], expected, rtol=1e-5, atol=1e-6)


@needs_deepspeed
def test_bench_puts_deepspeed_in_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--systems", "flatshard,deepspeed,floor", "--out", str(tmp_path)]
    argv += ["--vocab", "64", "--dim", "32", "--heads", "4", "--layers", "2"]
    argv += ["--seq-len", "16", "--batch", "2", "--steps", "1", "--warmup", "0", "--rounds", "1"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert any(line.startswith("deepspeed ") for line in stdout.splitlines()), stdout
    row = json.loads((tmp_path / "bench.json").read_text())["systems"]["deepspeed"]
    assert row["median_step_s"] > 0 and row["peak_mem_mib"] > 0
    # ZeRO-3 gathers its parameters and reduce-scatters its gradients through torch.
    assert row["all_gather_bytes"] > 0 and row["sent_bytes"] > 0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--optimizer", "muon"], "--optimizer muon"),
        (["--grad-accum", "2"], "use --accum reduce"),
        (["--compile"], "--compile"),
    ],
)
def test_bench_refuses_what_deepspeed_would_run_unlike_the_others(
    options: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        named = "pip install deepspeed"  # refused first for that
    assert main(["bench", "--systems", "deepspeed,floor", *options]) == 2
    assert named in capsys.readouterr().err


def test_bench_names_the_install_when_deepspeed_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec

    def without_deepspeed(name: str, *more: Any) -> Any:
        return None if name == "deepspeed" else find_spec(name, *more)

    monkeypatch.setattr(importlib.util, "find_spec", without_deepspeed)
    assert main(["bench", "--systems", "flatshard,deepspeed"]) == 2
    assert "make extras EXTRAS=deepspeed" in capsys.readouterr().err
