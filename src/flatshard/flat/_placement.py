"""Placements: how each parameter lies across its shard group, as one value and one protocol.

``fully_shard(placement=...)`` chooses a placement per parameter: a ``ShardPlacement``
value, or a rule ``(name, parameter) -> ShardPlacement | None``. Five exist:

- ``Rows()`` (the default): the row-aligned layout, every rank a slice of whole rows.
- ``Whole()``: no parameter cut; each lies whole in one rank's shard, for optimizers that
  update a matrix as a whole (``flat/_layout.py``, [Note: whole-parameter layout]).
- ``RowSparse()`` (``placements/_row_sparse.py``): an ``nn.Embedding`` weight whose
  lookups fetch only their rows from the ranks that hold them.
- ``Unmanaged()``: left out of every flat group (FSDP2's ``ignored_params``): the parameter
  stays whole on every rank, is never gathered, and its gradient is not reduced.
- ``Experts(degree)`` (``placements/_experts.py``): a mixture of experts' stacked weights, each rank
  keeping its experts only, sharded over the ranks that hold the same ones ([Note: expert
  parallelism]).

[Note: one placement protocol]
A placement is two objects. The value (``ShardPlacement``) acts at build time: which
parameters it serves (``serves``), why it cannot serve one (``refusal``), whether its
parameters share a flat group or each get one (``alone``), whether the layout cuts rows
(``cuts_rows``), whether each rank keeps only a part of the parameter (``keeps_part``:
``part_refusal`` and ``take_part`` cut it before sharding), where its flat group lives
(``shard_groups``), and ``bind``, which gives a flat group its ``GroupPlacement``. The group
placement acts at run time: the unit asks it to gather (``start_unshard``, ``unshard``),
the step context has it start the reduction, in the chain of reductions or waited for at
the end of backward (``start_reduction``), and finish it (``finish_reduction``),
``zero_grad`` asks it to drop what it keeps (``drop_pending``), the hooks register what it
asks for (``forward_pre_hooks``) and have it check an embedding's options
(``check_lookup_options``), ``set_reshard_after_forward(N)`` asks where its parts stay
(``post_forward_group``), reports and refusals read ``traffic``, ``comm_hook_conflict``
and ``custom_collective_conflict``. The unit, runtime and state layers call these and
never ask which placement a group has: no boolean flag of a placement is read outside the
placement modules (``tests/test_structure.py``). The planner prices a placement by running
it on the meta device, so it needs nothing more (but for ``Experts``, whose routing has no
values there: refused).
Both gather and reduction send their payloads through the group's ``Transport``
(``_transport.py``), whose codec ``gathered_in`` chooses (the dtype on the wire).

To add a placement, subclass ``ShardPlacement`` (a frozen dataclass) and, where run time
differs from rows, ``GroupPlacement``; export the value from ``flatshard``. One that
installs hooks or issues collectives of its own (as ``RowSparse`` and ``Experts`` do) goes
in ``flatshard/placements/``, above the runtime: the runtime reaches it only through these
two classes, and the layer test keeps it that way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._mesh import ShardGroups, ShardingStrategy
from flatshard.flat._layout import FlatLayout, row_layout
from flatshard.flat._lookup_options import refuse_lookup_options
from flatshard.flat._partition import OriginalParam
from flatshard.flat._transport import SCALED, gather_dtype_error

if TYPE_CHECKING:
    from flatshard.flat._flat_param import FlatParamGroup
    from flatshard.flat._reduction import GradientReduction


@dataclass
class TableTraffic:
    """Elements this rank sent to other ranks for one lookup table (ids and rows), since
    created: what a placement that moves rows instead of gathering reports."""

    lookups: int = 0  # sparse forwards
    dense_lookups: int = 0  # forwards that looked up the gathered table
    lookup_ids: int = 0
    lookup_rows: int = 0  # row elements (rows x dim)
    grad_ids: int = 0
    grad_rows: int = 0


class GroupPlacement:
    """What a flat group does at run time where its placement decides; this base class is
    the rows placements' way: the unit gathers the group, its reduction overlaps the next."""

    serves_lookups: ClassVar[bool] = False
    """Whether embedding lookups of the group's parameter take a path of their own."""

    def __init__(self, flat: FlatParamGroup) -> None:
        self.flat = flat

    def start_unshard(self, held: bool) -> None:
        """The unit (or a prefetch) starts gathering; ``held``: ``flatshard.unshard``."""
        self.flat.start_unshard()

    def unshard(self, backward: bool, held: bool) -> None:
        """The unit needs its parameters now (forward, or ``backward``)."""
        self.flat.unshard()

    def views_returned(self) -> None:
        """The modules hold their original parameters again, or the buffer's views."""

    def finish_reduction(self, all_reduce: bool) -> None:
        """End of backward: reduce what did not reach the group's hook (zeros), so that
        every rank issues the same collectives."""
        reduction = self.flat.reduction
        if not reduction.done_in_backward:
            reduction.start(all_reduce)

    def drop_pending(self) -> None:
        """``zero_grad`` of the whole group: gradients kept outside the flat leaf go too."""

    def forward_pre_hooks(self) -> list[tuple[nn.Module, Callable[[], None]]]:
        """(module, call) pairs to run before those modules' forwards."""
        return []

    def traffic(self) -> tuple[str, TableTraffic] | None:
        """(name, elements sent) where the group moves rows instead of gathering."""
        return None

    def comm_hook_conflict(self) -> str | None:
        """The name of what a communication hook cannot reduce in this group (a row-sparse
        table's lookup rows), or None."""
        return None

    def custom_collective_conflict(self) -> str | None:
        """The name of what a custom all-gather or reduce-scatter cannot move in this group
        (a row-sparse table's rows travel by all-to-all), or None."""
        return None

    def start_reduction(
        self, all_reduce: bool, in_flight: GradientReduction | None
    ) -> GradientReduction | None:
        """Backward made the group's gradient: start its reduction. ``in_flight``: the
        reduction the step still waits on; returns the one it waits on next. Rows: the
        reductions form a chain, each waited for by the next (at most one unsharded
        gradient waits on communication)."""
        if in_flight is not None:
            in_flight.finish()
        self.flat.reduction.start(all_reduce)
        return self.flat.reduction

    def post_forward_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The group that keeps the group's parts after forward under
        ``set_reshard_after_forward(N)`` (``group``: the one made for its shard group)."""
        return group if self.flat.groups.shard is not None else None

    def check_lookup_options(self, name: str, embedding: nn.Embedding | nn.EmbeddingBag) -> None:
        """Raise for an option of ``embedding`` (set after ``fully_shard``) that the group
        cannot serve (flat/_lookup_options.py)."""
        refuse_lookup_options(name, embedding, self.flat.requires_grad, self.serves_lookups)


class ShardPlacement:
    """How a parameter lies across its shard group: the value ``fully_shard``'s
    ``placement`` rule returns (see [Note: one placement protocol])."""

    alone: ClassVar[bool] = False  # each parameter in a flat group of its own
    cuts_rows: ClassVar[bool] = True  # False: each parameter whole in one rank's shard
    serves_lookups: ClassVar[bool] = False  # embedding lookups take a path of their own
    manages: ClassVar[bool] = True  # False: in no flat group (the unit leaves it alone)
    keeps_part: ClassVar[bool] = False  # True: each rank keeps a part (``take_part``)

    def serves(self, orig: OriginalParam) -> bool:
        """Whether this placement, given for the whole model, applies to ``orig`` (the
        others get ``Rows()``)."""
        return True

    def refusal(self, orig: OriginalParam, strategy: ShardingStrategy) -> str | None:
        """Why this placement cannot serve ``orig`` under ``strategy``, or None."""
        return None

    def layout(self, shapes: Sequence[torch.Size], chunks: int) -> FlatLayout:
        """The flat layout of a group of parameters of ``shapes`` cut into ``chunks``."""
        return row_layout(shapes, chunks, whole=not self.cuts_rows)

    def bind(self, flat: FlatParamGroup) -> GroupPlacement:
        """The run-time side of a built flat group of this placement."""
        return GroupPlacement(flat)

    def gathered_in(self, policy: torch.dtype | None) -> torch.dtype | None:
        """The dtype the group's parameters are all-gathered in, given the mixed-precision
        policy's ``gather_dtype`` (None: the compute dtype, no codec)."""
        return policy

    def take_part(
        self, orig: OriginalParam, model: dist.ProcessGroup, base: ShardGroups, rank: int
    ) -> None:
        """Before sharding: replace ``orig.param`` (everywhere the model registers it) by
        the part of it this rank keeps, if the placement keeps only a part (experts).
        ``model``: the ranks the model is sharded over; ``base``: their groups."""

    def part_refusal(
        self, orig: OriginalParam, siblings: Sequence[tuple[OriginalParam, ShardPlacement]]
    ) -> str | None:
        """Why ``orig``, kept in part, cannot be cut beside the other parameters of the
        modules that hold it (``siblings``: each with its placement), or None."""
        return None

    def shard_groups(self, base: ShardGroups, members: Sequence[OriginalParam]) -> ShardGroups:
        """Where a flat group of ``members`` lives (``base``: the ``fully_shard`` call's)."""
        return base

    def check_lookup_options(
        self,
        name: str,
        embedding: nn.Embedding | nn.EmbeddingBag,
        trainable: bool,
        sharded: bool,
    ) -> None:
        """Raise for an option of ``embedding`` (looking up ``name``) that this placement
        cannot serve, at ``fully_shard`` (``sharded``: over more than one rank)."""
        refuse_lookup_options(name, embedding, trainable, sharded and self.serves_lookups)

    def plan_refusal(self) -> str | None:
        """Why ``flatshard.plan`` cannot price this placement, or None."""
        return None


def split_by_placement(
    params: list[OriginalParam], placements: Mapping[str, ShardPlacement]
) -> list[tuple[ShardPlacement, list[OriginalParam]]]:
    """A unit's parameters of one dtype as (placement, members): one flat group per
    placement, or per parameter where the placement wants it alone; whole layouts first,
    then the alone ones, then the rows (the order of the flat groups in a unit). Parameters
    left alone are in none."""
    by_value: dict[ShardPlacement, list[OriginalParam]] = {}
    alone: list[tuple[ShardPlacement, list[OriginalParam]]] = []
    for orig in params:
        placement = placements[orig.fqn]
        if not placement.manages:
            continue
        if placement.alone:
            alone.append((placement, [orig]))
        else:
            by_value.setdefault(placement, []).append(orig)
    shared = list(by_value.items())
    return (
        [(p, m) for p, m in shared if not p.cuts_rows]
        + alone
        + [(p, m) for p, m in shared if p.cuts_rows]
    )


def left_alone(
    originals: Sequence[OriginalParam], placements: Mapping[str, ShardPlacement]
) -> list[OriginalParam]:
    """The parameters whose placement keeps them out of every flat group (``Unmanaged``)."""
    return [o for o in originals if not placements[o.fqn].manages]


def kept_in_part(
    originals: Sequence[OriginalParam], placements: Mapping[str, ShardPlacement]
) -> list[OriginalParam]:
    """The parameters each rank keeps only a part of (``take_part``: experts)."""
    return [o for o in originals if placements[o.fqn].keeps_part]


@dataclass(frozen=True)
class Rows(ShardPlacement):
    """The default: the row-aligned layout, each rank holding a slice of whole rows.

    ``gather_dtype``: the dtype these parameters travel in when gathered, instead of the
    ``MixedPrecision(gather_dtype=...)`` of their ``fully_shard`` call (None: that one):
    ``torch.int8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` with one scale per
    row (parameters of two or more dimensions), ``torch.bfloat16`` or ``torch.float16`` as
    a cast, or the compute dtype to keep a parameter (e.g. an embedding table) exact under
    a quantizing policy. Given for the whole model, a quantizing ``Rows`` serves the
    matrices; the vectors keep the policy's.
    """

    gather_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        error = gather_dtype_error(self.gather_dtype, "flatshard.Rows(gather_dtype=...)")
        if error is not None:
            raise ValueError(error)

    def __repr__(self) -> str:
        return "Rows()" if self.gather_dtype is None else f"Rows(gather_dtype={self.gather_dtype})"

    def serves(self, orig: OriginalParam) -> bool:
        return self.gather_dtype not in SCALED or orig.param.dim() >= 2

    def refusal(self, orig: OriginalParam, strategy: ShardingStrategy) -> str | None:
        if self.gather_dtype in SCALED and orig.param.dim() < 2:
            return (
                f"a parameter of shape {tuple(orig.param.shape)} has rows of one element, "
                f"and {self.gather_dtype} with a float32 scale per row would send 5 bytes "
                "per element: quantize matrices only (vectors travel in the compute dtype "
                "under MixedPrecision(gather_dtype=...)), or give it Rows()"
            )
        return None

    def gathered_in(self, policy: torch.dtype | None) -> torch.dtype | None:
        return policy if self.gather_dtype is None else self.gather_dtype


@dataclass(frozen=True)
class Whole(ShardPlacement):
    """No parameter cut into rows: each lies whole in one rank's shard (balanced by size,
    shards padded to the largest), so optimizers that update a parameter as a whole matrix
    (``torch.optim.Muon``, ``torch.optim.Adafactor``, Shampoo) make the unsharded update on
    its owner; other ranks hold it with 0 rows and ``.grad`` None. Costs the padding in
    memory and traffic. Parameters kept whole sit in flat groups of their own beside the
    row-sharded rest."""

    cuts_rows: ClassVar[bool] = False

    def refusal(self, orig: OriginalParam, strategy: ShardingStrategy) -> str | None:
        if strategy.shards_optimizer_across_replicas:
            return (
                "HYBRID_SHARD_OPTIM cuts every parameter's rows across all ranks; use "
                "HYBRID_SHARD or FULL_SHARD with Whole()"
            )
        return None


@dataclass(frozen=True)
class Unmanaged(ShardPlacement):
    """Left alone (FSDP2's ``ignored_params``): the parameter is in no flat group, stays
    whole on every rank (materialized and moved with its unit), and its gradient is each
    rank's own, never reduced: average it yourself (``dist.all_reduce``) before the step if
    the ranks are to agree. State dicts and checkpoints hold it as a replicated tensor (a
    checkpoint keeps one rank's copy and loads it on every rank);
    ``flatshard.clip_grad_norm_`` counts it once. A later ``fully_shard`` on an enclosing
    module leaves it alone too."""

    manages: ClassVar[bool] = False


ROWS = Rows()

PlacementRule = ShardPlacement | Callable[[str, nn.Parameter], ShardPlacement | None] | None
"""``fully_shard``'s ``placement``: one placement for every parameter it serves, or a rule
``(name, parameter) -> placement`` (None: ``Rows()``); names are relative to the module."""


WholeChoice = bool | Callable[[str, nn.Parameter], bool]


def placement_rule(
    model: nn.Module, whole: WholeChoice, others: ShardPlacement | None
) -> PlacementRule:
    """The rule that keeps the parameters ``whole`` picks whole (all with True) and gives
    the rest ``others`` where it serves them (e.g. ``RowSparse()``: the embedding tables):
    what the CLI, the planner and the old ``whole_params``/``sparse_embeddings`` ask."""
    if not callable(whole) and not whole:
        return others
    usages: dict[int, list[tuple[nn.Module, str]]] = {}

    def serves(name: str, param: nn.Parameter) -> bool:
        if others is None:
            return False
        if not usages:  # on the first call: the parameters fully_shard sees (localized)
            for module in model.modules():
                for key, value in module._parameters.items():
                    if value is not None:
                        usages.setdefault(id(value), []).append((module, key))
        return others.serves(OriginalParam(param, name, usages.get(id(param), [])))

    def rule(name: str, param: nn.Parameter) -> ShardPlacement | None:
        served = serves(name, param)
        if whole is True or (callable(whole) and whole(name, param)):
            if served:
                raise ValueError(
                    f"flatshard.fully_shard: '{name}' was asked to lie whole on one rank "
                    f"(Whole(), for a matrix optimizer) and to be placed {others!r}; give it "
                    "one placement (e.g. leave the embedding tables out of the optimizer "
                    "that needs whole matrices, or drop the row-sparse tables)."
                )
            return Whole()
        return others if served else None

    return rule
