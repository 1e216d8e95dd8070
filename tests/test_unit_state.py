"""A unit's state is owned, and only agreed events decide what it gathers (docs/design.md,
"Unit state"): held units across steps, writes flatshard cannot see, the process-wide
hooks' handles, a mismatch in the very last step, impossible moves."""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import tempfile
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad
from torch import nn
from torch.optim import optimizer as torch_optimizer

import flatshard
from flatshard.measure import ALL_GATHER, CollectiveTracker
from flatshard.testing.internals import Storage, TorchReach, storage_move
from flatshard.testing.internals import comm_agreement as ledger
from flatshard.testing.isolated import Died, run_isolated
from flatshard.testing.models import ReluLinear, build
from flatshard.testing.parity import ParityConfig, batches, shard_with_flatshard, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

WORLD = 2


def _blocks(model: Any) -> list[nn.Module]:
    return [*model.blocks, model]


def _sgd(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    if fused:  # one kernel writes the parameters: no version counter moves
        # eps well above fp32 noise: see make_optimizer in flatshard.testing.parity
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def held_across_steps_job(ctx: WorkerContext, optimizer: str) -> dict[str, Any] | None:
    """Every unit held by ``flatshard.unshard`` for three steps; between steps the model is
    used as if nothing were held: torch's clip, a child called alone, full and sharded
    state dicts, a checkpoint with the optimizer, a hand-written update."""
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=WORLD), group)
    reference: Any = build("gpt")
    for unit in _blocks(model):
        flatshard.unshard(unit)
    hand = optimizer == "by hand"
    optim = None if hand else _sgd(model, optimizer == "fused")
    ref_optim = None if hand else _sgd(reference, optimizer == "fused")
    probe = torch.randn(2, 16, generator=torch.Generator().manual_seed(5))
    found: dict[str, Any] = {"norms": [], "heads": [], "gathers": []}
    for batch in batches(reference, 3):
        with CollectiveTracker() as tracker:
            model.loss(slice_batch(batch, ctx.rank, WORLD)).backward()
        found["gathers"].append(tracker.counts.get(ALL_GATHER, 0))
        reference.loss(batch).backward()
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3) for m in (model, reference)]
        found["norms"].append([float(n) for n in norms])
        if optim is None:
            for m in (model, reference):
                for p in m.parameters():
                    p.data.add_(p.grad, alpha=-0.5)  # older code's update: no hook sees it
                    p.grad = None
        else:
            for o in (optim, cast(torch.optim.Optimizer, ref_optim)):
                o.step()
                o.zero_grad()
        with torch.no_grad():  # a child of a held unit, called alone after the step
            heads = [m.head(probe) for m in (model, reference)]
        found["heads"].append(float((heads[0] - heads[1]).abs().max()))
    full = flatshard.full_state_dict(model, rank0_only=False)
    found["state_dict"] = max(
        float((full[name] - value).abs().max()) for name, value in reference.named_parameters()
    )
    rows = flatshard.sharded_state_dict(model)["blocks.0.mlp.0.weight"]
    found["sharded_rows"] = tuple(cast(Any, rows).local.shape)
    with pytest.raises(RuntimeError, match="would return only this rank's rows"):
        model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt") if ctx.rank == 0 else ""
        paths = [path]
        dist.broadcast_object_list(paths, src=0, group=group)
        flatshard.save_checkpoint(paths[0], model, optim)
        dist.barrier(group)
    return found


@pytest.mark.parametrize("optimizer", ["sgd", "fused", "by hand"])
def test_units_held_across_steps_train_as_if_not_held(pool: WorkerPool, optimizer: str) -> None:
    """[Note: held units]: before, a held unit's modules kept the gathered views, so torch's
    clip saw no gradients (norm 0.0), state dicts returned the weights from before the step
    and a child called alone computed on them."""
    found = pool.run(held_across_steps_job, optimizer)[0]
    for sharded, reference in found["norms"]:
        assert sharded == pytest.approx(reference, rel=1e-5)
    assert max(found["heads"]) < 1e-5  # the child saw the step's weights
    assert found["state_dict"] < 1e-5
    assert found["sharded_rows"][0] == 64 // WORLD  # this rank's rows, not the full tensor
    # Held, nothing is gathered in forward or backward within a step; after each step the
    # shards were written, so the next step's first use gathers every unit once.
    units = len(_blocks(build("gpt")))
    assert found["gathers"][1:] == [found["gathers"][1]] * 2
    assert found["gathers"][1] >= units  # every unit gathered again after the step


def test_what_flatshard_installs_in_torch_is_removed_by_its_handle() -> None:
    """``TorchReach`` installs one optimizer step pre-hook, torch's gradient norm and its
    two ``zero_grad`` wrappers, and its ``remove`` leaves torch as it found it (the
    process-wide owner does so once no sharded model is alive)."""
    torch_norm = torch.nn.utils.get_total_norm
    private_norm = torch.nn.utils.clip_grad._get_total_norm
    with_norm = torch.nn.utils.clip_grads_with_norm_
    hooks = dict(torch_optimizer._global_optimizer_pre_hooks)
    zero_grads = (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad)
    reach = TorchReach()
    reach.install()
    reach.install()  # idempotent
    assert len(torch_optimizer._global_optimizer_pre_hooks) == len(hooks) + 1
    # (the process-wide owner may have installed it already: then it is the same function)
    assert torch.nn.utils.get_total_norm.__module__.startswith("flatshard.")
    assert torch.nn.utils.clip_grads_with_norm_.__module__.startswith("flatshard.")
    assert torch.optim.Optimizer.zero_grad is not zero_grads[0]
    assert nn.Module.zero_grad is not zero_grads[1]
    assert len(torch.nn.modules.module._global_module_registration_hooks) >= 1
    reach.remove()
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) == zero_grads
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == hooks
    assert torch.nn.utils.get_total_norm is torch_norm
    assert torch.nn.utils.clip_grad._get_total_norm is private_norm
    assert torch.nn.utils.clip_grads_with_norm_ is with_norm


def _torch_state() -> tuple[Any, ...]:
    """What flatshard may change in torch: its functions and its process-wide hook lists."""
    module_hooks = torch.nn.modules.module
    return (
        torch.nn.utils.get_total_norm,
        torch.nn.utils.clip_grad._get_total_norm,
        torch.nn.utils.clip_grads_with_norm_,
        torch.optim.Optimizer.zero_grad,
        nn.Module.zero_grad,
        tuple(torch_optimizer._global_optimizer_pre_hooks),
        tuple(module_hooks._global_parameter_registration_hooks),
        tuple(module_hooks._global_module_registration_hooks),
    )


def gone_with_the_last_model_job(rank: int) -> list[bool]:
    """Two sharded models train; torch is as before once both are deleted, not before."""
    before = _torch_state()
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        plain: Any = build("gpt")
        model = flatshard.fully_shard(plain, auto_wrap_policy=set(plain.UNIT_CLASSES))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, 37, (2, 9))).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        models.append(model)
    changed = _torch_state() != before
    del plain, model, optim
    models.pop()
    gc.collect()
    one_left = _torch_state() != before  # the first model still lives
    models.clear()
    gc.collect()
    return [changed, one_left, _torch_state() == before]


def test_torch_is_as_before_once_the_last_sharded_model_is_deleted() -> None:
    """Every hook and patch flatshard installs in torch has one owner (``TorchReach``),
    which removes them when no sharded model is alive: the process is plain torch again."""
    assert run_isolated(gone_with_the_last_model_job) == [[True, True, True]] * 2


def last_step_mismatch_job(rank: int, err_dir: str) -> str:
    """The accelerators' deferred digest (on gloo): the last step runs different units on
    each rank, and the program ends. The exit handlers compare it."""
    torch.manual_seed(0)
    experts = nn.Sequential(*[ReluLinear() for _ in range(4)])
    model = flatshard.fully_shard(experts, auto_wrap_policy={ReluLinear})
    with open(Path(err_dir) / f"rank{rank}.txt", "w") as err:
        os.dup2(err.fileno(), 2)
    with mock.patch.object(ledger, "defers_digest", lambda device: True):
        chosen = [0, 2] if rank == 0 else [1, 3]
        x = torch.randn(4, 8)
        sum((model[i](x) for i in chosen), torch.zeros(())).sum().backward()
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # the interpreter's exit, as at the end of the program
    return "exited without a word"


def test_a_mismatch_in_the_very_last_step_fails_the_run_at_exit(tmp_path: Path) -> None:
    outcomes = run_isolated(last_step_mismatch_job, str(tmp_path))
    assert outcomes == [Died(1), Died(1)]
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "flatshard: ranks issued different collectives in the last backward pass" in text
        assert f"seen on rank {rank} at exit" in text


def test_an_impossible_storage_move_names_the_group_and_both_states() -> None:
    assert storage_move(Storage.SHARDED, Storage.GATHERING, "w") is Storage.GATHERING
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' .* cannot go from GATHERING to SHARDED"):
        storage_move(Storage.GATHERING, Storage.SHARDED, "blocks.0.w")


def plain_beside_sharded_job(rank: int) -> list[bool]:
    """torch's own norm of a plain model's gradients, while a sharded model lives beside
    it: exactly torch's (the patched norm answers for flatshard's gradients only)."""
    torchs = torch.nn.utils.clip_grad._get_total_norm  # before any fully_shard here
    torch.manual_seed(0)
    plain: Any = build("gpt")
    sharded: Any = build("gpt")
    sharded = flatshard.fully_shard(sharded, auto_wrap_policy=set(sharded.UNIT_CLASSES))
    for model in (plain, sharded):
        model(torch.randint(0, 37, (2, 9))).sum().backward()
    patched = torch.nn.utils.clip_grad._get_total_norm is not torchs
    grads = [p.grad for p in plain.parameters() if p.grad is not None]
    want = torchs([g.clone() for g in grads], 2.0)
    got = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    return [patched, bool(torch.equal(got, want))]


def test_torch_norm_of_an_unsharded_model_beside_a_sharded_one_is_torchs() -> None:
    assert run_isolated(plain_beside_sharded_job) == [[True, True]] * 2


# ---------------------------------------------------------------- the state table
ROOT = Path(__file__).resolve().parent.parent
CORE = ("flat", "runtime", "sharding", "state", "comm")  # the layers that own unit state
# Each changing field of docs/design.md's "Unit state" table: the modules that may write it.
WRITERS: dict[str, set[str]] = {
    "Unit.state": {"runtime/_unit.py"},
    "Unit.hold": {"runtime/_unit.py", "runtime/_by_hand.py"},
    "Unit.config": {"runtime/_unit.py"},
    "StepContext.switches": {"runtime/_step.py", "runtime/_switches.py", "runtime/_pipeline.py"},
    "StepContext.schedule": {"runtime/_step.py", "runtime/_pipeline.py"},
    "FlatParamGroup.transport": {
        "flat/_flat_param.py",
        "runtime/_unit.py",
        "runtime/_switches.py",
        "runtime/_step.py",
    },
    "FlatParamGroup.storage": {"flat/_flat_param.py"},
    "FlatParamGroup.holding": {"flat/_flat_param.py", "placements/_row_sparse.py"},
    "FlatParamGroup.generation": {"flat/_flat_param.py"},
    "GradientReduction.owes": {"flat/_reduction.py"},
}


def _table_rows() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Unit state", 1)[1].split("\n\n", 2)[2]
    return {
        line.split("`")[1]
        for line in section.split("\n\n")[0].splitlines()
        if line.startswith("| `")
    }


def _writes(field: str) -> set[str]:
    """The core modules that assign ``<anything>.field``."""
    import ast

    found = set()
    for layer in CORE:
        for path in (ROOT / "src" / "flatshard" / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                if any(isinstance(t, ast.Attribute) and t.attr == field for t in targets):
                    found.add(f"{layer}/{path.relative_to(ROOT / 'src' / 'flatshard' / layer)}")
    return found


def test_the_state_table_names_each_field_and_its_only_writers() -> None:
    """design.md's table, the owners' fields and the modules that write them agree: a
    field written from a module the table does not name, or a row for a field its class
    does not have, fails."""
    from flatshard.testing.internals import owners_of_state

    assert _table_rows() == set(WRITERS), "design.md's Unit state table and WRITERS differ"
    owners = owners_of_state()
    for row, allowed in WRITERS.items():
        owner, field = row.split(".")
        source = inspect.getsource(owners[owner])
        assert f"self.{field}" in source, f"{owner} has no field '{field}'"
        extra = _writes(field) - allowed
        assert not extra, f"'{row}' is written in {sorted(extra)} too"
