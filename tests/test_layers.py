"""The package's folders are its layers: imports go only downward, with no cycles.

Read from the source (``ast``), so the check sees every import, also those inside functions.
An import under ``if TYPE_CHECKING:`` (annotations only) may point sideways or up only inside
its own subpackage. The layers, lowest first, are listed in ``LAYERS`` and in
docs/design.md ("Layers").
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "flatshard"

# Lowest first. A module may import its own layer and the layers before it.
LAYERS = [
    "models",  # the GPT that flatshard train trains: plain torch
    "measure",  # exact accounting at the dispatcher: plain torch
    "comm",  # collectives, groups, watchdog, diagnosis, errors
    "flat",  # row-aligned layout, FlatParamGroup, reduction, policies
    "runtime",  # units, step context, hooks, prefetch; no_sync, clip, summon
    "placements",  # placements with hooks and collectives of their own: row-sparse, experts
    "sharding",  # fully_shard, init, startup checks
    "state",  # state dicts, optimizer state, checkpoints, safetensors
    "planner",  # flatshard.plan
    "facade",  # flatshard/__init__.py, report.py, comm_hooks.py
    "integrations",  # Lightning's strategy, the Hugging Face Trainer: optional extras
    "cli",  # flatshard train | bench | plan | ckpt
    "testing",  # harness, reference models, parity runs
]
FACADE = {"flatshard", "flatshard.report", "flatshard.comm_hooks"}


class Import(NamedTuple):
    source: str
    target: str
    annotations_only: bool
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    if module in FACADE:
        return "facade"
    name = module.split(".")[1]
    if name not in LAYERS:
        raise AssertionError(f"{module} lies in no layer: add its folder to LAYERS")
    return name


def subpackage(module: str) -> str:
    return "facade" if module in FACADE else module.split(".")[1]


def _targets(source: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # ``from pkg import mod`` imports the module; ``from mod import name`` the module itself.
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]


def _under_type_checking(parents: list[ast.AST]) -> bool:
    return any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in parents)


def imports() -> list[Import]:
    found = []
    for source, path in MODULES.items():
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(ast.parse(path.read_text()), [])]
        while stack:
            node, parents = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    for target in _targets(source, child, path.name == "__init__.py"):
                        if target == "flatshard" or target.startswith("flatshard."):
                            only = _under_type_checking([*parents, node])
                            found.append(Import(source, target, only, child.lineno))
                stack.append((child, [*parents, node]))
    return found


def _where(i: Import) -> str:
    return f"{MODULES[i.source].relative_to(ROOT)}:{i.line} imports {i.target}"


def test_every_module_lies_in_a_layer() -> None:
    for module in MODULES:
        layer(module)


def test_imports_go_only_downward() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for i in imports():
        if rank[layer(i.target)] <= rank[layer(i.source)]:
            continue
        if i.annotations_only and subpackage(i.target) == subpackage(i.source):
            continue
        upward.append(_where(i))
    assert not upward, "imports against the layers' direction:\n" + "\n".join(upward)


def test_subpackages_import_each_other_in_one_direction() -> None:
    """Within one layer, ``TYPE_CHECKING`` aside, no two subpackages import each other
    (each layer is one subpackage, so this guards the layer list itself)."""
    pairs = {(subpackage(i.source), subpackage(i.target)) for i in imports()}
    both = sorted((a, b) for a, b in pairs if a < b and (b, a) in pairs)
    assert not both, f"subpackages that import each other: {both}"


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in imports():
        if not i.annotations_only and i.target != i.source:
            graph[i.source].add(i.target)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other in a cycle:\n" + "\n".join(
        ", ".join(c) for c in cycles
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_nothing_outside_testing_imports_testing() -> None:
    offenders = [
        _where(i)
        for i in imports()
        if layer(i.target) == "testing" and layer(i.source) != "testing"
    ]
    assert not offenders, "\n".join(offenders)


def test_the_cli_and_integrations_use_public_modules_only() -> None:
    """The CLI and the integrations import the facade, a subpackage's surface (its
    ``__init__``) or their own modules; never another subpackage's private ``_module``,
    but for ``cli/internals.py``, where the CLI's plumbing (not API) comes from."""
    private = [
        _where(i)
        for i in imports()
        if layer(i.source) in ("cli", "integrations")
        and i.source != "flatshard.cli.internals"  # the one place the CLI's plumbing comes from
        and layer(i.target) != layer(i.source)
        and any(part.startswith("_") for part in i.target.split("."))
    ]
    assert not private, "\n".join(private)


def test_import_flatshard_loads_no_test_code() -> None:
    probe = (
        "import flatshard, sys; print(any(m.startswith('flatshard.testing') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


_COST = """
import sys
{statement}
rss = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]
heavy = ("flatshard.planner", "torch.utils.flop_counter", "triton", "torch.distributed.tensor")
print(int(rss) * 1024, *[m for m in heavy if m in sys.modules])
"""


def _import_cost(statement: str) -> tuple[int, list[str]]:
    """(resident bytes, heavy modules loaded) of a fresh interpreter after ``statement``."""
    probe = _COST.format(statement=statement)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    rss, *loaded = out.stdout.split()
    return int(rss), loaded


def test_import_flatshard_loads_no_planner_and_costs_no_more_than_torchs_fully_shard() -> None:
    """Every rank pays its imports: ``import flatshard`` loads no planner, flop counter,
    triton or DTensor until they are used, and its resident memory is at most that of
    importing PyTorch's ``fully_shard`` (benchmarks/import_cost.py measures both)."""
    ours, loaded = _import_cost("import flatshard")
    theirs, _ = _import_cost("from torch.distributed.fsdp import fully_shard")
    assert loaded == [], loaded
    assert ours <= theirs, (ours, theirs)


def _design_table() -> dict[str, str]:
    """docs/design.md's layer table: the folder of each row -> its modules cell."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {cells[1].strip().strip("`").rstrip("/"): cells[2] for cells in rows}


def test_the_design_layer_table_lists_every_module_and_no_gone_one() -> None:
    """Each layer's row in docs/design.md names every module of its folder (a nested
    folder by its name), and every module it names exists there."""
    table = _design_table()
    folders = set(LAYERS) - {"facade"}  # (its row names the facade's three files)
    assert set(table) == folders, sorted(set(table) ^ folders)
    wrong = []
    for folder, cell in table.items():
        named = set(re.findall(r"`([\w/]+\.py)`", cell))
        nested = set(re.findall(r"`(\w+)/`", cell))
        files = [
            p.relative_to(PACKAGE / folder)
            for p in (PACKAGE / folder).rglob("*.py")
            if p.name != "__init__.py"
        ]
        for path in files:
            if path.name not in named and not (set(path.parts[:-1]) & nested):
                wrong.append(f"{folder}/{path} is not in design.md's layer table")
        for name in named:
            if not any(p.name == name for p in files):
                wrong.append(f"design.md's layer table names {folder}/{name}, which is gone")
    assert not wrong, "\n".join(wrong)
