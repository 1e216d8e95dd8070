"""Misuse that used to be silently wrong is now an error naming what and how to fix it.

- A model changed after ``fully_shard`` (parameters added, replaced or frozen, as peft's
  ``get_peft_model`` applied after sharding does): the new parameters were never reduced,
  so ranks drifted apart, and frozen ones kept getting gradients.
- Plain ``state_dict()`` / ``load_state_dict()`` of a sharded model: this rank's rows under
  the full names, so ``torch.save(model.state_dict())`` wrote a truncated model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing.jobs import shard_units
from flatshard.testing.models import build
from flatshard.testing.workers import WorkerContext, WorkerPool


def _forward(model: nn.Module) -> None:
    batch = cast(Any, model).make_batch(torch.Generator().manual_seed(0), 4)
    cast(Any, model).loss(batch).backward()


def _error_of(action: Callable[[], object]) -> str:
    try:
        action()
    except RuntimeError as error:
        return str(error)
    return "no error"


# ---------------------------------------------------------------- model changed after sharding
def _add_lora(model: nn.Module) -> None:
    """What peft's get_peft_model does to a block: freeze the base, add trainable weights."""
    blocks = cast(nn.ModuleList, cast(Any, model).blocks)
    for param in model.parameters():
        param.requires_grad_(False)
    blocks[0].lora_a = nn.Linear(16, 2, bias=False)


def _replace_weight(model: nn.Module) -> None:
    block = cast(Any, model).blocks[1]
    block.mlp[0].weight = nn.Parameter(torch.zeros_like(block.mlp[0].weight))


def changed_model_job(ctx: WorkerContext, change: str) -> str | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = shard_units(build("gpt"), group, "FULL_SHARD")
    _forward(model)  # a first step that is fine
    if change == "freeze":
        cast(Any, model).blocks[0].attn.qkv.weight.requires_grad_(False)
    elif change == "lora":
        _add_lora(model)
    elif change == "replace":
        _replace_weight(model)
    elif change == "unrelated":
        nn.Linear(4, 4)  # registers parameters elsewhere in the process: nothing to report
    elif change == "same device":
        model.to("cpu")  # the parameters' own device: torch keeps them as they are
    elif change in ("moved", "cast"):
        # What the Hugging Face Trainer did: "cpu:0" compares unequal to "cpu", so torch
        # copies every parameter, and the optimizer would step copies forward never reads
        model.to("cpu:0") if change == "moved" else model.double()
    elif change == "meta":  # torch replaces each parameter without registration hooks
        model.to("meta")
    elif change in ("post-accumulate hook", "gradient hook"):  # e.g. an optimizer step per
        weight = cast(Any, model).blocks[0].attn.qkv.weight  # parameter in backward
        if change == "gradient hook":
            weight.register_hook(lambda grad: grad.clamp(-1e-3, 1e-3))
        else:
            weight.register_post_accumulate_grad_hook(lambda param: None)
    elif change == "replaced inside a unit":  # by a hook of the user's, during forward
        block = cast(Any, model).blocks[1]
        block.mlp[0].register_forward_pre_hook(lambda module, args: _replace_weight(model))
    return _error_of(lambda: _forward(model))


def test_frozen_after_sharding_is_named(pool: WorkerPool) -> None:
    for message in pool.run(changed_model_job, "freeze")[:2]:
        assert "requires_grad changed after fully_shard" in message, message
        assert "'blocks.0.attn.qkv.weight' (now False)" in message
        assert "before calling it" in message and "get_peft_model" in message


def test_parameters_added_after_sharding_are_named(pool: WorkerPool) -> None:
    # Freezing comes first in the lora change, and is found first.
    for message in pool.run(changed_model_job, "lora")[:2]:
        assert "requires_grad changed after fully_shard" in message, message


def test_parameters_replaced_after_sharding_are_named(pool: WorkerPool) -> None:
    for message in pool.run(changed_model_job, "replace")[:2]:
        assert "parameters changed after fully_shard" in message, message
        assert "added or replaced: 'blocks.1.mlp.0.weight'" in message
        assert "no longer in the model: 'blocks.1.mlp.0.weight'" in message


def test_a_parameter_replaced_during_its_units_forward_is_named(pool: WorkerPool) -> None:
    """Before: the unit's post-forward put its own entries back over the parameter a hook
    of the user's had set: the replacement was dropped, silently (outputs off the unsharded
    model's from the next step on). Found at the next forward only when made outside
    every unit's forward."""
    for message in pool.run(changed_model_job, "replaced inside a unit")[:2]:
        assert "parameters changed after fully_shard" in message, message
        assert "added or replaced: 'blocks.1.mlp.0.weight'" in message, message


@pytest.mark.parametrize("change", ["post-accumulate hook", "gradient hook"])
def test_a_gradient_hook_on_a_sharded_parameter_is_named(pool: WorkerPool, change: str) -> None:
    """Before: never run, silently (forward computes with gathered copies): torch's
    optimizer-in-backward recipe trained nothing, a gradient clamp clamped nothing."""
    for message in pool.run(changed_model_job, change)[:2]:
        assert "gradient hooks on sharded parameters" in message, message
        assert "'blocks.0.attn.qkv.weight'" in message, message
        assert "Step the optimizer after loss.backward()" in message, message


def deepcopy_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = shard_units(build("gpt"), group, "FULL_SHARD")
    try:
        copy.deepcopy(model)  # an EMA model, torch's AveragedModel
    except TypeError as error:
        return str(error)
    return "no error"


def test_a_deep_copy_of_a_sharded_model_is_named(pool: WorkerPool) -> None:
    """Before: pickle's bare "cannot pickle 'ProcessGroup' object"."""
    for message in pool.run(deepcopy_job)[:2]:
        assert message.startswith("flatshard: a sharded model cannot be deep-copied"), message
        assert "full_state_dict" in message, message


def test_a_model_moved_or_cast_after_sharding_is_named(pool: WorkerPool) -> None:
    for change in ("moved", "cast", "meta"):  # meta before: torch's "not on the expected
        # device meta" from inside the model's forward
        for message in pool.run(changed_model_job, change)[:2]:
            assert "parameters were moved or cast after fully_shard" in message, message
            assert "'tok.weight'" in message and "before flatshard.fully_shard" in message
    assert pool.run(changed_model_job, "same device")[:2] == ["no error", "no error"]


def test_unrelated_registrations_are_not_changes(pool: WorkerPool) -> None:
    assert pool.run(changed_model_job, "unrelated")[:2] == ["no error", "no error"]


def added_only_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = shard_units(build("gpt"), group, "FULL_SHARD")
    cast(Any, model).blocks[0].lora_a = nn.Linear(16, 2, bias=False)
    return _error_of(lambda: _forward(model))


def test_parameters_added_alone_are_named(pool: WorkerPool) -> None:
    for message in pool.run(added_only_job)[:2]:
        assert "added or replaced: 'blocks.0.lora_a.weight'" in message, message
        assert "never be averaged across ranks" in message


# ---------------------------------------------------------------- plain state_dict
def plain_state_dict_job(ctx: WorkerContext, strategy: str) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = shard_units(build("gpt"), group, strategy)
    full = flatshard.full_state_dict(model, rank0_only=False)
    result: dict[str, Any] = {"save": _error_of(model.state_dict)}
    result["load"] = _error_of(lambda: model.load_state_dict(full))
    twice = {k: v * 2 if v.is_floating_point() else v for k, v in full.items()}
    with flatshard.summon_full_params(model):
        inside = model.state_dict()  # views of the gathered parameters: compare them now
        result["inside_matches"] = all(torch.equal(inside[k], full[k]) for k in full)
        model.load_state_dict(twice)  # written back to the shards on exit
    doubled = flatshard.full_state_dict(model, rank0_only=False)
    result["written_back"] = all(torch.equal(doubled[k], twice[k]) for k in full)
    return result


def test_plain_state_dict_of_a_sharded_model_is_an_error(pool: WorkerPool) -> None:
    for result in pool.run(plain_state_dict_job, "FULL_SHARD")[:2]:
        save, load = result["save"], result["load"]
        assert "state_dict() would return only this rank's rows" in save, save
        assert "'tok.weight' (" in save and "of (37, 16)" in save  # rows, and the full shape
        assert "flatshard.full_state_dict(model)" in save
        assert "load_state_dict() would load into this rank's rows" in load, load
        assert "flatshard.load_state_dict(model, state_dict)" in load
        assert result["inside_matches"] and result["written_back"]


def test_plain_state_dict_of_a_replicated_model_is_whole(pool: WorkerPool) -> None:
    for result in pool.run(plain_state_dict_job, "NO_SHARD")[:2]:
        assert result["save"] == "no error" and result["load"] == "no error"
        assert result["inside_matches"] and result["written_back"]
