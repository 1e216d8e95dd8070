"""Misuse gives a clear error naming what was expected, what was found and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import flatshard
from flatshard import comm_hooks
from flatshard.testing.models import GPTBlock, MLPBlock, TinyGPT, build


def test_needs_an_initialized_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        flatshard.fully_shard(nn.Linear(2, 2))


def test_twice_on_one_module(local_group: dist.ProcessGroup) -> None:
    model = flatshard.fully_shard(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"already sharded.*once per module"):
        flatshard.fully_shard(model)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without one")
def test_a_device_this_process_lacks_is_named(local_group: dist.ProcessGroup) -> None:
    """Before: torch's "Torch not compiled with CUDA enabled" from deep inside."""
    with pytest.raises(ValueError, match=r"device='cuda' \(rank 0\), but this process has no"):
        flatshard.fully_shard(nn.Linear(2, 2), device="cuda")
    with pytest.raises(ValueError, match=r"device='CPU' is not a device name torch knows"):
        flatshard.fully_shard(nn.Linear(2, 2), device="CPU")


def test_placement_must_be_a_placement_or_a_rule(local_group: dist.ProcessGroup) -> None:
    with pytest.raises(TypeError, match=r"placement must be a placement .* got 'yes'"):
        flatshard.fully_shard(nn.Linear(2, 2), placement="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rule returned 'whole' for 'weight' \(rank 0\)"):
        flatshard.fully_shard(nn.Linear(2, 2), placement=lambda n, p: "whole")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"whole_params must be True, False or a callable"):
        flatshard.fully_shard(nn.Linear(2, 2), whole_params="yes")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'whole_param'"):
        flatshard.fully_shard(nn.Linear(2, 2), whole_param=True)


def test_row_sparse_serves_embedding_weights_only(local_group: dist.ProcessGroup) -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    rule = lambda name, p: flatshard.RowSparse()  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"cannot serve '1\.weight' \(rank 0\): RowSparse\(\) serves nn\.Embedding "
        r"weights .* used by Linear",
    ):
        flatshard.fully_shard(model, placement=rule)


def test_inside_a_unit_of_an_earlier_call(local_group: dist.ProcessGroup) -> None:
    """Sharding a module after the module around it: its parameters are already views of
    the outer unit's shards (per rank, they would differ in size)."""
    model = build("gpt")
    block = next(m for m in model.modules() if isinstance(m, GPTBlock))
    flatshard.fully_shard(block)
    inner = next(m for m in block.children() if any(True for _ in m.parameters()))
    with pytest.raises(ValueError, match=r"inside the unit .* inner modules before") as error:
        flatshard.fully_shard(inner)
    assert f"{type(inner).__name__} ('" in str(error.value)


@pytest.mark.parametrize("blocks", [None, flatshard.SublayerPolicy({GPTBlock})])
def test_bad_sublayer_policy(blocks: Any) -> None:
    with pytest.raises(ValueError, match=r"takes the policy that chooses the blocks"):
        flatshard.SublayerPolicy(blocks)
    with pytest.raises(ValueError, match=r"min_share=...\) must be in \(0, 1\]"):
        flatshard.SublayerPolicy({GPTBlock}, min_share=0)


@pytest.mark.parametrize("policy", [42, "GPTBlock", {GPTBlock, "x"}])
def test_bad_policy(local_group: dist.ProcessGroup, policy: object) -> None:
    with pytest.raises(TypeError, match=r"auto_wrap_policy must be a set of nn.Module classes"):
        flatshard.fully_shard(build("gpt"), auto_wrap_policy=policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("min_params", [0, -3, 2.5])
def test_bad_size_policy(min_params: object) -> None:
    with pytest.raises(ValueError, match=r"positive int"):
        flatshard.SizePolicy(min_params=min_params)  # type: ignore[arg-type]


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)  # has reset_parameters()
        self.gain = nn.Parameter(torch.ones(3))  # nothing initializes it on meta


def test_uninitialized_meta_parameter_is_named(local_group: dist.ProcessGroup) -> None:
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(ValueError, match=r"'gain' came from the meta device and nothing"):
        flatshard.fully_shard(model)


def test_inherited_unit_cannot_keep_full_precision(local_group: dist.ProcessGroup) -> None:
    model = TinyGPT()
    flatshard.fully_shard(model.blocks[0])  # no policy: would inherit the root's
    policy = flatshard.MixedPrecision(torch.bfloat16, keep_full_precision={nn.LayerNorm})
    with pytest.raises(ValueError, match=r"unit 'blocks.0' was sharded by an earlier .* LayerNorm"):
        flatshard.fully_shard(model, mixed_precision=policy)


def test_tie_reaching_out_of_an_earlier_unit(local_group: dist.ProcessGroup) -> None:
    model = TinyGPT()
    flatshard.fully_shard(model.tok)  # holds the weight the head also uses
    with pytest.raises(ValueError, match=r"'head.weight' is tied to a parameter of 'tok'"):
        flatshard.fully_shard(model)


@pytest.mark.parametrize("factor", [2, 0, -1])
def test_sharding_factor_must_divide_the_world(local_group: dist.ProcessGroup, factor: int) -> None:
    with pytest.raises(ValueError, match=rf"sharding_factor F={factor} .* world size W=1"):
        flatshard.fully_shard(
            build("mlp"),
            strategy=flatshard.ShardingStrategy.HYBRID_SHARD,
            sharding_factor=factor,
        )


def test_sharding_factor_needs_a_hybrid_strategy(local_group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match=r"sharding_factor only applies to the hybrid strategies"):
        flatshard.fully_shard(build("mlp"), sharding_factor=1)


def test_one_hybrid_option_at_a_time(local_group: dist.ProcessGroup) -> None:
    mesh = DeviceMesh.from_group(
        [local_group, local_group], "cpu", mesh=[[0]], mesh_dim_names=("replicate", "shard")
    )
    with pytest.raises(ValueError, match=r"sharding_factor or as a 2-D .* not both"):
        flatshard.fully_shard(
            build("mlp"),
            strategy=flatshard.ShardingStrategy.HYBRID_SHARD,
            sharding_factor=1,
            process_group=mesh,
        )


def test_summon_on_an_unsharded_model(local_group: dist.ProcessGroup) -> None:
    with (
        pytest.raises(ValueError, match=r"holds no flatshard unit.*fully_shard"),
        flatshard.summon_full_params(nn.Linear(2, 2)),
    ):
        pass


class SummonsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLPBlock(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with flatshard.summon_full_params(self):
            pass
        out: torch.Tensor = self.block(x)
        return out


def test_summon_inside_forward(local_group: dist.ProcessGroup) -> None:
    model = flatshard.fully_shard(SummonsInForward())
    with pytest.raises(RuntimeError, match=r"forward pass.*between steps"):
        model(torch.randn(2, 3))


def test_one_process_trains_like_the_plain_model(local_group: dist.ProcessGroup) -> None:
    """World size 1 through the whole runtime, in this process."""
    plain = build("gpt")
    model = flatshard.fully_shard(build("gpt"), auto_wrap_policy={GPTBlock})
    gen = torch.Generator().manual_seed(0)
    batch = plain.make_batch(gen, 2)  # type: ignore[operator]
    for m in (plain, model):
        m.loss(batch).backward()  # type: ignore[operator]
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad)
    print(flatshard.sharding_summary(model))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: flatshard.no_sync(nn.Linear(2, 2)).__enter__(), r"no_sync: Linear holds no"),
        (lambda: flatshard.clip_grad_norm_(nn.Linear(2, 2), 1.0), r"clip_grad_norm_: Linear"),
        (lambda: flatshard.sharding_summary(nn.Linear(2, 2)), r"sharding_summary: Linear"),
        (lambda: flatshard.set_prefetch(nn.Linear(2, 2), backward=[]), r"is not a flatshard unit"),
    ],
)
def test_helpers_need_a_sharded_model(
    local_group: dist.ProcessGroup, call: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_helper_option_errors(local_group: dist.ProcessGroup) -> None:
    model = flatshard.fully_shard(build("mlp"))
    with pytest.raises(ValueError, match=r"norm_type must be > 0, got -1.0"):
        flatshard.clip_grad_norm_(model, 1.0, norm_type=-1)
    with pytest.raises(TypeError, match=r"hook must be callable"):
        comm_hooks.register_comm_hook(model, "bf16")  # type: ignore[arg-type]


def test_strategy_by_name_in_any_case_or_as_torchs_enum(local_group: dist.ProcessGroup) -> None:
    """Strings, PyTorch FSDP1's ShardingStrategy and ZeRO-style names ("zero3", "ddp")
    name the same strategies (they read like the right value, so refusing them helped no
    one)."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    ours = flatshard.ShardingStrategy
    for given, expected in [
        ("shard_grad_op", ours.SHARD_GRAD_OP),
        ("Full_Shard", ours.FULL_SHARD),
        (TorchStrategy.SHARD_GRAD_OP, ours.SHARD_GRAD_OP),
        (TorchStrategy._HYBRID_SHARD_ZERO2, ours.HYBRID_SHARD_ZERO2),
        (ours.NO_SHARD, ours.NO_SHARD),
        ("zero3", ours.FULL_SHARD),
        ("ZeRO-2", ours.SHARD_GRAD_OP),
        ("DDP", ours.NO_SHARD),
        ("hsdp", ours.HYBRID_SHARD),
    ]:
        assert ours.parse(given) is expected, given
    flatshard.fully_shard(build("mlp"), strategy="no_shard")
    with pytest.raises(TypeError, match=r"fully_shard: strategy must be one of FULL_SHARD, "):
        flatshard.fully_shard(build("mlp"), strategy="ZERO4")
    # ZeRO-1 has no counterpart: the error names the closest strategies
    with pytest.raises(TypeError, match=r"'zero1': ZeRO-1 .* Closest: HYBRID_SHARD_OPTIM"):
        flatshard.fully_shard(build("mlp"), strategy="zero1")


def test_the_summary_names_each_group(local_group: dist.ProcessGroup) -> None:
    """A unit with frozen and trainable groups (LoRA) has a row per group, each naming its
    unit and, where the unit has several groups, its parameters (before: the unit's name
    on its first row only, the others blank)."""
    model = build("frozen")
    flatshard.fully_shard(model, auto_wrap_policy=set(model.UNIT_CLASSES))  # type: ignore[arg-type]
    summary = flatshard.sharding_summary(model)
    rows = str(summary).splitlines()[1:]
    assert len(rows) == len(summary.flat_params) > len({f.unit for f in summary.flat_params})
    names = [f.name for f in summary.flat_params]
    assert len(set(names)) == len(names), str(summary)  # no two rows alike
    for row, flat in zip(rows, summary.flat_params, strict=True):
        assert row.startswith(flat.name), str(summary)
        several = sum(f.unit == flat.unit for f in summary.flat_params) > 1
        assert (flat.name != flat.unit) == several, str(summary)


class _Scaled(nn.Module):
    """A non-persistent buffer, and no config to build the module again from."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2), persistent=False)


def test_skip_init_refuses_buffers_it_cannot_compute(local_group: dist.ProcessGroup) -> None:
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"_Scaled holds non-persistent buffer\(s\) 'scale'"):
        flatshard.fully_shard(model, param_init_fn=flatshard.skip_init, device="cpu")


def test_when_a_wait_is_worth_a_warning() -> None:
    """10x the slowest step, at least a minute, unless Checks(warn_after=...) says."""
    assert flatshard.Checks().warn_after_s(slowest_step_s=0.0) == 60.0
    assert flatshard.Checks().warn_after_s(slowest_step_s=30.0) == 300.0
    assert flatshard.Checks(warn_after=5.0).warn_after_s(slowest_step_s=100.0) == 5.0
    with pytest.raises(ValueError, match=r"warn_after must be > 0 seconds, got 0"):
        flatshard.Checks(warn_after=0)


def test_a_device_without_an_index_gets_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """fully_shard(device="cuda") means the current cuda:N: "cuda" != "cuda:0" would keep
    F = 1 units from using their shard as the unsharded buffer (a full copy per unshard).
    The accelerator is faked: this checks the rule, on a machine without a GPU."""
    from flatshard.testing import internals

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    assert internals.device_with_index(torch.device("cuda")) == torch.device("cuda", 1)
    assert internals.device_with_index(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert internals.device_with_index(torch.device("cpu")) == torch.device("cpu")


def test_the_old_layout_keywords_warn_with_their_new_spelling(
    local_group: dist.ProcessGroup,
) -> None:
    """``whole_params`` and ``sparse_embeddings`` became ``placement``: still accepted, with
    a FutureWarning that spells the replacement; with ``placement`` too, an error."""
    for old in ({"whole_params": True}, {"sparse_embeddings": True}):
        with pytest.warns(FutureWarning, match=r"whole_params=True -> placement=flatshard"):
            flatshard.fully_shard(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4)), **old)
    with pytest.raises(TypeError, match="pass placement= alone"):
        flatshard.fully_shard(nn.Linear(2, 2), placement=flatshard.Whole(), whole_params=True)


def test_unit_modules_lists_the_units_by_name(local_group: dist.ProcessGroup) -> None:
    """What an integration asks to tell a sharded model: the units, by their names
    relative to the model asked; empty where fully_shard never ran."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert flatshard.unit_modules(model) == []
    flatshard.fully_shard(model, auto_wrap_policy={nn.Linear})
    # (the root holds no parameter of its own: it is no unit)
    assert [name for name, _ in flatshard.unit_modules(model)] == ["0", "2"]
    assert flatshard.unit_modules(model[2]) == [("", model[2])]
    assert flatshard.unit_modules(model[1]) == []


def test_gradient_divide_factor_refuses_what_it_cannot_serve(
    local_group: dist.ProcessGroup,
) -> None:
    model = flatshard.fully_shard(nn.Linear(4, 4))
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"factor must be a positive number or None"):
            flatshard.set_gradient_divide_factor(model, bad)  # type: ignore[arg-type]
    comm_hooks.register_comm_hook(model, lambda grad, groups: grad)
    with pytest.raises(ValueError, match=r"unit '<root>' reduces through a communication hook"):
        flatshard.set_gradient_divide_factor(model, 2.0)
    flatshard.set_gradient_divide_factor(model, None)  # back to W: allowed


def test_a_parameter_asked_whole_and_row_sparse_is_refused(
    local_group: dist.ProcessGroup,
) -> None:
    """An embedding table kept whole for a matrix optimizer and looked up row-sparse
    (``--optimizer adafactor --sparse-embeddings``) gets one error, not one of the two."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ValueError, match=r"'0\.weight' was asked to lie whole .* RowSparse\(\)"),
    ):
        flatshard.fully_shard(model, whole_params=True, sparse_embeddings=True)


def test_train_step_takes_a_module_around_the_sharded_model(
    local_group: dist.ProcessGroup,
) -> None:
    """Accumulating with a reduction per micro-batch touches the replicas' switch only for
    hybrid units: a wrapper around a FULL_SHARD model steps as the model would."""
    torch.manual_seed(0)
    model = flatshard.fully_shard(nn.Linear(4, 4))
    wrapper = nn.Sequential(model)
    optim = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    norm = flatshard.train_step(
        wrapper,
        [optim],
        lambda i: wrapper(torch.ones(2, 4)).sum(),
        2,
        accumulation="reduce",
        clip=10.0,
    )
    assert norm is not None and float(norm) > 0
    assert not torch.equal(model.weight.detach(), before)


def test_the_new_switches_refuse_what_they_cannot_do(local_group: dist.ProcessGroup) -> None:
    model = flatshard.fully_shard(nn.Linear(4, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"pass True, False or a number of ranks >= 2.*got 1"):
        flatshard.set_reshard_after_forward(model, 1)
    with pytest.raises(ValueError, match=r"no unit of Linear is sharded across more than one"):
        flatshard.set_reshard_after_forward(model, 2)
    loss = lambda i: model(torch.ones(1, 4)).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"'no_sync', 'reduce' or 'schedule', got 'keep'"):
        flatshard.train_step(model, [optim], loss, 2, accumulation="keep")
    with pytest.raises(ValueError, match=r"accumulation='schedule' runs micro_loss\(0\) once"):
        flatshard.train_step(model, [optim], loss, 2, accumulation="schedule")
    with pytest.raises(ValueError, match=r"micro_batches must be >= 1, got 0"):
        flatshard.train_step(model, [optim], loss, 0)
