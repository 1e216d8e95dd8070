"""Lightning's Trainer (``FlatshardStrategy``) and Fabric (``FlatshardFabricStrategy``) on
a flatshard-sharded model, against strategy="ddp".

The runs (``lightning_script.py``, ``fabric_script.py``) are launched as a user launches
Lightning: the script starts, and ``devices=2`` starts the second rank itself. One launch
per script runs every scenario, since each launch costs Lightning's and torch's imports
on both ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import flatshard
from flatshard.testing.scripts import run_script, run_scripts_together

L = pytest.importorskip("lightning")
from flatshard.integrations.lightning import (  # noqa: E402
    FlatshardFabricStrategy,
    FlatshardPrecision,
    FlatshardStrategy,
)

SCRIPT = Path(__file__).with_name("lightning_script.py")
FABRIC_SCRIPT = Path(__file__).with_name("fabric_script.py")
STEPS = 4  # lightning_script.STEPS
TOLERANCE = 1e-5


def _launch(script: Path, out: Path, name: str, *args: str) -> list[dict[str, Any]]:
    run_script(script, str(out), *args, cwd=out)  # devices=2: Lightning starts rank 1
    return [json.loads((out / f"{name}{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(SCRIPT, tmp_path_factory.mktemp("lightning"), "rank")


@pytest.fixture(scope="module")
def standalone_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("pytorch_lightning")
    return _launch(SCRIPT, tmp_path_factory.mktemp("pl"), "rank", "pytorch_lightning")


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(FABRIC_SCRIPT, tmp_path_factory.mktemp("fabric"), "fabric")


def _close(mine: list[float], theirs: list[float]) -> bool:
    return len(mine) == len(theirs) and all(
        abs(a - b) <= TOLERANCE for a, b in zip(mine, theirs, strict=True)
    )


@pytest.mark.parametrize("kind", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "offload"])
def test_training_matches_ddp_with_clipping(runs: list[dict[str, Any]], kind: str) -> None:
    for rank, run in enumerate(runs):
        ddp, mine = run["ddp"], run[kind]
        assert _close(mine["losses"], ddp["losses"]), (rank, mine["losses"], ddp["losses"])
        assert abs(mine["val_loss"] - ddp["val_loss"]) <= TOLERANCE  # trainer.validate
        # Each rank saw its own batches (a DistributedSampler), as under DDP.
    assert runs[0]["ddp"]["losses"] != runs[1]["ddp"]["losses"]


def test_a_barrier_or_broadcast_that_differs_by_rank_is_named(runs: list[dict[str, Any]]) -> None:
    """Before: Lightning's barrier and broadcast went straight to torch.distributed (a save
    on rank 0 only met rank 1's exit as gloo's "Connection closed by peer"; validation on
    one rank hung to the timeout). Now the ranks agree on each through the store first."""
    for rank, run in enumerate(runs):
        barrier, broadcast = run["disagreements"]
        assert "rank 0: Lightning's strategy.barrier(rank 0)" in barrier, barrier
        assert "rank 1: Lightning's strategy.barrier(rank 1)" in barrier, barrier
        assert f"rank {rank}: Lightning's strategy.broadcast(src={rank})" in broadcast


def test_clipping_acted(runs: list[dict[str, Any]]) -> None:
    # Without it the losses part from the second step on: the parity above covers clipping.
    for run in runs:
        unclipped, clipped = run["ddp_unclipped"]["losses"], run["ddp"]["losses"]
        assert abs(unclipped[1] - clipped[1]) > 100 * TOLERANCE


def test_accumulation_matches_ddp(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        mine, ddp = run["flatshard_accumulate"], run["ddp_accumulate"]
        assert _close(mine["losses"], ddp["losses"])
        assert abs(mine["val_loss"] - ddp["val_loss"]) <= TOLERANCE


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_from_a_checkpoint_continues_as_ddp_does(
    runs: list[dict[str, Any]], state_dict_type: str
) -> None:
    for run in runs:
        resumed, ddp = run[f"resumed_{state_dict_type}"], run["ddp_resumed"]
        assert _close(resumed["losses"], ddp["losses"]), (resumed["losses"], ddp["losses"])
        assert abs(resumed["val_loss"] - ddp["val_loss"]) <= TOLERANCE
        # The first resumed step is the uninterrupted run's third: weights and data restored
        assert abs(resumed["losses"][0] - run["FULL_SHARD"]["losses"][2]) <= TOLERANCE
    assert runs[0][f"kind_{state_dict_type}"] == ("dir" if state_dict_type == "sharded" else "file")


def test_async_checkpoints_resume_as_synchronous_ones(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert run["resumed_async"]["bg"] and run["async_every_step"]["bg"]
        assert not run["resumed_sharded"]["bg"]
        assert run["resumed_async"]["losses"] == run["resumed_sharded"]["losses"]
        assert run["resumed_async"]["val_loss"] == run["resumed_sharded"]["val_loss"]
    # ModelCheckpoint(save_top_k=1) saved at every step and removed the one before, each
    # removal waiting for the newer save: the last one alone is left, whole
    assert runs[0]["async_kept"] == [f"epoch=1-step={STEPS}.ckpt"], runs[0]["async_kept"]
    assert runs[0]["removed_with_a_whole_one_left"] == [True] * (STEPS - 1)


def test_a_model_built_on_meta_in_configure_model(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        meta, ddp = run["meta"], run["ddp_init"]  # ddp: the same init on a plain model
        assert not meta["meta_left"]
        assert _close(meta["losses"], ddp["losses"])


def test_bf16_mixed_computes_in_bf16(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        low, full = run["bf16"]["losses"], run["FULL_SHARD"]["losses"]
        assert abs(low[0] - full[0]) < 0.05
        assert all(float(torch.tensor(x).bfloat16()) == x for x in low)  # a bf16 loss


def test_fp16_mixed_scales_the_loss(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        low, full = run["fp16"]["losses"], run["FULL_SHARD"]["losses"]
        assert abs(low[0] - full[0]) < 0.05
        assert all(float(torch.tensor(x).half()) == x for x in low)  # an fp16 loss
        # The first backward overflowed fp16 at the initial scale 2**16: every rank skipped
        # that step and the scaler halved the scale (agreed across ranks); the next did not
        assert run["fp16_scale"] == 2.0**15


def test_fabric_matches_ddp_with_accumulation_and_clipping(
    fabric_runs: list[dict[str, Any]],
) -> None:
    for run in fabric_runs:
        assert _close(run["flatshard"], run["ddp"]), (run["flatshard"], run["ddp"])
    assert fabric_runs[0]["ddp"] != fabric_runs[1]["ddp"]  # each rank its own batches


def test_fabric_save_and_load_resume_exactly(fabric_runs: list[dict[str, Any]]) -> None:
    for run in fabric_runs:
        assert _close(run["resumed"], run["flatshard"][4:])  # optimizer steps 3 and 4
    assert fabric_runs[0]["kind"] == "dir"


# ---------------------------------------------------------------- pytorch_lightning
def test_the_standalone_package_trains_accumulates_and_resumes_as_ddp(
    standalone_runs: list[dict[str, Any]],
) -> None:
    """``pytorch_lightning.Trainer`` with ``flatshard.integrations.pytorch_lightning``'s
    strategy (the same code, on that package's classes) against its own ``ddp``."""
    for run in standalone_runs:
        assert run["strategy_class"].startswith("pytorch_lightning."), run["strategy_class"]
        assert _close(run["FULL_SHARD"]["losses"], run["ddp"]["losses"])
        assert _close(run["flatshard_accumulate"]["losses"], run["ddp_accumulate"]["losses"])
        assert _close(run["resumed_sharded"]["losses"], run["ddp_resumed"]["losses"])
        assert abs(run["FULL_SHARD"]["val_loss"] - run["ddp"]["val_loss"]) <= TOLERANCE


def test_where_only_pytorch_lightning_is_installed_the_lightning_module_uses_it() -> None:
    """``flatshard.integrations.lightning`` takes whichever Lightning is installed: with
    ``lightning`` not importable, its strategies derive from ``pytorch_lightning``'s."""
    pytest.importorskip("pytorch_lightning")
    probe = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'lightning' or name.startswith('lightning.'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pytorch_lightning, lightning_fabric\n"
        "from flatshard.integrations.lightning import FlatshardStrategy, "
        "FlatshardFabricStrategy\n"
        "assert issubclass(FlatshardStrategy, pytorch_lightning.strategies.Strategy)\n"
        "assert issubclass(FlatshardFabricStrategy, lightning_fabric.strategies.Strategy)\n"
        "assert 'lightning' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


# ---------------------------------------------------------------- options and misuse
@pytest.mark.parametrize(
    ("script", "reference", "key"),
    [(SCRIPT, "runs", "ddp_unclipped"), (FABRIC_SCRIPT, "fabric_runs", "ddp")],
    ids=["trainer", "fabric"],
)
def test_replica_groups_on_torchft_train_as_ddp(
    script: Path, reference: str, key: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two Trainers (or Fabrics, with accumulation and clipping) of one rank each, replica
    groups 0 and 1 of a run on torchft (``replica_groups=ReplicaGroups(2, g, lighthouse)``):
    each trains as rank g of the 2-rank DDP run (its batches, the average of both
    gradients), and both end with bitwise-equal parameters."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    ddp = request.getfixturevalue(reference)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    try:
        groups = [["replica", str(g), lighthouse.address()] for g in range(2)]
        run_scripts_together(script, [[str(tmp_path), *args] for args in groups], tmp_path)
    finally:
        lighthouse.shutdown()
    replicas = [json.loads((tmp_path / f"replica{g}.json").read_text()) for g in range(2)]
    for group, replica in enumerate(replicas):
        theirs = ddp[group][key]  # the Trainer's run: a dict; Fabric's: its losses
        losses = theirs["losses"] if isinstance(theirs, dict) else theirs
        assert _close(replica["losses"], losses), group
    assert replicas[0]["params"] == replicas[1]["params"]


def test_a_replica_group_that_starts_late_heals_from_a_live_one(tmp_path: Path) -> None:
    """Group 1 starts once group 0 has taken two steps alone: at its first quorum it heals
    from group 0 (model, optimizer, Lightning's step count and learning-rate schedule), the
    two train on together, and both end at the same step with bitwise-equal parameters."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000
    )
    try:
        groups = [["replica", str(g), lighthouse.address(), "late"] for g in range(2)]
        run_scripts_together(SCRIPT, [[str(tmp_path), *args] for args in groups], tmp_path)
    finally:
        lighthouse.shutdown()
    first, late = [json.loads((tmp_path / f"replica{g}.json").read_text()) for g in range(2)]
    assert first["global_step"] == late["global_step"] == 12
    assert 2 <= 12 - len(late["losses"]) < 12, late["losses"]  # healed at step 2 or later
    assert first["lr"] == late["lr"]
    assert first["params"] == late["params"]


def test_precision_settings_map_to_flatshard() -> None:
    policy = FlatshardPrecision("bf16-mixed").mixed_precision
    assert policy == flatshard.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert FlatshardPrecision("32-true").mixed_precision is None
    assert isinstance(FlatshardPrecision("16-mixed").scaler, flatshard.ShardedGradScaler)
    assert FlatshardPrecision("bf16-true").convert_module(torch.nn.Linear(2, 2)).weight.dtype == (
        torch.bfloat16
    )
    strategy = FlatshardStrategy()
    strategy.precision_plugin = L.pytorch.plugins.precision.MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, FlatshardPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"


def test_fabric_needs_the_model_set_up_before_its_optimizer() -> None:
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"set the model up before building its optimizer"):
        FlatshardFabricStrategy().setup_module_and_optimizers(model, [optim])


def test_unsupported_settings_are_named_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"plugin DoublePrecision \(precision='64-true'\); pass precision= one of 32-true",
    ):
        FlatshardStrategy().precision_plugin = L.pytorch.plugins.precision.DoublePrecision()
    with pytest.raises(ValueError, match=r"state_dict_type='local'"):
        FlatshardStrategy(state_dict_type="local")
    with pytest.raises(TypeError, match=r"sets \['device'\] itself"):
        FlatshardStrategy(device="cpu")
    with pytest.raises(TypeError, match=r"got \['sharding_factr'\], which"):
        FlatshardStrategy(sharding_factr=2)
    with pytest.raises(ValueError, match=r"takes no gradient scaler"):
        FlatshardPrecision("bf16-mixed", scaler=flatshard.ShardedGradScaler())
