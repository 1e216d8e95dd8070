"""A report of how a sharded model is laid out: units, flat parameter groups, padding."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._mixed_precision import DtypeReport, DtypeRow, dtype_name
from flatshard.flat._placement import TableTraffic
from flatshard.runtime._configuration import unit_lines
from flatshard.runtime._unit import Unit, units_of


@dataclass(frozen=True)
class FlatParamSummary:
    """One flat parameter group of one unit, in elements."""

    unit: str  # the unit's module name ("<root>" for the top)
    param_names: tuple[str, ...]  # original names, in layout order
    held_rows: tuple[tuple[int, int], ...]  # per name: (first row, row count) on this rank
    requires_grad: bool
    dtype: str
    param_numel: int  # the originals' elements
    shard_numel: int  # C: elements each rank stores
    factor: int  # F: ranks the group is cut across
    padding_numel: int  # C * F - param_numel
    alignment_padding_numel: int  # the part of the padding that keeps rows whole
    group: str = ""  # which of the unit's groups, where it has several: its parameters

    @property
    def name(self) -> str:
        """The unit's name, and the group's where the unit has several."""
        return f"{self.unit} [{self.group}]" if self.group else self.unit


@dataclass(frozen=True)
class ShardingSummary:
    """Every flat parameter group of a sharded model."""

    flat_params: tuple[FlatParamSummary, ...]

    def held_rows(self, name: str) -> tuple[int, int]:
        """(first row, row count) of parameter ``name`` that this rank holds."""
        for flat in self.flat_params:
            if name in flat.param_names:
                return flat.held_rows[flat.param_names.index(name)]
        raise KeyError(f"no sharded parameter named '{name}'")

    @property
    def shard_numel(self) -> int:
        """Parameter elements each rank stores."""
        return sum(f.shard_numel for f in self.flat_params)

    @property
    def alignment_padding_numel(self) -> int:
        return sum(f.alignment_padding_numel for f in self.flat_params)

    def __str__(self) -> str:
        w = max([28, *(len(f.name) for f in self.flat_params)])  # long names stay aligned
        lines = [f"{'unit':<{w}} {'grad':>5} {'params':>12} {'per rank':>10} {'align pad':>9}"]
        for f in self.flat_params:
            lines.append(
                f"{f.name:<{w}} {'yes' if f.requires_grad else 'no':>5} {f.param_numel:>12,} "
                f"{f.shard_numel:>10,} {f.alignment_padding_numel:>9,}"
            )
        return "\n".join(lines)


def sharding_summary(model: nn.Module) -> ShardingSummary:
    """How ``model``'s parameters are flattened, padded and sharded on this rank."""
    entries = []
    for unit in units_of(model, "sharding_summary"):
        for flat in unit.flat_params:
            layout = flat.layout
            entries.append(
                FlatParamSummary(
                    unit=unit.label,
                    param_names=tuple(o.fqn for o in flat.originals),
                    held_rows=tuple((h.first_row, h.rows) for h in flat.param_views.held),
                    requires_grad=flat.requires_grad,
                    dtype=str(flat.shard.dtype).removeprefix("torch."),
                    param_numel=layout.param_numel,
                    shard_numel=layout.shard_numel,
                    factor=layout.factor,
                    padding_numel=layout.padding_numel,
                    alignment_padding_numel=layout.alignment_padding_numel,
                    group=_group_label(unit, flat),
                )
            )
    return ShardingSummary(flat_params=tuple(entries))


def agreed_configuration(model: nn.Module) -> list[str]:
    """Every unit's options as the ranks agreed them, one line each (what ``fully_shard``'s
    startup check compares across ranks: [Note: the agreed configuration])."""
    lines = []
    for unit in units_of(model, "agreed_configuration"):
        lines += unit_lines(unit.label, unit.config)
    return lines


def dtype_report(model: nn.Module) -> DtypeReport:
    """The resolved dtypes of every flat parameter group: master (and optimizer state),
    all-gather, compute and reduction, and where the master shard lives."""
    rows = []
    for unit in units_of(model, "dtype_report"):
        for flat in unit.flat_params:
            rows.append(
                DtypeRow(
                    unit=unit.label,
                    params=len(flat.originals),
                    master=dtype_name(flat.shard.dtype),
                    all_gather=_gathered_as(flat),
                    compute=dtype_name(flat.compute_dtype),
                    reduce=dtype_name(flat.reduce_dtype) if flat.requires_grad else "-",
                    master_device=str(flat.shard.device),
                    group=_group_label(unit, flat),
                )
            )
    return DtypeReport(rows=tuple(rows))


def _group_label(unit: Unit, flat: FlatParamGroup) -> str:
    """A unit's group, by its parameters' names relative to the unit, where the unit has
    several groups (frozen apart, a table kept exact, experts, whole matrices); "" else."""
    if len(unit.flat_params) == 1:
        return ""
    prefix = f"{unit.fqn}." if unit.fqn else ""
    names = [o.fqn.removeprefix(prefix) for o in flat.originals]
    return ", ".join(names[:2]) + (f" +{len(names) - 2}" if len(names) > 2 else "")


def _gathered_as(flat: FlatParamGroup) -> str:
    """The all-gather's dtype: the compute dtype, or what the codec sends ("int8+scales"
    with a scale per row); "-" where nothing is gathered (F = 1)."""
    codec = flat.transport.codec
    if codec is None:
        return dtype_name(flat.compute_dtype) if flat.needs_all_gather else "-"
    return dtype_name(codec.dtype) + ("+scales" if codec.scaled else "")


def embedding_traffic(model: nn.Module) -> dict[str, TableTraffic]:
    """Per row-sparse embedding table (``fully_shard(..., placement=flatshard.RowSparse())``),
    by its weight's name: the lookups it served sparse and dense, and the ids and row
    elements this rank sent to other ranks for it, since ``fully_shard``. Empty without
    row-sparse tables."""
    return dict(
        traffic
        for unit in units_of(model, "embedding_traffic")
        for flat in unit.flat_params
        if (traffic := flat.placement.traffic()) is not None
    )
