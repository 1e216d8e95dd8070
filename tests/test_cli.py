"""``flatshard train`` end to end, and its one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.cli.main import main


def test_train_runs_at_two_ranks_and_loss_falls() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flatshard.cli.main", "train", "--nproc", "2", "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss (\d+\.\d+)", result.stdout, re.M)]
    assert len(losses) == 12, result.stdout
    assert losses[-1] < losses[0] - 0.3, losses
    assert "2 ranks (gloo)" in result.stdout


def test_train_shows_the_dtype_plan_with_mixed_precision() -> None:
    argv = ["train", "--nproc", "2", "--steps", "2", "--dim", "16", "--layers", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "flatshard.cli.main", *argv, "--mixed-precision", "bf16"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "dtype plan" in result.stdout
    plan = result.stdout.split("dtype plan", 1)[1]
    assert "bfloat16" in plan and "float32" in plan
    assert "step    2" in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--dim", "10", "--heads", "3"], "--dim (10) must be a multiple of --heads (3)"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--mixed-precision", "fp8"], "--mixed-precision must be one of none, bf16, fp16"),
    ],
)
def test_bad_options_give_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flatshard train: error: {message}" or err.startswith(
        f"flatshard train: error: {message}"
    )
    assert "\n" not in err


def test_bench_compares_all_systems(tmp_path: Path) -> None:
    argv = ["bench", "--dim", "16", "--layers", "1", "--vocab", "32", "--seq-len", "8"]
    argv += ["--batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "flatshard.cli.main", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert list(report["systems"]) == ["flatshard", "fsdp2", "ddp", "floor"]
    for system, row in report["systems"].items():
        assert row["median_step_s"] > 0 and row["peak_rss_mib"] > 0, system
        assert row["time_vs_floor"] > 0
    assert report["systems"]["floor"]["collective_output_bytes"] == 0  # no communication at all
    assert report["systems"]["flatshard"]["collective_output_bytes"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vs fsdp2" in result.stdout and "flatshard" in result.stdout


def test_bench_rejects_unknown_systems(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--systems", "flatshard,zero3"]) == 2
    assert "--systems must be a comma-separated subset" in capsys.readouterr().err


def _small_checkpoint(path: Path) -> None:
    import torch

    import flatshard
    from flatshard.testing.models import build
    from flatshard.testing.parity import make_optimizer

    model = build("gpt")
    optim = make_optimizer(model, 1e-2)
    model.loss(model.make_batch(torch.Generator().manual_seed(0), 4)).backward()
    optim.step()
    flatshard.save_checkpoint(path, model, optim, extra={"step": 1})


def test_ckpt_inspect_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    _small_checkpoint(ckpt)
    assert main(["ckpt", "inspect", str(ckpt), "--tensors"]) == 0
    shown = capsys.readouterr().out
    assert "41 tensors, 11,299 elements" in shown
    assert "state exp_avg, exp_avg_sq, step; 2 parameter group(s)" in shown
    assert "extra       (rank 0) step=1" in shown
    assert re.search(r"blocks\.0\.attn\.qkv\.weight\s+float32\s+\(48, 16\)", shown)
    assert main(["ckpt", "export", str(ckpt), str(out), "--max-shard-size", "20kB"]) == 0
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    assert (out / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ckpt", "inspect", "{tmp}/missing"], "no checkpoint at"),
        (["ckpt", "export", "{ckpt}", "{tmp}/o", "--max-shard-size", "5XB"], "--max-shard-size"),
        (["ckpt", "export", "{ckpt}", "{tmp}/o", "--dtype", "int3"], "--dtype must be"),
    ],
)
def test_ckpt_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    ckpt = tmp_path / "ckpt"
    _small_checkpoint(ckpt)
    args = [a.format(tmp=tmp_path, ckpt=ckpt) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
