"""The shape of the code and of the public API, checked so that it stays as agreed.

Few parameters per function (options users pass by name go in dataclasses), and the public
contract: ``fully_shard``'s keywords, the names outside code relies on, the user guide's
export list, tests that read through the public API or ``flatshard.testing.internals``.
Files are sized by concept, not by a line cap; the layers are ``test_layers.py``'s.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import flatshard
import flatshard.report

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "src" / "flatshard").rglob("*.py"), *(ROOT / "tests").glob("*.py")])
MAX_PARAMETERS = 8  # self/cls aside
# Keyword-only option lists users pass by name: fully_shard, and plan, which takes the
# same sharding options plus the batch and cluster ones.
# Lightning's strategies take each option as a keyword of their constructor: ours too.
WIDE_APIS = ("fully_shard", "plan", "FlatshardStrategy.__init__")

# Keywords outside code passes to fully_shard (ARCHITECTURE.md): they must stay.
CONTRACT_KEYWORDS = {
    "auto_wrap_policy",
    "strategy",
    "process_group",
    "sharding_factor",
    "mixed_precision",
    "device",
    "param_init_fn",
}
CONTRACT_NAMES = {
    "summon_full_params",
    "clip_grad_norm_",
    "no_sync",
    "full_state_dict",
    "sharded_state_dict",
    "load_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "export_safetensors",
    "register_entry_point",
    "ShardingStrategy",
    "MixedPrecision",
    "SizePolicy",
}


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _qualified_name(path: Path, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``Class.method`` for a method, the plain name for a function."""
    for owner in ast.walk(ast.parse(path.read_text())):
        if isinstance(owner, ast.ClassDef) and any(
            isinstance(child, ast.FunctionDef) and child.lineno == node.lineno
            for child in owner.body
        ):
            return f"{owner.name}.{node.name}"
    return node.name


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [a.arg for a in [*named, *extra] if a.arg not in ("self", "cls")]


def test_functions_take_few_parameters() -> None:
    too_many = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in SOURCES
        for node in _functions(path)
        if len(_parameters(node)) > MAX_PARAMETERS and _qualified_name(path, node) not in WIDE_APIS
    ]
    assert not too_many, f"functions with over {MAX_PARAMETERS} parameters: {too_many}"


def test_fully_shard_takes_at_most_eleven_options_including_the_contract() -> None:
    # Twelve before placement= replaced whole_params and sparse_embeddings (issue 45); their
    # old spellings still arrive through **renamed, with a FutureWarning.
    signature = inspect.signature(flatshard.fully_shard)
    options = [p for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert len(options) <= 11, [p.name for p in options]
    assert {p.name for p in options} >= CONTRACT_KEYWORDS | {"placement"}


# Where a placement's kind may be named: the placement modules themselves.
PLACEMENT_MODULES = {"_placement.py", "_row_sparse.py", "_transport.py", "_experts.py"}
KINDS = {
    "Rows",
    "Whole",
    "RowSparse",
    "RowSparseTable",
    "GroupPlacement",
    "TableProxy",
    "Experts",
    "ExpertSlice",
}


def test_no_code_outside_the_placements_asks_which_placement_a_group_has() -> None:
    """The unit, runtime, state and planner call the placement protocol ([Note: one
    placement protocol]); none reads ``.table``, tests ``isinstance`` against a placement
    class or compares with one."""
    found = []
    for path in (ROOT / "src" / "flatshard").rglob("*.py"):
        if path.name in PLACEMENT_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in ("table", "whole_params"):
                found.append(f"{where} .{node.attr}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "type"):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if names & KINDS:
                    found.append(f"{where} {ast.unparse(node)}")
            if isinstance(node, ast.Compare):
                names = {
                    n.attr if isinstance(n, ast.Attribute) else n.id
                    for n in ast.walk(node)
                    if isinstance(n, ast.Name | ast.Attribute)
                }
                if names & KINDS:
                    found.append(f"{where} {ast.unparse(node)}")
    assert not found, "placement kind checks outside the placement modules:\n" + "\n".join(found)


def _placement_flags() -> set[str]:
    """The boolean class attributes of every placement and group placement: flags a
    runtime could branch on instead of calling the protocol."""
    from flatshard.flat._placement import GroupPlacement  # the protocol's own module
    from flatshard.flat._tensor_parallel import SplitParam  # tensor-parallel parts, experts

    flags: set[str] = set()
    todo: list[type] = [flatshard.ShardPlacement, GroupPlacement, SplitParam]
    while todo:
        kind = todo.pop()
        todo += kind.__subclasses__()
        flags |= {n for n, v in vars(kind).items() if isinstance(v, bool) and not n.startswith("_")}
    return flags


def test_no_placement_flag_is_read_outside_the_placement_modules() -> None:
    """Each flag of a placement (``cuts_rows``, ``serves_lookups``, ``keeps_part``, ...) is
    read in the placement modules only; elsewhere the protocol's verbs decide (before: the
    runtime read ``serves_lookups`` in three modules, the step ``reduction_waits_for_...``,
    and a split parameter's ``varies_in_model_group`` five modules)."""
    flags = _placement_flags()
    assert {"cuts_rows", "serves_lookups", "keeps_part", "manages", "alone"} <= flags
    found = []
    for path in (ROOT / "src" / "flatshard").rglob("*.py"):
        if path.name in PLACEMENT_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in flags:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not found, "placement flags read outside the placement modules:\n" + "\n".join(found)


def test_contract_names_are_exported() -> None:
    assert set(flatshard.__all__) >= CONTRACT_NAMES
    for name in [*flatshard.__all__, *flatshard.report.__all__]:
        assert hasattr(flatshard, name) or hasattr(flatshard.report, name), name
    from flatshard.models.gpt import GPT  # noqa: F401  (part of the contract too)


def test_the_user_guide_lists_every_public_export() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## Public API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_]+)`", section))
    missing = [n for n in [*flatshard.__all__, *flatshard.report.__all__] if n not in listed]
    assert not missing, f"exports docs/guide.md's 'Public API' section does not list: {missing}"


LIBRARY = ("comm", "flat", "runtime", "sharding", "state", "planner", "measure", "models")


def test_each_subpackage_exports_only_what_the_guide_documents() -> None:
    """A subpackage's ``__all__`` is API: every name in it is in docs/guide.md (the CLI's
    plumbing comes from ``flatshard.cli.internals`` instead)."""
    import importlib

    guide = (ROOT / "docs" / "guide.md").read_text()
    undocumented = [
        f"flatshard.{sub}.{name}"
        for sub in LIBRARY
        for name in importlib.import_module(f"flatshard.{sub}").__all__
        if f"`{name}`" not in guide
    ]
    assert not undocumented, f"exported but not in docs/guide.md: {undocumented}"


def test_tests_use_public_api_or_the_testing_hook() -> None:
    private = re.compile(r"flatshard(\.\w+)*\._|from flatshard(\.\w+)* import _")
    offenders = [
        f"{p.name}:{i}"
        for p in (ROOT / "tests").glob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line) and p.name != Path(__file__).name
    ]
    assert not offenders, f"tests reaching into private modules: {offenders}"


def test_one_step_loop_serves_train_the_planner_bench_and_the_harness() -> None:
    """The micro-batch loop with its sync switches, clip and step is written once
    (``flatshard.train_step``): ``flatshard train``, the planner's simulation (so its
    predictions follow train's loop), ``flatshard bench`` and the parity harness call it,
    and none of them enters ``no_sync`` or clips on its own for flatshard."""
    package = ROOT / "src" / "flatshard"
    for module in ("cli/train/command.py", "planner/_simulate.py", "cli/bench/command.py"):
        tree = ast.parse((package / module).read_text())
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert calls & {"train_step", "flatshard.train_step"}, module
        assert not calls & {"no_sync", "flatshard.no_sync", "clip_grad_norm_"}, module
        assert not calls & {"flatshard.clip_grad_norm_", "set_requires_all_reduce"}, module
    assert "flatshard.train_step(" in (package / "testing" / "parity.py").read_text()


def test_renamed_report_names_still_answer_with_their_new_name() -> None:
    """``dtype_plan``, ``DtypePlan`` and ``plan_layout`` (renamed: "plan" is the planner's
    word) still work, with a FutureWarning naming the new name."""
    import pytest

    with pytest.warns(FutureWarning, match="flatshard.dtype_report"):
        assert flatshard.dtype_plan is flatshard.dtype_report  # type: ignore[attr-defined]
    with pytest.warns(FutureWarning, match="flatshard.report.DtypeReport"):
        assert flatshard.report.DtypePlan is flatshard.report.DtypeReport  # type: ignore[attr-defined]
    with pytest.warns(FutureWarning, match="flatshard.report.row_layout"):
        assert flatshard.report.plan_layout is flatshard.report.row_layout  # type: ignore[attr-defined]


def test_the_guide_lists_every_fully_shard_option_in_signature_order() -> None:
    """docs/guide.md's option table of ``fully_shard`` is its keyword-only signature: every
    option, in order, and nothing else (``**renamed`` takes the old spellings only)."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = guide.split("## Sharding a model", 1)[1].split("| option | what it sets |", 1)[1]
    rows = [line for line in table.split("\n\n", 1)[0].splitlines() if line.startswith("| `")]
    listed = [re.match(r"\| `(\w+)`", row).group(1) for row in rows]  # type: ignore[union-attr]
    signature = inspect.signature(flatshard.fully_shard)
    options = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert listed == options
