"""Row-sparse embedding tables: lookups fetch only their rows, gradients go back as rows.

[Note: row-sparse embedding tables]
With ``fully_shard(..., placement=flatshard.RowSparse())`` every ``nn.Embedding`` of a
sharded unit gets its weight in a flat group of its own, so the row-aligned layout gives
each rank of the shard group a contiguous block of whole rows. In forward the embedding
module holds a ``TableProxy`` instead of a view of the gathered table; ``F.embedding`` on
it runs ``RowSparseTable.lookup``:
1. this rank's token ids, made unique (sorted), are counted per owning rank, and the shard
   group all-gathers the counts (F + 2 integers per rank: the last but one counts ids out of
   range, the last says which exchange follows, so that every rank raises the same error
   for either, rather than gloo aborting on all-to-alls that pair wrongly);
2. the rule below picks dense or sparse, alike on every rank since all see all the counts;
3. sparse: an all-to-all sends each owner the ids it holds, another returns their rows (in
   the compute dtype); the lookup is ``F.embedding`` of the ids' positions among the unique
   ids into those rows, a leaf of its own. Its backward is then the same kernel on the same
   order of tokens as the unsharded lookup's, and gives the same row sums bit for bit;
   ``padding_idx`` and ``scale_grad_by_freq`` carry over (the padding id's position; the
   counts are this rank's, as under DDP).
The leaf's gradient (the unique ids' summed rows) is kept; the end of a synchronized
backward merges what this rank's lookups left since the last exchange, divides it as the
dense reduction divides (``split_division``), and sends each owner its rows plus their ids
(all-gather of counts, two all-to-alls); the owner adds them, in source-rank order, into a
zero shard-sized gradient, which then takes the dense gradient's way: all-reduce across the
replicas (hybrid), the rest of the division, ``.grad``.

Tied tables (the weight also registered in a module that is not an ``nn.Embedding``: the
LM head): the head needs the whole table, so the lookup starts the table's all-gather right
after its own rows arrived, and a pre-forward hook on the head waits for it there: the
blocks' compute runs while it travels. The head's gradient reaches the group's flat leaf
and is reduce-scattered when the head's backward produced it (the group's post-backward
hook), overlapping the blocks' backward; only the lookup's rows are exchanged at the end.

The rule, per forward: with R the ids the ranks ask of other ranks (the off-diagonal sum of
the count matrix), sparse moves R ids and R rows each way (forward and backward), dense the
table's all-gather and reduce-scatter, F (F - 1) C elements each; sparse wins when
``R (2 * 8 + row bytes in compute + row bytes in reduce) < F (F - 1) C (compute + reduce
element bytes)``. Dense (the union of the batches near the vocabulary, or the table already
gathered: pinned, kept, prefetched) looks up the gathered table and reduces it as any group.

Under torch.compile the lookup runs eagerly (``_row_sparse_lookup``): ``torch.unique`` and the
count matrix are sized by the ids' values, which no graph can hold. Compiled blocks are
untouched; a compiled whole model splits at the lookup.

The ledger ([Note: collectives pair by issue order]) records each all-to-all with F (its
number of splits, the same on every rank), not the elements this rank sent.

[Note: row-sparse tables in a plan]
``flatshard.plan`` runs the step on the meta device, where token ids have no values: a plan
then takes every id of a lookup distinct, ``min(n, V)`` ids for n tokens of a V-row table,
spread over the owners as their rows are, on every rank alike (``_planned_matrix``). That
is the most any batch can hold, so the plan prices the most traffic and the largest fetched
rows the run can meet: positions (``arange``) are met exactly, uniformly random ids nearly
(``V (1 - (1 - 1/V)^n)`` distinct), real text, whose frequent tokens repeat, moves less.
The gradient exchange after several lookups (micro-batches under ``no_sync``) takes the
union of all their tokens alike. The rule and every collective then run as on real ids.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import all_gather_into, exchange_rows
from flatshard.comm._diagnosis import SAME_CALLS
from flatshard.comm._errors import CollectiveMismatchError
from flatshard.comm._mesh import ShardingStrategy
from flatshard.flat._flat_param import FlatParamGroup, Holding
from flatshard.flat._lookup_options import max_norm_message
from flatshard.flat._partition import OriginalParam
from flatshard.flat._placement import GroupPlacement, ShardPlacement, TableTraffic
from flatshard.flat._reduction import GradientReduction

_ID_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class RowSparse(ShardPlacement):
    """An ``nn.Embedding`` weight in a flat group of its own, looked up row-sparse: a
    forward fetches only the rows of its rank's token ids from the ranks that hold them,
    and the lookup's gradient goes back to them as rows, instead of all-gathering and
    reduce-scattering the whole table (per forward, whichever moves fewer bytes; see
    [Note: row-sparse embedding tables]). A table tied to the LM head is gathered behind
    the blocks and waited for at the head. Given for the whole model, it serves every
    embedding weight; the other parameters get ``Rows()``."""

    alone: ClassVar[bool] = True
    serves_lookups: ClassVar[bool] = True

    def serves(self, orig: OriginalParam) -> bool:
        return _looked_up(orig)

    def refusal(self, orig: OriginalParam, strategy: ShardingStrategy) -> str | None:
        if not _looked_up(orig):
            used = sorted({type(m).__name__ for m, _ in orig.usages})
            return (
                f"RowSparse() serves nn.Embedding weights (2-D, looked up by an "
                f"nn.Embedding); this one is used by {', '.join(used)} with shape "
                f"{tuple(orig.param.shape)}: give it Rows()"
            )
        if strategy.shards_optimizer_across_replicas:
            return "HYBRID_SHARD_OPTIM's parameters view part of the shard: use Rows()"
        if orig.tp is not None:
            return "a tensor-parallel (DTensor) weight is sharded by its own mesh: use Rows()"
        return None

    def gathered_in(self, policy: torch.dtype | None) -> torch.dtype | None:
        return None  # lookups move rows in the compute dtype; a gather must match them

    def bind(self, flat: FlatParamGroup) -> GroupPlacement:
        # With F = 1 every row is local: the table is gathered (a no-op) like any group.
        return RowSparseTable(flat) if flat.needs_all_gather else GroupPlacement(flat)


def _looked_up(orig: OriginalParam) -> bool:
    return orig.param.dim() == 2 and any(isinstance(m, nn.Embedding) for m, _ in orig.usages)


class TableProxy(torch.Tensor):
    """What an embedding module holds as its weight in forward: the table's shape, dtype and
    device, no data; ``F.embedding`` on it is the table's row-sparse lookup."""

    table: RowSparseTable
    _METADATA: ClassVar[frozenset[str]] = frozenset({"__get__", "size", "dim", "numel", "stride"})

    @staticmethod
    def __new__(cls, table: RowSparseTable) -> TableProxy:
        flat = table.flat
        proxy = torch.Tensor._make_wrapper_subclass(
            cls,
            flat.full_shapes[0],
            dtype=flat.compute_dtype,
            device=flat.compute_device,
            requires_grad=flat.requires_grad,
        )
        proxy.table = table
        return proxy

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            table = _table_of(args, kwargs)
            return table.eager_lookup(table, *args, **kwargs)
        if getattr(func, "__name__", "") in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        table = _table_of(args, kwargs)
        raise RuntimeError(
            f"flatshard: '{table.name}' is a row-sparse embedding table in forward "
            f"(placement flatshard.RowSparse()) and was used by "
            f"{getattr(func, '__name__', func)} (rank {global_rank()}); in forward only "
            f"nn.Embedding's lookup (F.embedding) reads it. Read the weight through a module "
            "that is not an nn.Embedding (it then gets the gathered table), or give the "
            "table the placement flatshard.Rows()."
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        raise RuntimeError(
            f"flatshard: {func} on a row-sparse embedding table (rank {global_rank()}); in "
            "forward only nn.Embedding's lookup reads it (placement flatshard.Rows() to "
            "gather it)."
        )


def _row_sparse_lookup(table: RowSparseTable, *args: Any, **kwargs: Any) -> torch.Tensor:
    return table.lookup(*args, **kwargs)


@cache
def _eager() -> Callable[..., torch.Tensor]:
    """``table.lookup``, never traced by torch.compile: its ids' values decide the
    collectives' sizes (``torch.unique``, the count matrix), which a graph cannot hold; the
    blocks' graphs around it stay whole ([Note: hooks and torch.compile]). Made by the first
    table: ``torch.compiler.disable`` imports torch._dynamo (1.3 s), which ``import
    flatshard`` should not pay for."""
    return cast(
        Callable[..., torch.Tensor],
        torch.compiler.disable(_row_sparse_lookup, recursive=True),  # type: ignore[no-untyped-call]
    )


_EXCHANGES = {"lookup": "the forward lookup", "gradient": "the gradient exchange (end of backward)"}


def _exchange_code(name: str, what: str) -> int:
    """The same integer on every rank for the same table and exchange, others differ."""
    return (zlib.crc32(name.encode()) << 1) | (what == "gradient")


def _registry(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameter dict, written directly (as ``register_views`` does)."""
    return cast(dict[str, torch.Tensor], module._parameters)


def _table_of(args: Any, kwargs: dict[str, Any]) -> RowSparseTable:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, TableProxy):
            return value.table
    raise AssertionError("a TableProxy call without a TableProxy")


class RowSparseTable(GroupPlacement):
    """The row-sparse path of one embedding weight alone in its flat group (see the note)."""

    serves_lookups: ClassVar[bool] = True

    def __init__(self, flat: FlatParamGroup) -> None:
        super().__init__(flat)
        orig = flat.originals[0]
        self.name = orig.fqn
        self.lookup_usages = [(m, n) for m, n in orig.usages if isinstance(m, nn.Embedding)]
        self.dense_usages = [(m, n) for m, n in orig.usages if not isinstance(m, nn.Embedding)]
        self.tied = bool(self.dense_usages)
        layout, slot = flat.layout, flat.layout.slots[0]
        self.dim = slot.row_numel
        self.vocab = slot.rows
        held = [layout.shard_range(slot, r) for r in range(flat.factor)]
        self.first_rows = [h.first_row if h.rows else slot.rows for h in held]
        self.ends = [h.first_row + h.rows if h.rows else slot.rows for h in held]
        self.held = held[flat.rank]
        self.proxied = False  # the lookup modules hold the proxy (between unshard and reshard)
        # Since the last gradient exchange (every rank alike, decided in forward):
        self.exchange_due = False  # a sparse lookup with grad ran
        self.dense_due = False  # a dense lookup with grad ran (its gradient is in the flat leaf)
        # (unique ids, their row gradients, the lookup's tokens)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.sent = TableTraffic()
        self.eager_lookup = _eager()  # made here: the traced proxy call only reads it

    # ------------------------------------------------------------------ views
    def start_unshard(self, held: bool) -> None:
        """Left to the lookups (or the head), unless ``flatshard.unshard`` holds the unit."""
        if held:
            self.flat.start_unshard()

    def unshard(self, backward: bool, held: bool) -> None:
        """The unit unshards: the lookup modules get the proxy. A tied table's head keeps
        its original until its pre-forward hook (``before_dense_use``); in backward the
        head's backward needs the table at once. Held by ``flatshard.unshard``: gathered."""
        flat = self.flat
        if held:
            flat.unshard()
            return
        flat.drop_stale_gather()
        gathered = flat.is_unsharded or flat.gather_in_flight
        if gathered or (backward and self.tied):
            flat.unshard()  # full views everywhere (the head's backward reads its own)
        proxy = TableProxy(self)
        for module, name in self.lookup_usages:
            _registry(module)[name] = proxy
        if flat.holding is Holding.ORIGINALS:  # full views elsewhere stay VIEWS
            flat.holding = Holding.PROXY
        self.proxied = True

    def before_dense_use(self) -> None:
        """A tied table's other module (the head) is about to run: wait for the table."""
        if not self.proxied:
            return  # outside the unit's forward (summon_full_params): the unit's own views
        flat = self.flat
        flat.start_unshard()
        flat.finish_unshard()
        view = flat.views.full_views(flat.unsharded)[0]
        for module, name in self.dense_usages:
            _registry(module)[name] = view

    # ------------------------------------------------------------------ forward
    def lookup(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> torch.Tensor:
        """``F.embedding(input, table, ...)``: the rows of ``input`` (see the note)."""
        if max_norm is not None:
            raise ValueError(max_norm_message(self.name, max_norm))
        flat = self.flat
        if flat.is_unsharded or flat.gather_in_flight:
            return self._dense(input, padding_idx, scale_grad_by_freq)
        # int64 on every rank (ids may come as int32): the exchanges pair by dtype too
        ids = input.reshape(-1).long()
        unique, inverse = self._unique(ids)
        matrix = self._count_matrix(unique, "lookup")
        if not self.sparse_pays(matrix):
            return self._dense(input, padding_idx, scale_grad_by_freq)
        rows = self._fetch(unique, matrix)
        if self.tied:
            flat.start_unshard()  # the head's table travels while the blocks compute
        grad = torch.is_grad_enabled() and flat.requires_grad
        leaf = rows.detach().requires_grad_(grad)
        if grad:
            self.exchange_due = True
            register = cast(
                Callable[[Callable[[torch.Tensor], None]], object],
                leaf.register_post_accumulate_grad_hook,
            )
            tokens = ids.numel()  # (an int: the hook keeps no copy of the ids alive)
            register(lambda t: self._keep_grad(unique, t, tokens))
        local_pad = None
        if padding_idx is not None and not ids.is_meta:  # (meta: no values, same shapes)
            at = int(torch.searchsorted(unique, padding_idx))
            present = at < unique.numel() and int(unique[at]) == padding_idx
            local_pad = at if present else None
        index = inverse.view(input.shape)
        return F.embedding(index, leaf, local_pad, None, norm_type, scale_grad_by_freq, False)

    def _dense(
        self, input: torch.Tensor, padding_idx: int | None, scale_grad_by_freq: bool
    ) -> torch.Tensor:
        """Look up the gathered table (gathering it first if need be)."""
        flat = self.flat
        flat.start_unshard()
        flat.finish_unshard()
        self.sent.dense_lookups += 1
        if torch.is_grad_enabled() and flat.requires_grad:
            self.dense_due = True
        table = flat.views.full_views(flat.unsharded)[0]
        return F.embedding(input, table, padding_idx, None, 2.0, scale_grad_by_freq, False)

    def sparse_pays(self, matrix: list[list[int]]) -> bool:
        """The rule of the note: sparse when its ids and rows are fewer bytes than the
        table's all-gather and reduce-scatter."""
        f = self.flat.factor
        asked = sum(matrix[s][d] for s in range(f) for d in range(f) if s != d)
        compute = torch.finfo(self.flat.compute_dtype).bits // 8
        reduce = torch.finfo(self.flat.reduce_dtype).bits // 8
        sparse = asked * (2 * _ID_BYTES + self.dim * (compute + reduce))
        dense = f * (f - 1) * self.flat.layout.shard_numel * (compute + reduce)
        return sparse < dense

    def _fetch(self, unique: torch.Tensor, matrix: list[list[int]]) -> torch.Tensor:
        """The rows of ``unique`` (sorted), from their owners, in the compute dtype."""
        flat, me = self.flat, self.flat.rank
        send = matrix[me][:-1]
        recv = [row[me] for row in matrix]
        group = self._group
        tag = flat.on_collective("all_to_all", flat.factor)
        requests = unique.new_empty(sum(recv))
        exchange_rows(requests, unique, recv, send, group, tag)
        shard_rows = self._shard_rows()  # on the host where offloaded
        local = (requests - self.first_rows[me]).to(shard_rows.device)
        answers = shard_rows.index_select(0, local)
        answers = answers.to(flat.compute_device, flat.compute_dtype)
        rows = answers.new_empty(unique.numel(), self.dim)
        tag = flat.on_collective("all_to_all", flat.factor)
        exchange_rows(rows, answers, send, recv, group, tag)
        self.sent.lookups += 1
        self.sent.lookup_ids += sum(send) - send[me]
        self.sent.lookup_rows += (sum(recv) - recv[me]) * self.dim
        return rows

    # ------------------------------------------------------------------ backward
    def _keep_grad(self, unique: torch.Tensor, leaf: torch.Tensor, tokens: int) -> None:
        assert leaf.grad is not None
        grad = leaf.grad
        leaf.grad = None
        self._pending.append((unique, grad.to_dense() if grad.is_sparse else grad, tokens))

    def exchange_gradient(self) -> torch.Tensor:
        """This rank's shard-sized gradient (C,): every rank's lookup rows of the rows it
        holds, summed in source-rank order, divided by the first part of W
        (``split_division``); blocking. Clears what the lookups left."""
        flat, me = self.flat, self.flat.rank
        ids, rows = self._merged()
        rows = rows.to(flat.reduce_dtype)
        pre, _ = flat.reduction.division  # as the dense reduction divides
        if pre != 1:
            rows.div_(pre)
        matrix = self._count_matrix(ids, "gradient")
        send = matrix[me][:-1]
        recv = [row[me] for row in matrix]
        tag = flat.on_collective("all_to_all", flat.factor)
        requests = ids.new_empty(sum(recv))
        exchange_rows(requests, ids, recv, send, self._group, tag)
        got = rows.new_empty(sum(recv), self.dim)
        tag = flat.on_collective("all_to_all", flat.factor)
        exchange_rows(got, rows, recv, send, self._group, tag)
        out = torch.zeros(flat.layout.shard_numel, dtype=rows.dtype, device=rows.device)
        self._held_rows(out).index_add_(0, requests - self.first_rows[me], got)
        self.sent.grad_ids += sum(send) - send[me]
        self.sent.grad_rows += (sum(send) - send[me]) * self.dim
        self.exchange_due = False
        return out

    def views_returned(self) -> None:
        self.proxied = False

    def forward_pre_hooks(self) -> list[tuple[nn.Module, Callable[[], None]]]:
        """A tied table's head waits for its gather before it runs."""
        return [(user, self.before_dense_use) for user, _ in self.dense_usages]

    def traffic(self) -> tuple[str, TableTraffic] | None:
        return self.name, self.sent

    def comm_hook_conflict(self) -> str | None:
        return self.name

    def custom_collective_conflict(self) -> str | None:
        return self.name

    def start_reduction(
        self, all_reduce: bool, in_flight: GradientReduction | None
    ) -> GradientReduction | None:
        """Out of the chain: a tied table's head part, reduced first in backward and the
        largest, is waited for at the end of backward, not by the next unit's reduction,
        whose backward is too short to hide it."""
        self.flat.reduction.start(all_reduce)
        return in_flight

    def post_forward_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return None  # a table is never gathered whole for forward: nothing to keep

    def finish_reduction(self, all_reduce: bool) -> None:
        """End of backward: reduce the dense part (a tied head's, a dense lookup's) if it
        did not reach the group's hook, and exchange the lookups' rows: the same calls on
        every rank, decided by what every rank's forward decided alike."""
        flat = self.flat
        if (self.tied or self.dense_due) and not flat.reduction.done_in_backward:
            flat.reduction.start(all_reduce)
        if self.exchange_due:
            flat.reduction.add_sparse(self.exchange_gradient(), all_reduce)
        self.dense_due = False  # a synchronized backward reduced what the flat leaf held

    def drop_pending(self) -> None:
        """``zero_grad``: the lookups' rows kept since the last exchange go. The exchange
        itself stays due (every rank issues it alike), with no rows from this rank."""
        self._pending = []

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending row gradients as (sorted unique ids, summed rows), in the order the
        lookups ran (as autograd would have summed one dense gradient)."""
        pending, self._pending = self._pending, []
        if not pending:
            device = self.flat.compute_device
            ids = torch.empty(0, dtype=torch.long, device=device)
            return ids, torch.empty(0, self.dim, dtype=self.flat.compute_dtype, device=device)
        if len(pending) == 1:
            return pending[0][:2]
        ids = torch.cat([i for i, _, _ in pending])
        rows = torch.cat([g for _, g, _ in pending])
        unique, inverse = self._unique(ids, sum(t for _, _, t in pending))
        merged = rows.new_zeros(unique.numel(), self.dim).index_add_(0, inverse, rows)
        return unique, merged

    # ------------------------------------------------------------------ helpers
    @property
    def _group(self) -> torch.distributed.ProcessGroup:
        group = self.flat.groups.shard
        assert group is not None  # a table exists only where F > 1
        return group

    def _shard_rows(self) -> torch.Tensor:
        """This rank's rows of the table, (rows, dim), in the master dtype."""
        return self._held_rows(self.flat.shard)

    def _held_rows(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """The table's rows in a (C,) tensor laid out like the shard, as (rows, dim)."""
        held = self.held
        return flat_shard[held.local_offset : held.local_offset + held.numel].view(
            held.rows, self.dim
        )

    def _unique(
        self, ids: torch.Tensor, tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` made unique (sorted) and each id's position among them; on the meta
        device (a plan) as many as ``tokens`` (default: the ids) can hold ([Note: row-sparse
        tables in a plan])."""
        if not ids.is_meta:
            found, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            return found, inverse
        unique = min(ids.numel() if tokens is None else tokens, self.vocab)
        return ids.new_empty(unique), torch.zeros_like(ids)

    def _planned_matrix(self, unique: int) -> list[list[int]]:
        """A plan's count matrix: every rank's ``unique`` ids spread over the owners as
        their rows are (rounded at the owners' bounds, so the counts sum to ``unique``)."""
        at = [round(unique * end / self.vocab) for end in [0, *self.ends]]
        row = [b - a for a, b in pairwise(at)]
        return [[*row, 0] for _ in range(self.flat.factor)]

    def _count_matrix(self, unique: torch.Tensor, what: str) -> list[list[int]]:
        """Every rank's ids per owner (F + 1 columns: the last is out of range).

        Each rank also sends which exchange follows (this table's lookup or gradient,
        ``_exchange_code``): ranks in different exchanges would otherwise pair all-to-alls
        of different sizes, which gloo ends with an abort of the process; seen here, the
        same error is raised on every rank instead."""
        f = self.flat.factor
        ends = torch.tensor(self.ends, dtype=unique.dtype, device=unique.device)
        below = torch.searchsorted(unique, ends)  # ids < each owner's end
        negative = torch.searchsorted(
            unique, torch.zeros(1, dtype=unique.dtype, device=unique.device)
        )
        starts = torch.cat([negative, below[:-1]])
        code = negative.new_full((1,), _exchange_code(self.name, what))
        counts = torch.cat([below - starts, (negative + unique.numel() - below[-1:]), code])
        gathered = counts.new_empty(f * (f + 2))
        tag = self.flat.on_collective("all_gather", f + 2)
        all_gather_into(gathered, counts, self._group, tag)
        if unique.is_meta:  # a plan: no values to count
            return self._planned_matrix(unique.numel())
        matrix: list[list[int]] = gathered.view(f, f + 2).tolist()
        codes = [row.pop() for row in matrix]
        if len(set(codes)) > 1:
            raise CollectiveMismatchError(self._mismatch(codes))
        bad = [r for r, row in enumerate(matrix) if row[-1]]
        if bad:
            raise IndexError(
                f"flatshard: embedding '{self.name}' was asked for token ids outside [0, "
                f"{self.vocab}) ({what}) on shard rank(s) {bad} (this is rank "
                f"{global_rank()}); check the tokenizer's vocabulary against the table."
            )
        return matrix

    def _mismatch(self, codes: list[int]) -> str:
        """Which exchange each shard rank was in, for ranks that disagree."""
        named = {
            _exchange_code(self.name, w): f"{_EXCHANGES[w]} of '{self.name}'" for w in _EXCHANGES
        }
        doing = "; ".join(
            f"shard rank {r}: {named.get(c, 'an exchange of another table')}"
            for r, c in enumerate(codes)
        )
        return (
            f"flatshard: ranks reached different row-sparse exchanges (this is rank "
            f"{global_rank()}): {doing}. {SAME_CALLS}"
        )
