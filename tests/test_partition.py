"""Which submodules become units, and which unit owns each parameter (one process)."""

from __future__ import annotations

from torch import nn

from flatshard import SizePolicy
from flatshard.testing.internals import partition, select_unit_roots
from flatshard.testing.models import GPTBlock, Inner, Nested, Outer, TinyGPT, build


def test_class_policy_picks_every_instance() -> None:
    names = select_unit_roots(TinyGPT(), {GPTBlock}, skip=())
    assert names == ["blocks.0", "blocks.1", "blocks.2"]


def test_single_class_and_callable_policies() -> None:
    assert select_unit_roots(TinyGPT(), GPTBlock, skip=()) == ["blocks.0", "blocks.1", "blocks.2"]
    chosen = select_unit_roots(TinyGPT(), lambda m, name: name.endswith(".mlp"), skip=())
    assert chosen == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]


def test_no_policy_means_root_only() -> None:
    assert select_unit_roots(TinyGPT(), None, skip=()) == []


def test_size_policy_counts_bottom_up() -> None:
    # Each Inner has 10*10+10 = 110 elements; Outer's own are pre (110) + scale (10).
    model = Nested(dim=10)
    # Every Linear of 10x10 (+ bias) holds 110 elements: each is a unit at 110, in post-order.
    assert select_unit_roots(model, SizePolicy(min_params=110), skip=()) == [
        f"outers.{o}.{leaf}" for o in (0, 1) for leaf in ("pre", "inner.0.lin", "inner.1.lin")
    ]
    chosen = select_unit_roots(model, SizePolicy(min_params=200), skip=())
    # Inner units hold 110 < 200 each; inner (220) qualifies; the Outer keeps 120 < 200;
    # the two leftovers (240) make outers a unit.
    assert chosen == ["outers.0.inner", "outers.1.inner", "outers"]


def test_policy_skips_submodules_sharded_earlier() -> None:
    assert select_unit_roots(TinyGPT(), {GPTBlock}, skip=["blocks.1"]) == ["blocks.0", "blocks.2"]


def test_tied_parameter_goes_to_lowest_common_ancestor() -> None:
    model = TinyGPT()
    plans = {p.fqn: p for p in partition(model, ["blocks.0"], {}, rank=0)}
    root_names = [o.fqn for group in plans[""].groups for o in group]
    assert "tok.weight" in root_names and "head.weight" not in root_names
    tied = next(o for group in plans[""].groups for o in group if o.fqn == "tok.weight")
    assert {name for _, name in tied.usages} == {"weight"} and len(tied.usages) == 2


def test_tie_between_two_units_lands_in_their_parent() -> None:
    outer = Outer(4)
    first, second = outer.inner[0], outer.inner[1]
    second.lin.weight = first.lin.weight
    plans = {p.fqn: p for p in partition(outer, ["inner.0", "inner.1"], {}, rank=0)}
    names = {p: [o.fqn for g in plan.groups for o in g] for p, plan in plans.items()}
    assert "inner.0.lin.weight" in names[""]
    assert names["inner.0"] == ["inner.0.lin.bias"]
    assert names["inner.1"] == ["inner.1.lin.bias"]


def test_frozen_and_trainable_are_separate_groups() -> None:
    model = build("frozen")
    plans = {p.fqn: p for p in partition(model, ["layers.0", "layers.1"], {}, rank=0)}
    layer = plans["layers.0"]
    # First-seen order: a module's own parameters come before its children's.
    assert [[o.fqn for o in g] for g in layer.groups] == [
        ["layers.0.lora_a", "layers.0.lora_b"],
        ["layers.0.base.weight", "layers.0.base.bias"],
    ]
    assert [g[0].param.requires_grad for g in layer.groups] == [True, False]


def test_inner_units_come_first() -> None:
    plans = partition(Nested(), ["outers.0", "outers.0.inner.0"], {}, rank=0)
    assert [p.fqn for p in plans] == ["outers.0.inner.0", "outers.0", ""]
    assert isinstance(plans[0].module, Inner)
    assert isinstance(plans[-1].module, nn.Module)
    # Each module belongs to the deepest unit around it.
    assert [name for name, _ in plans[0].modules] == ["outers.0.inner.0", "outers.0.inner.0.lin"]
    assert [name for name, _ in plans[1].modules] == [
        "outers.0",
        "outers.0.pre",
        "outers.0.inner",
        "outers.0.inner.1",
        "outers.0.inner.1.lin",
    ]
