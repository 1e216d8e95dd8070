"""``flatshard train`` end to end, and its one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import flatshard
from flatshard.cli.main import main
from in_process import run_command, train

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4"]


def _train(*argv: str, launcher: list[str] | None = None) -> str:
    if launcher is None:
        return train(*argv)  # in this process: see tests/in_process.py
    result = subprocess.run(
        [*launcher, "train", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {(row := json.loads(line))["step"]: row["loss"] for line in lines}


def test_train_end_to_end_then_resume_exactly(tmp_path: Path) -> None:
    """16 steps with checkpoints at 8 and 16; a second run resumed from step 8 logs the
    same losses for steps 9-16 as the first (same data, optimizer moments, RNG). With
    CPU offload (on a CPU it copies as on a GPU: the optimizer's state is the host's) and
    row-sparse embedding tables (resumed exactly too: the checkpoint holds dense rows).
    The first run is planned first (--predict): the plan's peak is the run's."""
    common = [*TINY, "--steps", "16", "--lr", "1e-2", "--warmup-steps", "2"]
    common += ["--grad-accum", "2", "--keep-ckpts", "5", "--keep-gathered", "1", "--cpu-offload"]
    common += ["--row-sparse-tables", "--log-to", "tensorboard"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    out = _train(
        *common, "--ckpt-every", "8", "--sample-bytes", "40", "--out-dir", str(whole), "--predict"
    )
    memory = re.search(r"predicted ([\d.]+) MiB, measured ([\d.]+) MiB \(([\d.]+)x\)", out)
    assert memory is not None, out
    assert 0.9 <= float(memory.group(3)) <= 1.1, out  # (equal here, to 0.1 MiB)
    assert re.search(r"median step: predicted [\d.]+ s, measured [\d.]+ s", out), out
    losses = _losses(whole)
    assert sorted(losses) == list(range(1, 17))
    assert losses[16] < losses[1] - 1.0, losses  # from ~ln(256) = 5.5 towards the text
    assert (
        "2 ranks (gloo, FULL_SHARD, last 1 unit kept gathered, CPU offload, row-sparse embeddings)"
        in out
    )
    assert "unigram entropy 3.016" in out
    assert re.search(r"step 16/16 \[=+\] loss \d+\.\d+ \| [\d,]+ tok/s", out), out
    # which rank each peak is, and where and when each checkpoint went
    assert re.search(r"\| peak RSS MiB r0:\d+ r1:\d+ \|", out), out
    for step in (8, 16):
        assert f"checkpoint of step {step}: {whole / 'checkpoints'}/step_{step:06d} (saved)" in out
    assert "sample:\nAnd God said" in out
    assert (whole / "loss.png").stat().st_size > 0
    checkpoints = whole / "checkpoints"
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step_000008", "step_000016"]

    ckpt = checkpoints / "step_000008"
    out = _train(*common, "--sample-bytes", "0", "--resume", str(ckpt), "--out-dir", str(resumed))
    assert f"resumed from {ckpt} at step 8" in out
    again = _losses(resumed)
    assert sorted(again) == list(range(9, 17))
    for step, loss in again.items():
        assert loss == pytest.approx(losses[step], rel=1e-6), (step, losses, again)
    # Resumed into the first run's directory: metrics.jsonl and the TensorBoard events
    # hold each step once, the resumed run's values for steps 9-16.
    out = _train(*common, "--sample-bytes", "0", "--resume", str(ckpt), "--out-dir", str(whole))
    assert f"TensorBoard: tensorboard --logdir {whole / 'tensorboard'}" in out
    _tensorboard_matches_the_metrics(whole)


def _tensorboard_matches_the_metrics(out_dir: Path) -> None:
    """--log-to tensorboard: the event files, read back, hold metrics.jsonl's fields, one
    event per step (float32 there), and the held-out loss at the last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 17))
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if not isinstance(value, list):
                expected.setdefault(name, []).append((row["step"], value))
                continue
            for rank, v in enumerate(value):
                expected.setdefault(f"{name}/r{rank}", []).append((row["step"], v))
    del expected["step"]
    assert set(events.Tags()["scalars"]) == {*expected, "held_out_loss"}
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, value), (_, want) in zip(got, points, strict=True):
            assert value == pytest.approx(want, rel=1e-6), tag
    assert [e.step for e in events.Scalars("held_out_loss")] == [16]


def test_train_a_mixture_of_experts_expert_parallel(tmp_path: Path) -> None:
    """--experts 4 --ep 2: the same losses as the experts data parallel (each rank its own
    batch either way), and a checkpoint saved expert parallel resumes data parallel."""
    common = [*TINY, "--steps", "4", "--lr", "1e-2", "--experts", "4", "--sample-bytes", "0"]
    split, plain, resumed = tmp_path / "split", tmp_path / "plain", tmp_path / "resumed"
    out = _train(*common, "--ep", "2", "--ckpt-every", "2", "--out-dir", str(split))
    assert "MLPs of 4 experts" in out and "experts split over 2 ranks" in out, out
    _train(*common, "--out-dir", str(plain))
    losses = _losses(split)
    assert losses == pytest.approx(_losses(plain), rel=1e-5)
    ckpt = split / "checkpoints" / "step_000002"
    _train(*common, "--resume", str(ckpt), "--out-dir", str(resumed))
    for step, loss in _losses(resumed).items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step


def test_train_refuses_experts_it_cannot_split(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["--experts", "4", "--ep", "3"], "--ep (3) must divide --experts (4)"),
        (["--experts", "4", "--predict"], "cannot plan --experts"),
        (["--experts", "4", "--model", "hf:gpt2"], "--experts only applies to --model gpt"),
    ]:
        assert main(["train", *argv]) == 2
        assert message in capsys.readouterr().err, argv


def test_train_a_hugging_face_model_under_torchrun_in_bf16(tmp_path: Path) -> None:
    """One run for four things: torchrun's environment, a transformers model with its
    block class as the unit, mixed precision's dtype plan, and --fit-memory (each rank
    plans alone and all must choose alike)."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
        )
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m"]
    launcher += ["flatshard.cli.main"]
    argv = ["--model", f"hf:{config}", "--seq-len", "32", "--batch", "4", "--steps", "3"]
    argv += ["--mixed-precision", "bf16", "--sample-bytes", "8", "--out-dir", str(tmp_path)]
    out = _train(*argv, "--fit-memory", "1GiB", launcher=launcher)
    kept = r"(?:, sublayer units)?(?:, last \d+ units? kept gathered)?"
    chosen = re.search(rf"--fit-memory 1GiB: (\w+{kept})(, activation checkpointing)? \(pred", out)
    assert chosen is not None, out
    assert f"2 ranks (gloo, {chosen.group(1)})" in out
    assert "GPT2LMHeadModel" in out and "(units: GPT2Block)" in out
    assert "transformer.h.1" in out  # each block is a unit
    plan = out.split("dtype plan", 1)[1]
    assert "bfloat16" in plan and "float32" in plan
    assert sorted(_losses(tmp_path)) == [1, 2, 3]


def test_config_file_and_flags(tmp_path: Path) -> None:
    from flatshard.cli.config import config_from_args
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.main import build_parser

    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlr = 1\nstrategy = "SHARD_GRAD_OP"\nseq-len = 64\n')
    args = build_parser().parse_args(["train", "--config", str(toml), "--steps", "9"])
    config = config_from_args(TrainConfig, args)
    assert (config.steps, config.lr, config.strategy, config.seq_len) == (
        9,
        1.0,
        "SHARD_GRAD_OP",
        64,
    )


def test_train_with_muon_shards_whole_parameters_and_resumes_exactly(tmp_path: Path) -> None:
    """--optimizer muon: Muon on the blocks' matrices, AdamW on the rest, every parameter
    whole on one rank; a resume from step 4 logs the first run's losses for steps 5-8
    (Muon's momentum and AdamW's moments restored from one checkpoint). With int8 gathers
    (whole parameters quantized row by row, as cut ones; the checkpoint holds the master
    weights)."""
    common = [*TINY, "--steps", "8", "--optimizer", "MUON", "--sample-bytes", "0"]
    common += ["--gather-dtype", "int8"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    out = _train(*common, "--ckpt-every", "4", "--out-dir", str(whole))
    banner = "2 ranks (gloo, FULL_SHARD, int8 gathers with row scales, Muon + AdamW, whole "
    assert banner in out, out
    assert re.search(r"blocks\.0 \[[^]]*\] +\d+ +float32 +int8\+scales +float32", out), out
    losses = _losses(whole)
    assert losses[8] < losses[1], losses
    ckpt = whole / "checkpoints" / "step_000004"
    _train(*common, "--resume", str(ckpt), "--out-dir", str(resumed))
    again = _losses(resumed)
    assert sorted(again) == list(range(5, 9))
    for step, loss in again.items():
        assert loss == pytest.approx(losses[step], rel=1e-6), (step, losses, again)


def test_hybrid_accumulation_reduces_across_hosts_once_per_step(tmp_path: Path) -> None:
    """--no-accum-no-sync under HYBRID_SHARD (4 ranks, F = 2): each micro-batch
    reduce-scatters inside its host, the all-reduce across hosts runs once per step; the
    losses are no_sync's (the same gradients, summed in another order)."""
    common = [*TINY, "--steps", "4", "--nproc", "4", "--strategy", "HYBRID_SHARD"]
    common += ["--sharding-factor", "2", "--grad-accum", "2", "--sample-bytes", "0"]
    quiet, each = tmp_path / "quiet", tmp_path / "each"
    out = _train(*common, "--out-dir", str(quiet))
    assert "micro-batch 1: no reduction (flatshard.no_sync" in out, out
    out = _train(*common, "--no-accum-no-sync", "--out-dir", str(each))
    assert "micro-batch 1: a reduce-scatter per unit inside each host, nothing across" in out
    a, b = _losses(quiet), _losses(each)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (a, b)


BAD_TOML = {
    "unknown": "stepz = 3",
    "type": 'steps = "many"',
    "syntax": "steps = = 3",
    "renamed": "sparse_embeddings = true",
}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--dim", "10", "--heads", "3"], "--dim (10) must be a multiple of --heads (3)"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--mixed-precision", "fp8"], "--mixed-precision must be one of none, bf16, fp16"),
        (["--gather-dtype", "int4"], "--gather-dtype must be one of none, int8, fp8, fp8-e5m2"),
        (["--strategy", "ZERO4"], "--strategy must be one of FULL_SHARD"),
        (
            ["--strategy", "full_shrd"],
            "--strategy must be one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
            "HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPTIM (any case) or another library's name for "
            "one, got 'full_shrd' (did you mean FULL_SHARD?)",
        ),
        (["--strategy", "zero1"], "--strategy 'zero1': ZeRO-1 (only the optimizer state"),
        (["--model", "hf:./no/such/dir"], "--model hf:./no/such/dir: no such directory: "),
        (["--strategy", "HYBRID_SHARD", "--sharding-factor", "3"], "--sharding-factor (3) must"),
        (["--sharding-factor", "2"], "--sharding-factor only applies to hybrid strategies"),
        (
            ["--strategy", "SHARD_GRAD_OP", "--keep-gathered", "1"],
            "--keep-gathered applies to FULL_SHARD and HYBRID_SHARD, not SHARD_GRAD_OP",
        ),
        (
            ["--layers", "2", "--keep-gathered", "3"],
            "--keep-gathered (3) exceeds the 2 units of the GPT (--layers 2, --units blocks)",
        ),
        (["--data", "/no/such/corpus.txt"], "--data: no text file at /no/such/corpus.txt"),
        (["--seq-len", "100000"], "--data: kjv_genesis_exodus.txt (shipped, public domain) has"),
        (["--model", "llama"], "--model must be 'gpt' or 'hf:<config>'"),
        (["--device", "tpu"], "--device must be one of auto, cpu, cuda, got 'tpu'"),
        (["--optimizer", "sgd"], "--optimizer must be one of adamw, muon, adafactor, got 'sgd'"),
        (["--model", "hf:no-such-model-type"], "--model hf:no-such-model-type:"),
        (["--hf-overrides", "n_layer=2"], "--hf-overrides only applies to --model hf:"),
        (  # before: accepted, and a 12-layer GPT-2 trained (transformers keeps any key)
            ["--model", "hf:gpt2", "--hf-overrides", "n_embd=32,n_head=2,n_layerz=2"],
            "--model hf:gpt2: --hf-overrides: GPT2Config has no setting 'n_layerz'; did you "
            "mean 'n_layer'?",
        ),
        (  # before: each rank's traceback (huggingface_hub's errors are not ValueErrors)
            ["--model", "hf:gpt2", "--hf-overrides", "n_embd=thirty"],
            "--model hf:gpt2: Validation error for field 'n_embd': TypeError: Field 'n_embd' "
            "expected int, got str",
        ),
        (  # before: each rank's traceback, where the model was built
            ["--model", "hf:gpt2", "--hf-overrides", "n_embd=32,n_layer=2"],
            "--model hf:gpt2: `embed_dim` must be divisible by num_heads",
        ),
        (["--init", "pretrained"], "--init pretrained needs --model hf:<directory with"),
        (["--lora", "r=8,targets=q_proj"], "--lora only applies to --model hf:"),
        (["--model", "hf:llama", "--lora", "r=8"], "--lora: name the modules to adapt"),
        (["--model", "hf:llama", "--lora", "rank=8,targets=q"], "--lora: expected r=, alpha="),
        (["--model", "hf:llama", "--lora", "r=0,targets=q"], "--lora: needs r >= 1, alpha > 0"),
        (["--init", "zeros"], "--init must be one of random, pretrained, got 'zeros'"),
        (["--fit-memory", "lots"], "--fit-memory: expected a number and a unit (TiB, TB, GiB"),
        (
            ["--model", "hf:llama", "--lora", "r=8,targets=q_proj", "--fit-memory", "1GiB"],
            "--fit-memory does not plan LoRA adapters yet; choose the setup by hand",
        ),
        (["--max-restarts", "2", "--resume", "latest"], "--max-restarts resumes with --resume"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (["--config", "{tmp}/unknown.toml"], "--config: unknown option 'stepz'"),
        (["--config", "{tmp}/type.toml"], "--config: 'steps' in"),
        (["--config", "{tmp}/syntax.toml"], "--config: {tmp}/syntax.toml is not valid TOML"),
        (["--config", "{tmp}/missing.toml"], "--config: cannot read"),
        (
            ["--config", "{tmp}/renamed.toml"],
            "--config: 'sparse_embeddings' in {tmp}/renamed.toml was renamed 'row_sparse_tables'",
        ),
        (["--log-to", "wandb"], "--log-to must be one of tensorboard, got 'wandb'"),
        (["--resume", "latest", "--out-dir", "{tmp}"], "--resume latest: no checkpoint"),
        (["--resume", "{tmp}/none"], "--resume: no checkpoint at {tmp}/none"),
    ],
)
def test_bad_options_give_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    for name, text in BAD_TOML.items():
        (tmp_path / f"{name}.toml").write_text(text)
    if "hf:" in " ".join(argv):
        pytest.importorskip("transformers")
    assert main(["train", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flatshard train: error: {message.format(tmp=tmp_path)}"), err
    assert "\n" not in err


def test_unknown_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--stepz", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    expected = "flatshard train: error: unrecognized arguments: --stepz (did you mean --steps?) 3"
    assert err == f"{expected} (see flatshard train --help)", err
    # the CLI took the API's words (placement=RowSparse()): the old flag names the new one
    with pytest.raises(SystemExit):
        main(["train", "--sparse-embeddings"])
    assert "--sparse-embeddings (renamed --row-sparse-tables)" in capsys.readouterr().err


def test_choices_take_any_case() -> None:
    from flatshard.cli.config import config_from_args
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.main import build_parser

    argv = ["train", "--strategy", "shard_grad_op", "--lr-schedule", "Linear", "--units", "BLOCKS"]
    config = config_from_args(TrainConfig, build_parser().parse_args(argv))
    assert (config.strategy, config.lr_schedule, config.units) == (
        "SHARD_GRAD_OP",
        "linear",
        "blocks",
    )


@pytest.mark.parametrize("command", ["train", "plan"])
def test_strategies_by_zero_names_and_every_strategy_in_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSpeed's and PyTorch's names are taken and stored as flatshard's; --help lists
    every strategy (HYBRID_SHARD_OPTIM too) with its other names."""
    from flatshard.cli.config import config_from_args
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.main import build_parser
    from flatshard.cli.plan.command import PlanConfig

    config_type = TrainConfig if command == "train" else PlanConfig
    for given, name in [("zero3", "FULL_SHARD"), ("ZeRO-2", "SHARD_GRAD_OP"), ("ddp", "NO_SHARD")]:
        args = build_parser().parse_args([command, "--strategy", given])
        assert config_from_args(config_type, args).strategy == name, given
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for strategy in flatshard.ShardingStrategy:
        assert strategy.name in help_text, strategy
    assert "FULL_SHARD (zero3, fsdp)" in help_text


def _bench(
    argv: list[str], out: Path, capsys: pytest.CaptureFixture[str] | None = None
) -> tuple[dict[str, Any], str]:
    """``flatshard bench``, its bench.json and its stdout. In this process: its ranks are
    processes of their own anyway, forked from the suite's server that imported torch
    ([Note: fast ranks]), so a process for the command itself would only add its imports."""
    assert main(["bench", *argv, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out if capsys is not None else ""
    return json.loads((out / "bench.json").read_text()), stdout


def test_bench_predicts_from_a_process_that_joined_a_group(
    local_group: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a process with a process group (a notebook, the suite's own), the plan behind the
    prediction line runs in a child process, which gets what it builds by pickling (the
    bench's local functions could not be: the command failed after its table)."""
    argv = ["--systems", "flatshard", "--vocab", "32", "--dim", "16", "--heads", "2"]
    argv += ["--layers", "1", "--seq-len", "8", "--batch", "2", "--steps", "1", "--warmup", "0"]
    report, stdout = _bench([*argv, "--rounds", "1"], tmp_path, capsys)
    assert "flatshard plan predicted: tensors" in stdout, stdout
    assert report["plan"]["tensor_peak_mib"] > 0


def test_bench_compares_all_systems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "byte-gpt", "--dim", "16", "--layers", "1", "--seq-len", "8"]
    argv += ["--batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    report, stdout = _bench(argv, tmp_path, capsys)
    assert list(report["systems"]) == ["flatshard", "fsdp2", "ddp", "floor", "comm"]
    for system, row in report["systems"].items():
        assert row["median_step_s"] > 0 and row["peak_mem_mib"] > 0, system
        assert row["tensor_peak_mib"] > 0 and row["time_vs_floor"] > 0, system
    # The bound: the floor plus the CPU time of the least collectives alone ("comm"), the
    # same for every system; nobody moves fewer bytes than the least (no row-sparse tables).
    floor, comm = report["systems"]["floor"], report["systems"]["comm"]
    bound = floor["median_step_s"] + comm["cpu_s"]
    for system, row in report["systems"].items():
        assert row["bound_s"] == pytest.approx(bound), system
        assert row["time_vs_bound"] == pytest.approx(row["median_step_s"] / bound), system
    for system in ("flatshard", "fsdp2"):
        assert report["systems"][system]["sent_bytes"] >= comm["sent_bytes"] > 0, system
    assert f"= {bound:.3f} s" in stdout and "vs bound" in stdout
    assert (report["config"]["vocab"], report["config"]["dim"]) == (256, 16)  # flags win
    systems = report["systems"]  # DDP holds the floor's tensors plus its gradient buckets
    assert systems["ddp"]["tensor_peak_mib"] > systems["floor"]["tensor_peak_mib"]
    # Between steps a rank keeps about half the state at 2 ranks (sharded parameters, moments).
    rest = {s: row["tensor_rest_mib"] for s, row in systems.items()}
    assert rest["flatshard"] < 0.55 * rest["floor"] and rest["ddp"] >= rest["floor"], rest
    assert report["systems"]["floor"]["collective_output_bytes"] == 0  # no communication at all
    assert report["collectives"].startswith("gloo: all-gather")
    assert report["systems"]["flatshard"]["exposed_comm_s"] > 0  # gloo blocks the caller
    assert "exposed_comm_s" not in report["systems"]["fsdp2"]  # not instrumented there
    assert report["systems"]["flatshard"]["collective_output_bytes"] > 0
    # Bytes sent, not produced: gloo's reduction as an all-to-all outputs W chunks where a
    # reduce-scatter outputs one, yet sends what it sends ((W - 1) / W of its input).
    sent = {s: row["sent_bytes"] for s, row in systems.items()}
    ours = systems["flatshard"]
    produced = ours["all_gather_bytes"] + ours["all_to_all_bytes"]
    assert sent["flatshard"] == pytest.approx(produced / 2, abs=64)  # (+ the clip's scalar)
    assert sent["ddp"] == systems["ddp"]["collective_output_bytes"]  # all-reduce: 2 (W-1)/W
    assert sent["flatshard"] <= sent["fsdp2"] and sent["floor"] == 0, sent
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # flatshard plan's prediction of the same run (made on the meta device): the same bytes.
    predicted = report["plan"]["tensor_peak_mib"]
    assert predicted == pytest.approx(systems["flatshard"]["tensor_peak_mib"], rel=1e-3)
    assert report["plan"]["median_step_s"] > 0
    assert "vs fsdp2" in stdout and "flatshard" in stdout


def test_bench_reports_row_sparse_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--preset llm-128k: untied, row-sparse tables for flatshard; flatshard-dense beside
    it gathers them whole; the bytes the tables sent per step are reported."""
    argv = ["--preset", "llm-128k", "--vocab", "512", "--dim", "16", "--heads", "2"]
    argv += ["--layers", "1", "--seq-len", "8", "--batch", "2", "--steps", "1", "--rounds", "1"]
    argv += ["--systems", "flatshard,flatshard-dense"]
    report, stdout = _bench(argv, tmp_path, capsys)
    assert (report["config"]["tied"], report["config"]["row_sparse_tables"]) == (False, True)
    sparse, dense = report["systems"]["flatshard"], report["systems"]["flatshard-dense"]
    assert sparse["embedding_sparse_lookups"] >= 2 and sparse["embedding_bytes_per_step"] > 0
    assert "embedding_bytes_per_step" not in dense
    assert sparse["collective_output_bytes"] < dense["collective_output_bytes"]
    assert "flatshard row-sparse tables:" in stdout
    assert sparse["wait_s <root>"] > 0  # gloo blocks the caller: the root's waits counted
    # A line of the waits per unit for each system that waited at least 0.5 ms on one (a
    # one-step run of this tiny model may not: the line is then left out).
    for system, row in report["systems"].items():
        waited = any(v >= 0.0005 for k, v in row.items() if k.startswith("wait_s "))
        assert (f"{system} exposed wait per unit" in stdout) == waited, (system, row)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "adafactor"])
def test_bench_scaling_matches_the_formulas(tmp_path: Path, optimizer: str) -> None:
    """``--scaling``: at W = 1 and 2, flatshard's "at rest" tensor bytes and collective
    output bytes per step equal their formulas (``cli/bench/formula.py``) exactly, for each
    optimizer (Muon and Adafactor with whole parameters: uneven, padded shards)."""
    argv = ["--scaling", "--systems", "flatshard", "--dim", "16", "--layers", "2"]
    argv += ["--optimizer", optimizer]
    argv += ["--vocab", "40", "--seq-len", "8", "--batch", "2", "--steps", "1", "--rounds", "1"]
    scaling = _bench(argv, tmp_path)[0]["scaling"]
    assert list(scaling) == ["1", "2"]
    for world, systems in scaling.items():
        row = systems["flatshard"]
        assert row["tensor_rest_mib"] == pytest.approx(row["formula_rest_mib"], rel=1e-12), world
        assert row["collective_output_bytes"] == row["formula_collective_bytes"], world
    rest = {w: s["flatshard"]["tensor_rest_mib"] for w, s in scaling.items()}
    assert rest["2"] < 0.6 * rest["1"]


@pytest.mark.parametrize("command", ["bench", "train"])
def test_more_ranks_than_gpus_is_one_line(capsys: pytest.CaptureFixture[str], command: str) -> None:
    import torch

    if torch.cuda.is_available():  # NCCL would fail in every rank with "duplicate GPU"
        count = torch.cuda.device_count()
        argv = ["--device", "cuda", "--nproc", str(count + 1)]
        message = f"--nproc ({count + 1}) exceeds the {count} GPU(s) of this host"
    else:
        argv, message = ["--device", "cuda"], "--device is cuda, but no GPU is visible here"
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flatshard {command}: error: {message}"), err


def test_bench_accumulation_modes_move_the_bytes_they_should(tmp_path: Path) -> None:
    """--grad-accum 2 with each --accum, every system with its own switches: flatshard's
    bytes per step: keep (no second gather, no early reduction) < no_sync < reduce."""
    argv = ["--dim", "16", "--layers", "2", "--heads", "2", "--vocab", "40"]
    argv += ["--seq-len", "8", "--batch", "4", "--grad-accum", "2", "--steps", "1"]
    argv += ["--warmup", "1", "--rounds", "1", "--systems", "flatshard,fsdp2,ddp"]
    moved = {}
    for accum in ("keep", "no_sync", "reduce"):
        systems = _bench([*argv, "--accum", accum], tmp_path / accum)[0]["systems"]
        assert all(row["median_step_s"] > 0 for row in systems.values()), systems
        moved[accum] = systems["flatshard"]["collective_output_bytes"]
    assert moved["keep"] < moved["no_sync"] < moved["reduce"], moved


def test_bench_gathers_in_fewer_bytes(tmp_path: Path) -> None:
    """The gather systems send their parameters in bf16 (half of fp32's bytes) and int8
    (a quarter, plus a scale per row of 64, the embedding tables exact): the all-gathers'
    output bytes per step."""
    argv = ["--dim", "64", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "8"]
    argv += ["--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"]
    argv += ["--systems", "flatshard,flatshard-gather-bf16,flatshard-gather-int8"]
    systems = _bench(argv, tmp_path)[0]["systems"]
    gathered = {s: row["all_gather_bytes"] for s, row in systems.items()}
    assert 0.49 < gathered["flatshard-gather-bf16"] / gathered["flatshard"] < 0.51, gathered
    # int8: the matrices at (1 + 4/64) / 4 of fp32's bytes; the vectors, and the tables
    # (exact under a one-byte gather dtype), at 1
    assert 0.25 < gathered["flatshard-gather-int8"] / gathered["flatshard"] < 0.32, gathered


def test_bench_moe_preset_splits_the_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--preset moe (a GPT whose MLPs are 8 experts) with --ep 2: flatshard gathers fewer
    bytes than flatshard-noep (its experts data parallel) and moves tokens instead; the
    report says how many."""
    argv = ["--preset", "moe", "--dim", "16", "--heads", "2", "--vocab", "64", "--layers", "1"]
    argv += ["--seq-len", "8", "--batch", "2", "--steps", "1", "--rounds", "1"]
    argv += ["--systems", "flatshard,flatshard-noep"]
    report, stdout = _bench(argv, tmp_path, capsys)
    assert (report["config"]["experts"], report["config"]["ep"]) == (8, 2)
    split, dense = report["systems"]["flatshard"], report["systems"]["flatshard-noep"]
    assert split["all_gather_bytes"] < dense["all_gather_bytes"]
    # Each rank sends its 2 x 8 tokens' rows (16 floats) each way, forward and backward.
    assert split["token_bytes"] > 4 * 16 * 16 * 4 // 2 and dense["token_bytes"] == 0
    assert "flatshard plan: not predicted (the planner does not route tokens)" in stdout
    assert "tokens' all-to-alls: flatshard" in stdout


def test_bench_runs_pipeline_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--pp 2 at 4 ranks: flatshard's and FSDP2's stages under 1F1B, each with its bubble
    measured (a share of the step) and its bytes by kind: rank 0 (the first stage) sends
    each micro-batch's activations and receives their gradients, --batch x --seq-len x
    --dim fp32 values each way per step; the plan's bubble beside the measured one."""
    argv = ["--nproc", "4", "--pp", "2", "--grad-accum", "2", "--dim", "16", "--layers", "2"]
    argv += ["--heads", "2", "--vocab", "40", "--seq-len", "8", "--batch", "4", "--steps", "1"]
    argv += ["--rounds", "1"]
    report, stdout = _bench(argv, tmp_path, capsys)
    assert set(report["systems"]) == {"flatshard", "fsdp2"}
    for system, row in report["systems"].items():
        assert 0 < row["bubble"] < 1, (system, row)
        assert row["bytes send"] == row["bytes recv"] == 4 * 8 * 16 * 4, (system, row)
    assert "pipeline (2 stages, 1f1b, 2 mb), rank 0 per step: flatshard: bubble" in stdout
    assert re.search(r"bubble [0-9.]+ \(measured [0-9.]+\)", stdout), stdout


def test_bench_refuses_what_pipeline_stages_do_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, message in [
        (["--pp", "2", "--nproc", "3"], "--pp 2 needs --nproc (3) it divides"),
        (["--pp", "2", "--systems", "flatshard,ddp", "--grad-accum", "2"], "runs --systems"),
        (["--pp", "2", "--pp-schedule", "zero-bubble", "--systems", "fsdp2", "--grad-accum",
          "2"], "FSDP2's zero-bubble is not exact"),
        (["--pp", "2", "--grad-accum", "2", "--compile"], "--compile does not combine with --pp"),
    ]:  # fmt: skip
        assert main(["bench", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_bench_rejects_an_ep_that_does_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--experts", "6", "--ep", "4"]) == 2
    assert "--ep 4 needs --experts (got 6) and --nproc (got 2) that it divides" in (
        capsys.readouterr().err
    )


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


def test_charts_without_matplotlib_are_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench and train print their results first; a missing matplotlib then costs the PNG
    only, with a note (bench used to end with an error)."""
    from flatshard.cli.bench.report import chart
    from flatshard.cli.train.progress import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert (
        chart({}, str(tmp_path / "b.png"), "cpu") == "no chart (bench.png): pip install matplotlib"
    )
    assert plot(tmp_path / "m.jsonl", tmp_path / "l.png", 1.0, 2.0).startswith("no plot: pip")
    assert not list(tmp_path.iterdir())


def test_a_resume_at_another_world_size_says_what_changes() -> None:
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.train.resume import world_change

    one = TrainConfig(batch=4)  # 2 ranks x 4 sequences saved, resumed at 1 rank
    assert world_change(2, 4, one, 1) == (
        "resumed at 1 rank (saved at 2): the global batch changes from 8 to 4 sequences per "
        "step, and the data each step reads with it; to keep it: --batch 8 or --grad-accum 2"
    )
    assert world_change(2, 4, TrainConfig(batch=8), 1).endswith("stays 8 sequences per step")
    assert "to keep it" not in world_change(3, 1, TrainConfig(batch=2), 2)  # 3 of 4: no way


def test_a_resume_lists_the_options_that_differ_and_exact_resume_refuses() -> None:
    """Before, a changed --seed was accepted without a word and the losses drifted."""
    from dataclasses import asdict

    from flatshard.cli.config import ConfigError
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.train.resume import resume_changes

    saved = asdict(TrainConfig(batch=4))
    same = TrainConfig(batch=4, resume="auto", ckpt_every=5, out_dir="elsewhere")
    assert resume_changes(saved, 2, same, 2) == []  # run control only
    changed = TrainConfig(batch=4, seed=1, strategy="SHARD_GRAD_OP", resume="auto")
    assert resume_changes(saved, 2, changed, 2) == [
        "--seed 1 (was 0): each step's batch is drawn from the seed: the data order differs",
        "--strategy SHARD_GRAD_OP (was FULL_SHARD): the same mathematics, the losses equal up "
        "to rounding",
    ]
    layout_only = TrainConfig(batch=4, strategy="SHARD_GRAD_OP", exact_resume=True)
    assert len(resume_changes(saved, 2, layout_only, 2)) == 1  # not refused
    with pytest.raises(ConfigError, match=r"--exact-resume: .*\n  --seed 1 \(was 0\)"):
        resume_changes(saved, 2, TrainConfig(batch=4, seed=1, exact_resume=True), 2)
    with pytest.raises(ConfigError, match="global batch changes from 8 to 4"):
        resume_changes(saved, 2, TrainConfig(batch=4, exact_resume=True), 1)


def test_train_in_pipeline_stages_resumes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--pp 2: the GPT in two stages; zero-bubble and interleaved (four stages, two a
    rank) give 1F1B's losses (the same mathematics), and a checkpoint of the stages
    resumes exactly. Without a pipeline the head is tied: the checkpoint is refused in one
    line (before: a rank's traceback, "optimizer state for 'head.weight', which is not a
    parameter of this model")."""
    common = [*TINY, "--steps", "4", "--pp", "2", "--grad-accum", "2", "--sample-bytes", "0"]
    split, plain, resumed = tmp_path / "zb", tmp_path / "1f1b", tmp_path / "resumed"
    zero_bubble = [*common, "--pp-schedule", "zero-bubble"]
    out = _train(*zero_bubble, "--ckpt-every", "2", "--out-dir", str(split))
    assert "pipeline: 2 stages (zero-bubble, 2 micro-batches a step)" in out, out
    assert "head untied" in out, out
    _train(*common, "--pp-schedule", "1f1b", "--out-dir", str(plain))
    losses = _losses(split)
    assert losses == pytest.approx(_losses(plain), rel=1e-5)
    interleaved = [*TINY, "--layers", "4", "--steps", "4", "--pp", "2", "--microbatches", "2"]
    out = _train(*interleaved, "--pp-schedule", "interleaved", "--sample-bytes", "0",
                 "--out-dir", str(tmp_path / "interleaved"))  # fmt: skip
    assert "pipeline: 4 stages, two a rank (interleaved, 2 micro-batches a step)" in out, out
    _train(*interleaved, "--pp-schedule", "1f1b", "--sample-bytes", "0",
           "--out-dir", str(tmp_path / "four-blocks"))  # fmt: skip
    assert _losses(tmp_path / "interleaved") == pytest.approx(
        _losses(tmp_path / "four-blocks"), rel=1e-5
    )
    assert losses[4] < losses[1]
    ckpt = split / "checkpoints" / "step_000002"
    _train(*zero_bubble, "--resume", str(ckpt), "--out-dir", str(resumed))
    for step, loss in _losses(resumed).items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step
    capsys.readouterr()
    assert main(["train", *TINY, "--resume", str(ckpt), "--out-dir", str(tmp_path / "dp")]) == 2
    said = capsys.readouterr().err
    assert "holds a GPT trained with --pp 2, its head apart from its embedding; --pp 1" in said
    assert "Resume with --pp 2 or more" in said and "Traceback" not in said, said


def test_train_refuses_what_pipeline_stages_do_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, message in [
        (["--pp", "2", "--layers", "3"], "--pp (2) must divide --layers (3) into 2 stages"),
        (["--pp", "2", "--grad-accum", "1"], "--grad-accum (1) micro-batches for --pp 2"),
        (["--pp", "2", "--grad-accum", "2", "--compile"], "--compile does not combine with --pp"),
        (["--pp", "2", "--model", "hf:gpt2"], "--pp only applies to --model gpt"),
        (["--pp-schedule", "dualpipe"], "--pp-schedule must be one of gpipe, 1f1b, interleaved"),
        (["--microbatches", "4"], "--microbatches applies to --pp > 1; without a pipeline"),
        (["--pp", "2", "--microbatches", "4", "--grad-accum", "2"], "give one of them"),
        (["--pp", "2", "--microbatches", "1"], "--microbatches (1) micro-batches for --pp 2"),
        (
            ["--pp", "2", "--pp-schedule", "interleaved", "--layers", "6", "--microbatches", "2"],
            "--pp (2) must divide --layers (6) into 4 stages (two a rank)",
        ),
        (
            [
                "--pp",
                "2",
                "--pp-schedule",
                "interleaved",
                "--layers",
                "4",
                "--microbatches",
                "2",
                "--ckpt-every",
                "1",
            ],
            "--ckpt-every does not combine with --pp-schedule interleaved",
        ),
        (["--pp", "3", "--layers", "3", "--grad-accum", "3"], "--pp (3) must divide the number"),
    ]:
        assert main(["train", *argv]) == 2
        assert message in capsys.readouterr().err, argv


def test_ranks_write_where_the_launcher_writes_when_it_starts_them(tmp_path: Path) -> None:
    """``main(["train", ...])`` run twice in one process, its output redirected elsewhere
    each time (as tests/in_process.py does): the second run's ranks, forked from the server
    the first started, print into the second run's output, not the first's."""
    argv = ["train", *TINY, "--steps", "1", "--sample-bytes", "0"]
    for run in ("first", "second"):
        code, out, err = run_command([*argv, "--out-dir", str(tmp_path / run)])
        assert code == 0, out + err
        assert "step 1/1" in out and "held-out loss" in out, (run, out, err)


def test_sizes_are_read_in_every_unit() -> None:
    """Before: '600KiB' was refused as if the number were wrong ("expected e.g. 20GiB")."""
    from flatshard.cli.sizes import parse_size

    assert parse_size("600KiB", "--memory-budget", 0) == 600 * 1024
    assert parse_size("2 KB", "--memory-budget", 0) == 2000
    assert parse_size("1.5TiB", "--memory-budget", 0) == 3 * 2**39
    assert parse_size("device", "--memory-budget", 7) == 7


def test_overrides_a_config_takes_in_are_not_refused() -> None:
    """Llama's config takes rope_theta into its rope parameters and attn_implementation
    into a field of its own: no attribute of that name holds them, yet they are known (a
    first check of override names refused both)."""
    transformers = pytest.importorskip("transformers")
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.lm.model import hf_config

    overrides = "hidden_size=32,num_hidden_layers=1,rope_theta=500000.0,attn_implementation=eager"
    built = hf_config(transformers, TrainConfig(model="hf:llama", hf_overrides=overrides))
    assert built.num_hidden_layers == 1
