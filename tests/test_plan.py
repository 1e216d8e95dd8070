"""``flatshard.plan`` against the run it predicts: the steady-state peak of live tensor
storage per rank, predicted on the meta device in a simulated world, equals what the same
training step measures on CPU ranks at the dispatcher (exactly where the ops are the same;
the acceptance bound is 10%). Also the ``flatshard plan`` command's JSON and budget."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import shlex
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import flatshard
from flatshard.cli.lm.model import checkpoint_hf_blocks
from flatshard.cli.lm.planned import language_model_loss
from flatshard.cli.main import main
from flatshard.models import GPT, GPTBlock
from flatshard.testing.internals import MetaOps, measured_step_peak, meta_ops_not_remembered
from flatshard.testing.workers import WorkerContext, WorkerPool

# This machine as the planner sees a gloo run: only the backend and device matter to memory.
CPU = flatshard.Cluster(
    name="cpu",
    memory_bytes=1 << 34,
    flops={torch.float32: 1e11},
    memory_bandwidth=1e10,
    intra_bandwidth=1e9,
    inter_bandwidth=1e9,
    overlap=False,
    backend="gloo",
    device="cpu",
)
VOCAB, SEQ, BATCH = 256, 32, 4
LLAMA_OVERRIDES = (
    "hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,"
    "num_key_value_heads=2,vocab_size=512"
)


def gpt(checkpointing: bool = False) -> nn.Module:
    model = GPT(VOCAB, 64, 4, 3, SEQ)
    model.checkpoint_blocks = checkpointing
    return model


def untied_gpt() -> nn.Module:
    return GPT(VOCAB, 64, 4, 3, SEQ, tied=False)


def tp_gpt(tp: DeviceMesh) -> nn.Module:
    """The GPT with each block's MLP split over ``tp`` (Megatron's column then row)."""
    model = gpt()
    for block in model.blocks:
        parallelize_module(block.mlp, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


class ScratchGPT(GPT):
    """A GPT whose forward sizes scratch memory itself: 4 MiB through ``resize_`` (an op
    on a tensor that exists already) for one op at the end, and 1 MiB through
    ``untyped_storage().resize_``, which no op shows the dispatcher, kept until the next
    forward ([Note: a running total of live bytes])."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.kept = torch.empty(0, device=idx.device)
        self.kept.untyped_storage().resize_(1 << 20)
        logits = super().forward(idx)
        scratch = logits.new_empty(0)
        scratch.resize_(1 << 20)  # floats
        logits = logits * 1.0
        scratch.resize_(0)
        return logits


def scratch_gpt() -> nn.Module:
    return ScratchGPT(VOCAB, 64, 4, 3, SEQ)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    # Called without a KV cache (language_model_loss), transformers asks a meta tensor for
    # a value ("packed sequences?"): the plan must answer as the run does.
    checkpoint_hf_blocks(model)
    return model


def tokens() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ)),)


def many_tokens() -> tuple[torch.Tensor, ...]:
    """16 x 32 tokens: as many as the 256-token vocabulary twice over."""
    return (torch.randint(0, VOCAB, (16, SEQ)),)


def distinct_tokens() -> tuple[torch.Tensor, ...]:
    """4 x 32 distinct token ids, half in each rank's rows of the table: what a plan of
    row-sparse tables takes a batch to be (every id distinct, spread as the rows are)."""
    half = VOCAB // 2
    ids = torch.cat([torch.randperm(half)[: BATCH * SEQ // 2] + h for h in (0, half)])
    return (ids[torch.randperm(ids.numel())].view(BATCH, SEQ),)


@dataclass(frozen=True)
class Case:
    name: str
    build: Any
    hosts: int = 1
    ranks_per_host: int = 2
    options: tuple[tuple[str, Any], ...] = ()
    inputs: Any = tokens


def _llama_units() -> set[type[nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


S = flatshard.ShardingStrategy
CASES = [
    Case("full-shard", gpt),
    Case("zero2-checkpointing", partial(gpt, True), options=(("strategy", S.SHARD_GRAD_OP),)),
    Case("no-shard-1-rank", gpt, ranks_per_host=1, options=(("strategy", S.NO_SHARD),)),
    Case("hybrid-2x2", gpt, hosts=2, options=(("strategy", S.HYBRID_SHARD),)),
    Case(
        "bf16-accumulation", gpt, options=(("mixed_precision", torch.bfloat16), ("grad_accum", 2))
    ),
    Case("llama-checkpointing-sgd", llama, options=(("optimizer", "sgd-momentum"),)),
    Case("full-shard-last-unit-kept", gpt, options=(("keep_gathered", 1),)),
    # Each block, its attention and its MLP, and the untied embedding and head: 9 units
    # with the root; the last 2 (the head, the last MLP) kept gathered.
    Case("llama-sublayers-kept", llama, options=(("units", "sublayers"), ("keep_gathered", 2))),
    # On a CPU the offloaded state shares the one memory: the run's peak is both memories'.
    Case("cpu-offload", gpt, options=(("cpu_offload", True),)),
    # dp 2 x tp 2: tensor parallel's all-reduces and DTensor's tensors are in the step.
    Case("tensor-parallel-2x2", tp_gpt, ranks_per_host=4, options=(("tensor_parallel", 2),)),
    # Muon on the blocks' matrices, kept whole on one rank each (uneven, padded shards),
    # AdamW on the rest; at 3 ranks, where the blocks' shards are the most uneven.
    Case("muon-whole-matrices", gpt, ranks_per_host=3, options=(("optimizer", "muon"),)),
    # 2 micro-batches, each reduced: hybrid reduce-scatters alone, across hosts once.
    Case(
        "hybrid-reduce-each-micro-batch",
        gpt,
        hosts=2,
        options=(("strategy", S.HYBRID_SHARD), ("grad_accum", 2), ("accumulation", "reduce")),
    ),
    # The tied table row-sparse: its lookup's fetched rows, its gradient's rows and the
    # table's gather behind the blocks (the position table stays dense: 32 rows, all used).
    Case(
        "row-sparse-tables",
        gpt,
        options=(("placement", flatshard.RowSparse()),),
        inputs=distinct_tokens,
    ),
    # Every unit kept gathered from forward to backward under FULL_SHARD
    # (set_reshard_after_forward(False)): ZeRO-2's memory, no all-gather in backward.
    Case("kept-after-forward", gpt, options=(("reshard_after_forward", False),)),
    Case("storage-resized-by-the-model", scratch_gpt),
]


def measure_job(ctx: WorkerContext, world: int, case_index: int, setup: Any) -> int | None:
    group = ctx.group(world)
    if group is None:
        return None
    case = CASES[case_index]
    torch.manual_seed(0)
    return measured_step_peak(case.build, case.inputs, language_model_loss, setup, group)


@pytest.fixture(scope="module")
def planner() -> Iterator[ProcessPoolExecutor]:
    """Plans run in a process of their own: this one may have joined a process group (the
    session's ``local_group``), and a plan simulates a world of its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        yield child


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_predicted_peak_is_the_measured_peak(
    pool: WorkerPool, planner: ProcessPoolExecutor, index: int
) -> None:
    case = CASES[index]
    if case.build is llama:
        pytest.importorskip("transformers")
    units: Any = _llama_units() if case.build is llama else {GPTBlock}
    options = dict(case.options)  # (hybrid: F defaults to the ranks per host, 2)
    if options.pop("units", "blocks") == "sublayers":
        units = flatshard.SublayerPolicy(units)
    predicted = planner.submit(
        flatshard.plan,
        case.build,
        case.inputs,
        loss=language_model_loss,
        auto_wrap_policy=units,
        cluster=CPU,
        hosts=case.hosts,
        ranks_per_host=case.ranks_per_host,
        **options,
    ).result()
    if isinstance(units, flatshard.SublayerPolicy):
        assert predicted.units == 9
    if options.get("strategy") == S.HYBRID_SHARD:  # sharded inside each "host" of 2
        assert predicted.setup.sharding_factor == case.ranks_per_host
    world = case.hosts * case.ranks_per_host
    measured = [m for m in pool.run(measure_job, world, index, predicted.setup) if m is not None]
    assert len(measured) == world
    # Rank 0 is the one simulated; the last rank's rows can differ by padding.
    assert abs(predicted.total_peak_bytes - measured[0]) <= 0.01 * measured[0], (
        predicted.total_peak_bytes,
        measured,
    )
    if options.get("placement"):  # exactly: every id distinct, as the plan takes them
        assert predicted.total_peak_bytes == measured[0], (predicted.total_peak_bytes, measured)
    assert sum(predicted.memory.values()) == predicted.peak_memory_bytes
    if not options.get("cpu_offload"):
        assert predicted.peak_memory_bytes == predicted.total_peak_bytes
    if options.get("tensor_parallel"):  # each MLP's all-reduce: forward's output, backward's
        activations = BATCH * SEQ * 64 * 4  # input gradient (fp32, width 64)
        tp = [op for op in predicted.ops if op.collective == "all_reduce" and op.group_size == 2]
        assert sum(op.io_bytes == activations for op in tp) == 2 * 3
    assert predicted.at_rest_bytes < predicted.peak_memory_bytes


def planned_twice(case_index: int, cluster: str) -> list[tuple[Any, ...]]:
    """Case ``case_index`` planned on ``cluster`` with meta ops remembered (twice: the
    second answered from the first) and with every op run: what each plan recorded."""
    from flatshard.planner import PRESETS

    case = CASES[case_index]
    options = dict(case.options)
    units: Any = _llama_units() if case.build is llama else {GPTBlock}
    if options.pop("units", "blocks") == "sublayers":
        units = flatshard.SublayerPolicy(units)
    found = []
    for remembered in (True, True, False):
        with contextlib.nullcontext() if remembered else meta_ops_not_remembered():
            torch.manual_seed(0)
            plan = flatshard.plan(
                case.build,
                case.inputs,
                loss=language_model_loss,
                auto_wrap_policy=units,
                cluster=CPU if cluster == "cpu" else PRESETS[cluster],
                hosts=case.hosts,
                ranks_per_host=case.ranks_per_host,
                **options,
            )
        found.append((plan.ops, plan.timeline, plan.memory, plan.step, plan.host_memory_bytes))
    return found


def measured_three_times() -> list[flatshard.Cluster]:
    from flatshard.planner import cpu_cluster

    return [cpu_cluster(1), cpu_cluster(1), cpu_cluster(1, again=True)]


def test_this_machine_is_measured_once_per_process(planner: ProcessPoolExecutor) -> None:
    """The plans of one process are priced on one measurement (each takes seconds);
    ``again`` measures anew (figures of a second measurement are never all the same)."""
    first, second, again = planner.submit(measured_three_times).result()
    assert first == second
    assert again.notes != first.notes, again.notes


def test_a_remembered_answer_is_for_the_same_arguments_only() -> None:
    """What decides a meta op's outputs is in the key: each argument's type with its value
    (an integer tensor plus 2 stays integer, plus 2.0 is a float tensor), sizes and
    strides. An in-place op answers its own argument, a view always runs, and a call that
    failed fails again."""
    ops = MetaOps()
    aten = torch.ops.aten
    ints = torch.empty(3, 4, dtype=torch.int64, device="meta")
    floats = torch.empty(4, 3, device="meta")
    for _ in range(2):  # the second time, answered from the first
        assert ops(aten.add.Tensor, (ints, 2), {}).dtype == torch.int64
        assert ops(aten.add.Tensor, (ints, 2.0), {}).dtype == torch.float32
        assert ops(aten.add.Tensor, (ints, True), {}).dtype == torch.int64
        product = ops(aten.mm.default, (floats, floats.t()), {})
        assert (product.shape, product.stride()) == ((4, 4), (4, 1))
        transposed = ops(aten.mm.default, (floats.t(), floats), {})
        assert (transposed.shape, transposed.stride()) == ((3, 3), (3, 1))
        assert ops(aten.mul_.Tensor, (floats, 2.0), {}) is floats
        view = ops(aten.view.default, (floats, [12]), {})
        assert view.untyped_storage() is not None and view._base is floats
        with pytest.raises(RuntimeError):
            ops(aten.mm.default, (floats, floats), {})
        made = ops(aten.empty.memory_format, ([2, 3],), {"device": torch.device("meta")})
        assert made.dtype == torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # a factory op without a dtype takes it
        try:
            made = ops(aten.empty.memory_format, ([2, 3],), {"device": torch.device("meta")})
            assert made.dtype == torch.float64
        finally:
            torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    ("name", "cluster"),
    [
        ("llama-sublayers-kept", "h100-80gb"),  # foreach AdamW, a Hugging Face model
        ("tensor-parallel-2x2", "cpu"),  # DTensor's ops
        ("row-sparse-tables", "cpu"),
        ("bf16-accumulation", "h100-80gb"),  # two dtypes of the same shapes
    ],
)
def test_remembered_meta_ops_plan_what_every_op_run_plans(
    planner: ProcessPoolExecutor, name: str, cluster: str
) -> None:
    """[Note: meta ops remembered]: the same ops, bytes, FLOPs, timeline and memory."""
    if name.startswith("llama"):
        pytest.importorskip("transformers")
    index = next(i for i, case in enumerate(CASES) if case.name == name)
    first, again, every_op = planner.submit(planned_twice, index, cluster).result()
    assert first == every_op
    assert again == every_op


def test_sharding_divides_the_state_and_checkpointing_cuts_activations(
    planner: ProcessPoolExecutor,
) -> None:
    def planned(world: int, checkpointing: bool = False) -> flatshard.Plan:
        build = partial(gpt, checkpointing)
        options = {"loss": language_model_loss, "auto_wrap_policy": {GPTBlock}, "cluster": CPU}
        done = planner.submit(flatshard.plan, build, tokens, ranks_per_host=world, **options)
        return done.result()

    one, four = planned(1), planned(4)
    assert four.at_rest_bytes < 0.3 * one.at_rest_bytes
    shares = four.memory["optimizer state"] / one.memory["optimizer state"]
    assert 0.24 < shares < 0.27  # Adam's moments of a quarter of the rows (+ padding)
    gathered = {c.kind: c.count for c in four.collectives}
    # Forward gathers all 4 units, backward all but the root and the last block (kept),
    # plus the end-of-step check; one reduction per unit; one all-reduce for the clip.
    assert gathered == {"all_gather": 4 + 2 + 1, "all_to_all": 4, "all_reduce": 1}
    # Checkpointing keeps each block's input instead of its activations, and runs each
    # block's forward twice: 4/3 of the FLOPs of the blocks, or near it.
    recomputed = planned(4, checkpointing=True)
    activations = "activations and temporaries"
    assert recomputed.memory[activations] < 0.7 * four.memory[activations]
    assert 1.15 * four.step.flops < recomputed.step.flops < 1.4 * four.step.flops


def one_token() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (1, 1)),)


def test_optimizer_state_is_the_same_wherever_the_peak_falls(
    planner: ProcessPoolExecutor,
) -> None:
    """One token at one rank with checkpointing: the peak falls inside AdamW's (foreach)
    step, whose intermediates are counted apart from its state. "optimizer state" is then
    the same as where the peak falls in backward: the moments, twice the parameters."""
    options = {"loss": language_model_loss, "auto_wrap_policy": {GPTBlock}, "ranks_per_host": 1}
    in_step = planner.submit(flatshard.plan, partial(gpt, True), one_token, **options).result()
    in_backward = planner.submit(flatshard.plan, gpt, tokens, **options).result()
    assert in_step.memory.get("optimizer step temporaries", 0) > 0, in_step.memory
    assert "optimizer step temporaries" not in in_backward.memory, in_backward.memory
    state = in_step.memory["optimizer state"]
    assert state == in_backward.memory["optimizer state"]
    assert state == 2 * 4 * sum(p.numel() for p in gpt().parameters())


def test_cpu_offload_moves_the_state_to_the_host(planner: ProcessPoolExecutor) -> None:
    """With CPUOffload the device keeps only the buffers between steps, the host the
    shards, gradients and optimizer state; on a GPU cluster the step pays the copies over
    PCIe and the optimizer's step at the host's speed."""

    def planned(cluster: Any, offload: bool, **shape: int) -> flatshard.Plan:
        build = partial(GPT, **{"vocab": VOCAB, "dim": 64, "heads": 4, "layers": 3, **shape})
        options = {"loss": language_model_loss, "auto_wrap_policy": {GPTBlock}}
        options |= {"cluster": cluster, "ranks_per_host": 2, "cpu_offload": offload}
        return planner.submit(flatshard.plan, build, tokens, **options).result()

    kept, offloaded = planned(CPU, False, seq_len=SEQ), planned(CPU, True, seq_len=SEQ)
    masks = 3 * SEQ * SEQ  # each block's causal mask (bool): the model's only buffers
    assert offloaded.at_rest_bytes == masks
    state = kept.at_rest_bytes - masks  # shards S and Adam's moments 2 S
    # At the optimizer's step the host holds all that and the gradient shards (S).
    assert offloaded.host_memory_bytes >= state * 4 // 3
    assert "optimizer state" not in offloaded.memory  # not on the device at its peak
    assert offloaded.to_json()["cpu_offload"] and not kept.host_memory_bytes
    # On an A100 server the optimizer's step moves to the host CPUs: slower, as offload is.
    on_gpu = {"seq_len": SEQ}
    fast, slow = planned("a100-80gb", False, **on_gpu), planned("a100-80gb", True, **on_gpu)
    assert slow.step.seconds > fast.step.seconds
    assert slow.peak_memory_bytes < fast.peak_memory_bytes


# What `flatshard train` needs to train the model planned by the arguments below.
TRAIN_FLAGS = "--dim 256 --layers 2 --seq-len 32 --batch 2 "


def test_the_recommended_train_command_trains_what_was_planned() -> None:
    """The command a plan recommends, parsed as `flatshard train` parses it, has the
    plan's model, batch and ranks (options train does not share are left out)."""
    from flatshard.cli.config import config_from_args
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.main import build_parser
    from flatshard.cli.plan.command import PlanConfig, planned_train_flags

    argv = ["--model", "hf:llama", "--hf-overrides", "hidden_size=64,num_hidden_layers=2"]
    argv += ["--seq-len", "32", "--batch", "2", "--mixed-precision", "bf16", "--cluster", "cpu"]
    planned = config_from_args(PlanConfig, build_parser().parse_args(["plan", *argv]))
    flags = [*shlex.split(planned_train_flags(planned, 8)), "--strategy", "zero2"]
    train = config_from_args(TrainConfig, build_parser().parse_args(["train", *flags]))
    for name in ("model", "hf_overrides", "seq_len", "batch", "mixed_precision"):
        assert getattr(train, name) == getattr(planned, name), name
    assert (train.nproc, train.strategy) == (8, "SHARD_GRAD_OP")
    assert "--cluster" not in flags


def test_cpu_offload_is_recommended_where_nothing_else_fits(planner: ProcessPoolExecutor) -> None:
    # Every strategy needs 1 GiB (context) + 24-33 MiB here; offloaded, 15-16 MiB.
    args = ["plan", "--layers", "2", "--dim", "256", "--seq-len", "32", "--batch", "2"]
    args += ["--nproc", "2", "--cluster", "h100-80gb", "--memory-budget", "1044MiB"]
    code, out, _ = planner.submit(run_cli, args).result()
    assert code == 0, out
    chosen = "recommended: FULL_SHARD, CPU offload (flatshard train "
    assert f"{chosen}{TRAIN_FLAGS}--strategy FULL_SHARD --cpu-offload)" in out
    assert "host memory (CPU offload), peak" in out
    # The detail says what was asked: the budget, and that the recommendation fits it.
    assert re.search(r"memory budget \(--memory-budget\) +1\.02 GiB +fits", out), out
    code, out, _ = planner.submit(run_cli, [*args[:-1], "1030MiB"]).result()
    assert code == 1 and "nothing fits" in out  # not even offloaded
    # Planned with row-sparse tables: the train line it recommends has them too.
    code, out, _ = planner.submit(run_cli, [*args, "--row-sparse-tables"]).result()
    assert code == 0 and "--cpu-offload --row-sparse-tables)" in out, out


def test_sublayer_units_are_recommended_where_they_make_a_faster_setup_fit(
    planner: ProcessPoolExecutor,
) -> None:
    """FULL_SHARD needs 108.6 MiB here with blocks as units and 107.6 MiB with sublayers
    (two of a block's three parts gathered at once, not two blocks); with a budget between
    the two it fits only split, and still beats checkpointing (a fifth slower). Its
    ZeRO-2 form (SHARD_GRAD_OP) does not fit, so its last units are then kept gathered
    until backward as far as memory allows: faster still (on cpu-dev's single timeline
    every all-gather saved is time saved)."""
    args = ["plan", "--layers", "4", "--dim", "256", "--batch", "8", "--nproc", "2"]
    args += ["--cluster", "cpu-dev", "--memory-budget", "108MiB", "--json"]
    code, out, _ = planner.submit(run_cli, args).result()
    assert code == 0
    result = json.loads(out)
    budget = result["budget_bytes"]
    fits = {c["setup"]: c["device_memory_needed_bytes"] <= budget for c in result["candidates"]}
    units = {c["setup"]: c["units"] for c in result["candidates"]}
    assert not fits["FULL_SHARD"] and fits["FULL_SHARD, sublayer units"]
    assert units["FULL_SHARD, sublayer units"] == 1 + 4 * 3  # the embedding is tied
    assert "NO_SHARD, sublayer units" not in fits  # nothing to gather: nothing to split
    assert not fits["SHARD_GRAD_OP"]
    assert result["recommended"].startswith("FULL_SHARD, sublayer units, last "), result
    kept = next(c for c in result["candidates"] if c["setup"] == result["recommended"])
    assert 0 < kept["kept_gathered"] < 12 and fits[kept["setup"]]
    split = next(c for c in result["candidates"] if c["setup"] == "FULL_SHARD, sublayer units")
    assert kept["step_time_s"] < split["step_time_s"]


def test_the_kept_units_found_are_the_most_that_fit(planner: ProcessPoolExecutor) -> None:
    """The budget search finds the most last units kept gathered that fit without planning
    every count: here every count is planned, and the one it recommends fits while one
    more does not."""
    args = ["plan", "--layers", "4", "--dim", "256", "--batch", "8", "--nproc", "2"]
    args += ["--cluster", "cpu-dev", "--units", "sublayers", "--json"]
    code, out, _ = planner.submit(run_cli, [*args, "--memory-budget", "108MiB"]).result()
    assert code == 0
    result = json.loads(out)
    kept = next(c for c in result["candidates"] if c["setup"] == result["recommended"])
    needed = []
    for count in range(kept["units"]):
        code, out, _ = planner.submit(run_cli, [*args, "--keep-gathered", str(count)]).result()
        needed.append(json.loads(out)["device_memory_needed_bytes"])
    fitting = [count for count, need in enumerate(needed) if need <= result["budget_bytes"]]
    assert fitting == list(range(len(fitting))), needed  # memory grows with the count
    assert kept["kept_gathered"] == fitting[-1], (kept["kept_gathered"], needed)


def run_cli_on_one_core(argv: list[str]) -> tuple[int, str, str]:
    """``run_cli`` in a process allowed one core: the budget search's candidates are then
    planned one after another."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        return run_cli(argv)
    finally:
        os.sched_setaffinity(0, cores)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two cores to plan side by side",
)
def test_candidates_planned_side_by_side_are_planned_as_one_after_another(
    planner: ProcessPoolExecutor,
) -> None:
    """[Note: candidates planned side by side]: the budget search on two cores (candidates
    in forked processes, kept units probed two at a time) gives every candidate's figures
    and the recommendation of the same search on one core, a Hugging Face model with
    checkpointing among the candidates included (each build has a config of its own)."""
    pytest.importorskip("transformers")
    args = ["plan", "--model", "hf:llama", "--hf-overrides", LLAMA_OVERRIDES, "--json"]
    args += ["--seq-len", "64", "--batch", "2", "--nproc", "4", "--cluster", "cpu-dev"]
    args += ["--memory-budget", "3.6MiB"]
    side_by_side = planner.submit(run_cli, args).result()
    one_by_one = planner.submit(run_cli_on_one_core, args).result()
    assert side_by_side[0] == one_by_one[0] == 0, side_by_side
    found, expected = json.loads(side_by_side[1]), json.loads(one_by_one[1])
    assert found == expected
    assert found["recommended"] is not None and len(found["candidates"]) > 6


def test_hybrid_candidates_try_every_sharding_factor(planner: ProcessPoolExecutor) -> None:
    """Across 4 hosts of 2 ranks the hybrid strategies are planned sharded over one host
    (F = 2) and over two (F = 4): the wider shard holds less between steps."""
    args = ["plan", "--layers", "2", "--dim", "64", "--seq-len", "32", "--batch", "2"]
    args += ["--nproc", "2", "--hosts", "4", "--cluster", "cpu-dev", "--memory-budget", "device"]
    code, out, _ = planner.submit(run_cli, [*args, "--json"]).result()
    assert code == 0
    rest = {c["setup"]: c["at_rest_bytes"] for c in json.loads(out)["candidates"]}
    for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        assert rest[f"{strategy} (F=4)"] < rest[f"{strategy} (F=2)"] < rest["NO_SHARD"]
    assert "(F=8)" not in out  # F = W is FULL_SHARD


def test_plan_command_prints_json_and_recommends_within_a_budget(
    planner: ProcessPoolExecutor, tmp_path: Path
) -> None:
    args = ["plan", "--layers", "2", "--dim", "64", "--seq-len", "32", "--batch", "2"]
    args += ["--nproc", "2", "--cluster", "h100-80gb"]

    def cli(*more: str) -> tuple[int, str, str]:
        return planner.submit(run_cli, [*args, *more]).result()

    chart = tmp_path / "memory.png"
    code, out, _ = cli("--json", "--chart", str(chart))
    assert code == 0 and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    planned = json.loads(out)
    assert planned["peak_memory_bytes"] > planned["at_rest_bytes"] > 0
    assert planned["step_time_s"] > 0 and planned["fits"] is True
    code, out, _ = cli("--memory-budget", "2GiB", "--json")
    budget = json.loads(out)
    assert code == 0 and budget["recommended"] is not None and len(budget["candidates"]) == 6
    code, out, _ = cli("--memory-budget", "10MiB")
    assert code == 1 and "nothing fits" in out  # below the 1 GiB context
    code, _, err = cli("--memory-budget", "lots")
    assert code == 2 and "--memory-budget" in err


def test_plan_misuse_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--strategy", "SHARD_GRAD_OP", "--sharding-factor", "2"]) == 2
    err = capsys.readouterr().err
    assert "--sharding-factor only applies to hybrid strategies, not SHARD_GRAD_OP" in err
    assert main(["plan", "--strategy", "NO_SHARD", "--keep-gathered", "1"]) == 2
    err = capsys.readouterr().err
    assert "--keep-gathered applies to FULL_SHARD and HYBRID_SHARD, not NO_SHARD" in err
    with pytest.raises(ValueError, match="unknown cluster 'tpu-v9'; expected one of a100-80gb"):
        flatshard.plan(lambda: nn.Linear(2, 2), lambda: (torch.randn(1, 2),), cluster="tpu-v9")
    linear = partial(nn.Linear, 2, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must be >= 1 and divide the 8 ranks"):
        flatshard.plan(linear, lambda: (torch.randn(1, 2),), tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel with HYBRID_SHARD is not planned yet"):
        flatshard.plan(linear, tokens, tensor_parallel=2, strategy=S.HYBRID_SHARD)
    with pytest.raises(ValueError, match=r"placement Experts\(degree=2\) is not planned"):
        flatshard.plan(linear, tokens, placement=flatshard.Experts(2))


def test_adafactor_is_refused_by_name_before_planning() -> None:
    with pytest.raises(ValueError, match=r"optimizer 'adafactor' cannot be planned"):
        flatshard.plan(gpt, tokens, loss=language_model_loss, optimizer="adafactor")


def test_accumulation_modes_are_planned_apart(planner: ProcessPoolExecutor) -> None:
    """HYBRID_SHARD 2 x 2, 2 micro-batches: "reduce" reduce-scatters each unit every
    micro-batch (2 x units) where no_sync does once (units), all-reduces across hosts once
    per step in both (units, plus the clip's norm), and holds sharded gradients instead of
    unsharded ones: a lower peak."""
    plans = {
        mode: planner.submit(
            flatshard.plan,
            gpt,
            tokens,
            loss=language_model_loss,
            auto_wrap_policy={GPTBlock},
            hosts=2,
            ranks_per_host=2,
            strategy=S.HYBRID_SHARD,
            grad_accum=2,
            accumulation=mode,
        ).result()
        for mode in ("no_sync", "reduce")
    }
    counts = {m: {c.kind: c.count for c in p.collectives} for m, p in plans.items()}
    units = plans["reduce"].units
    assert counts["no_sync"]["reduce_scatter"] == units
    assert counts["reduce"]["reduce_scatter"] == 2 * units
    assert counts["reduce"]["all_reduce"] == counts["no_sync"]["all_reduce"] == units + 1
    assert plans["reduce"].peak_memory_bytes < plans["no_sync"].peak_memory_bytes
    with pytest.raises(ValueError, match="accumulation must be 'no_sync' or 'reduce'"):
        flatshard.plan(gpt, tokens, accumulation="keep")


def _nccl_plan(planner: ProcessPoolExecutor, inputs: Any, sparse: bool) -> flatshard.Plan:
    """The GPT planned at 2 ranks on NCCL (gloo reduce-scatters by all-to-all)."""
    planned: flatshard.Plan = planner.submit(
        flatshard.plan,
        gpt,
        inputs,
        loss=language_model_loss,
        auto_wrap_policy={GPTBlock},
        cluster="a100-80gb",
        ranks_per_host=2,
        placement=flatshard.RowSparse() if sparse else None,
    ).result()
    return planned


def test_row_sparse_tables_are_planned_with_every_token_distinct(
    planner: ProcessPoolExecutor,
) -> None:
    """A plan's lookups take every token id distinct (the most a batch can move): the
    token table's four all-to-alls (ids and rows, forward and backward) are that many ids
    and rows; a batch that holds the whole vocabulary is planned dense (no all-to-all)."""
    dense, sparse = (_nccl_plan(planner, tokens, on) for on in (False, True))
    assert (sparse.setup.placement, dense.setup.placement) == (flatshard.RowSparse(), None)
    assert "all_to_all" not in {c.kind for c in dense.collectives}
    rows = [op for op in sparse.ops if op.collective == "all_to_all"]
    n = BATCH * SEQ  # 128 distinct ids of 256, fp32 rows of width 64
    assert sorted(op.io_bytes for op in rows) == sorted([n * 8, n * 64 * 4] * 2)
    whole = _nccl_plan(planner, many_tokens, True)
    assert not [op for op in whole.ops if op.collective == "all_to_all"]


def test_reshard_after_forward_is_priced(planner: ProcessPoolExecutor) -> None:
    """set_reshard_after_forward(False) on FULL_SHARD: the plan drops backward's
    all-gathers (the same count as SHARD_GRAD_OP's) and holds more at its peak."""
    options = {"loss": language_model_loss, "auto_wrap_policy": {GPTBlock}, "ranks_per_host": 2}

    def planned(**extra: Any) -> flatshard.Plan:
        done = planner.submit(flatshard.plan, gpt, tokens, **options, **extra)
        plan: flatshard.Plan = done.result()
        return plan

    def gathers(plan: flatshard.Plan) -> int:
        return sum(c.count for c in plan.collectives if c.kind == "all_gather")

    default, kept = planned(), planned(reshard_after_forward=False)
    zero2 = planned(strategy=flatshard.ShardingStrategy.SHARD_GRAD_OP)
    assert gathers(kept) == gathers(zero2) < gathers(default)
    assert kept.peak_memory_bytes > default.peak_memory_bytes
    assert kept.to_json()["reshard_after_forward"] is False


def test_unshard_in_backward_is_priced(planner: ProcessPoolExecutor) -> None:
    """set_unshard_in_backward(table, False) on the two embedding units: the plan drops
    their backward all-gathers, one each per step, and nothing else."""
    options = {
        "loss": language_model_loss,
        "auto_wrap_policy": {GPTBlock, nn.Embedding},
        "ranks_per_host": 2,
    }

    def gathers(**extra: Any) -> int:
        plan: flatshard.Plan = planner.submit(
            flatshard.plan, untied_gpt, tokens, **options, **extra
        ).result()
        return sum(c.count for c in plan.collectives if c.kind == "all_gather")

    assert gathers() - gathers(no_unshard_in_backward=("tok", "pos")) == 2


def test_reshard_after_forward_to_a_host_and_separate_reductions_are_priced(
    planner: ProcessPoolExecutor,
) -> None:
    """2 hosts x 2 ranks on NCCL: set_reshard_after_forward(model, 2) keeps backward's
    all-gathers inside a host (as many, cheaper, more memory: half of each unit kept);
    set_separate_reduce_scatter_group puts the reductions on a stream of their own (the
    same collectives, a step no slower)."""
    planned = partial(_two_hosts, planner, 2)
    default, to_host = planned(), planned(reshard_after_forward=2)
    assert gathers(default).links == "inter-host"
    assert "intra-host" in gathers(to_host).links
    assert gathers(to_host).count == gathers(default).count
    assert gathers(to_host).seconds < gathers(default).seconds
    assert to_host.peak_memory_bytes > default.peak_memory_bytes
    assert to_host.to_json()["reshard_after_forward"] == 2
    separate = planned(separate_reduce_scatter_group=True)
    assert [(c.kind, c.count) for c in separate.collectives] == [
        (c.kind, c.count) for c in default.collectives
    ]
    assert separate.step.seconds <= default.step.seconds
    assert separate.to_json()["separate_reduce_scatter_group"] is True


def test_quantized_gathers_are_priced(planner: ProcessPoolExecutor) -> None:
    """MixedPrecision(gather_dtype=...): the all-gathers (int8: and one for the exact
    embedding tables), their bytes by the codec's format (one byte per element, a float32
    scale per row of 64, vectors and tables in fp32), and a faster step on a cluster whose
    links bound it."""
    planned = partial(_two_hosts, planner, 1)
    plain, bf16, int8 = (
        planned(),
        planned(gather_dtype=torch.bfloat16),
        planned(gather_dtype=torch.int8),
    )
    # int8: the root's embedding tables travel exact, a group of their own: one gather more
    assert gathers(plain).count == gathers(bf16).count == gathers(int8).count - 1
    # bf16: half of fp32's bytes (the 8-byte digests of the step check aside)
    assert abs(gathers(bf16).bytes / gathers(plain).bytes - 0.5) < 0.01
    # int8: the matrices at (1 + 4 / 64) / 4 of fp32's bytes, the vectors and tables at 1
    ratio = gathers(int8).bytes / gathers(plain).bytes
    assert 0.26 < ratio < 0.4, ratio
    assert gathers(int8).bytes < gathers(bf16).bytes
    # bf16 is faster where the links bound the gathers; int8's extra gather (the tables)
    # costs more latency than its bytes save on a model this small
    assert gathers(bf16).seconds < gathers(plain).seconds


MOE_WIDTH, MOE_HIDDEN, MOE_LAYERS = 64, 96, 2


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=MOE_WIDTH,
        intermediate_size=MOE_HIDDEN,
        num_hidden_layers=MOE_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(config)


def test_a_float32_mixture_of_experts_is_planned_with_its_grouped_matmuls(
    planner: ProcessPoolExecutor,
) -> None:
    """Hugging Face's Mixtral multiplies its experts with ``torch._grouped_mm`` in the
    model's dtype. Before: a float32 plan stopped at the first expert with torch's meta
    error "Expected inputs of BF16 type" (the CPU kernel multiplies float32); and a bf16
    plan priced no FLOPs for the experts (torch's FLOP counter has no formula for it).
    Each token meets 2 experts: forward 3 matmuls of tokens x width x hidden, backward
    twice that, per layer."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    plan: flatshard.Plan = planner.submit(
        flatshard.plan,
        mixtral,
        tokens,
        loss=language_model_loss,
        auto_wrap_policy={MixtralDecoderLayer},
        ranks_per_host=2,
    ).result()
    grouped = [op for op in plan.ops if op.name == "aten._grouped_mm"]
    assert {op.dtype for op in grouped} == {torch.float32}
    routed = BATCH * SEQ * 2
    assert sum(op.flops for op in grouped) == 2 * 9 * routed * MOE_WIDTH * MOE_HIDDEN * MOE_LAYERS


def _two_hosts(planner: ProcessPoolExecutor, ranks_per_host: int, **extra: Any) -> flatshard.Plan:
    """The GPT planned on 2 hosts of the a100-80gb cluster (NCCL), with ``extra``."""
    options = {"loss": language_model_loss, "auto_wrap_policy": {GPTBlock}, "hosts": 2}
    plan: flatshard.Plan = planner.submit(
        flatshard.plan,
        gpt,
        tokens,
        cluster="a100-80gb",
        ranks_per_host=ranks_per_host,
        **options,
        **extra,
    ).result()
    return plan


def gathers(plan: flatshard.Plan) -> Any:
    return next(c for c in plan.collectives if c.kind == "all_gather")


def test_plan_prices_pipeline_stages(planner: ProcessPoolExecutor) -> None:
    """--pp: every pipeline rank's memory and work, the bubble by schedule (zero-bubble's a
    third of 1F1B's, interleaved's 2P stages over the same ranks), the sends; GPipe holds
    every micro-batch in flight, 1F1B P - r on rank r."""
    base = ["plan", "--layers", "4", "--dim", "64", "--seq-len", "64", "--batch", "2"]
    base += ["--nproc", "4", "--cluster", "cpu-dev", "--pp", "2", "--microbatches", "4"]
    code, out, err = planner.submit(run_cli, [*base, "--pp-schedule", "1f1b"]).result()
    assert code == 0, err
    assert "pipeline: 2 stages on 2 ranks (1f1b, 4 micro-batches a step)" in out, out
    assert re.search(r"bubble: [0-9.]+ ms, [0-9.]+% of the step; sends:", out), out
    plans = {}
    for schedule in ("gpipe", "1f1b", "interleaved", "zero-bubble"):
        code, out, err = planner.submit(
            run_cli, [*base, "--pp-schedule", schedule, "--json"]
        ).result()
        assert code == 0, err
        plans[schedule] = json.loads(out)["pipeline"]
    assert [r["in_flight"] for r in plans["gpipe"]["per_rank"]] == [4, 4]
    assert [r["in_flight"] for r in plans["1f1b"]["per_rank"]] == [2, 1]
    assert [r["stages"] for r in plans["interleaved"]["per_rank"]] == [[0, 2], [1, 3]]
    gpipe, one_f_one_b = plans["gpipe"]["per_rank"][0], plans["1f1b"]["per_rank"][0]
    assert gpipe["peak_memory_bytes"] > one_f_one_b["peak_memory_bytes"]
    assert plans["zero-bubble"]["bubble_s"] == pytest.approx(plans["1f1b"]["bubble_s"] / 3)
    assert 0 < plans["zero-bubble"]["bubble_fraction"] < plans["1f1b"]["bubble_fraction"]


def test_the_budget_search_plans_pipelines_across_hosts(planner: ProcessPoolExecutor) -> None:
    """Across hosts the budget search also cuts the GPT into pipeline stages (P dividing
    the hosts, 1F1B, P x --grad-accum micro-batches); a pipelined recommendation gives
    train's --pp flags."""
    args = ["plan", "--layers", "4", "--dim", "64", "--seq-len", "64", "--batch", "2"]
    args += ["--nproc", "2", "--hosts", "2", "--cluster", "cpu-dev", "--memory-budget", "device"]
    code, out, err = planner.submit(run_cli, [*args, "--json"]).result()
    assert code == 0, err
    labels = [c["setup"] for c in json.loads(out)["candidates"]]
    assert "FULL_SHARD, 2 pipeline stages (1f1b, 2 micro-batches)" in labels, labels
    assert sum("pipeline stages" in label for label in labels) == 2  # with checkpointing too
    from flatshard.cli.plan.command import PlanConfig, planned_train_flags

    config = PlanConfig(layers=4, grad_accum=2)
    pipe = config.pipeline(2, 4, "1f1b")
    assert "--grad-accum" not in planned_train_flags(config, 2, pipe)
    assert "--grad-accum 2" in planned_train_flags(config, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "2", "--model", "hf:gpt2"], "--pp only applies to --model gpt"),
        (["--pp", "3"], "--pp (3) must divide --layers (4) into 3 stages"),
        (["--pp", "2", "--microbatches", "1"], "--microbatches (1) for --pp 2"),
        (
            ["--pp", "2", "--microbatches", "2", "--memory-budget", "1GiB"],
            "--memory-budget is not planned with --pp",
        ),
        (["--pp-schedule", "dualpipe"], "--pp-schedule must be one of gpipe, 1f1b"),
        (
            ["--pp", "2", "--microbatches", "2", "--nproc", "3", "--cluster", "cpu-dev"],
            "the pipeline's 2 ranks must divide the world (3 ranks)",
        ),
    ],
)
def test_plan_refuses_pipelines_it_cannot_price(
    planner: ProcessPoolExecutor, argv: list[str], message: str
) -> None:
    code, _, err = planner.submit(run_cli, ["plan", *argv]).result()
    assert code == 2 and message in err, err
