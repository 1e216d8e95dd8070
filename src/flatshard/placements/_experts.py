"""Experts: expert parallelism as a placement, and the all-to-all that moves tokens to them.

[Note: expert parallelism]
``fully_shard(model, placement=rule)`` with ``flatshard.Experts(degree=E)`` for a mixture
of experts' stacked weights (``(num_experts, ...)``: torchtitan's ``GroupedExperts``
``w1``/``w2``/``w3``) cuts the model's W ranks, in order, into expert-parallel (EP) groups
of E consecutive ranks. The rank at place ``s`` of its EP group keeps experts
``[s * n / E, (s + 1) * n / E)`` of each such weight (a plain parameter of that local
shape, ``ExpertSlice`` recording where it lies in the global one), and shards it, in rows
as always, across the W / E ranks at the same place of every EP group (the expert
data-parallel group), which hold the same experts. Every other parameter is sharded across
all W ranks as before.

The module that holds the expert weights is called, as torchtitan's ``GroupedExperts``
is, with ``(tokens sorted by expert, tokens per expert (num_experts,))``. Before its
forward each rank sends every expert's rows to the EP rank that holds it (an all-to-all
with uneven splits, after one all-to-all of the counts), so the module computes only its
own experts, on the tokens of its whole EP group, grouped by local expert; after it the
outputs go back the same way, in the caller's order. Both all-to-alls are differentiable
(backward sends the gradients the opposite way). Routing, top-k, the auxiliary
load-balancing loss and the combine stay the caller's, and see the same tensors as
without expert parallelism.

Gradients. A rank's expert gradient is the sum over the tokens its EP group sent it,
so the sum over the expert data-parallel group covers every rank's tokens, and dividing
it by W (not by W / E, the group's size: ``ShardGroups.averaged_over``) is the
data-parallel average, the same DDP takes of the unsharded model. The gradient norm adds
each expert slice's partial sums over its data-parallel group and then over its EP group
(``SplitParam.group``): every element once. Full state dicts gather each slice over its
data-parallel group and then the slices over the EP group; checkpoint chunks carry the
slice's offset in the global weight, so a checkpoint loads at another EP degree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._collectives import all_gather_into, exchange_rows
from flatshard.comm._mesh import ShardGroups, ShardingStrategy, expert_groups
from flatshard.comm._watchdog import Tag
from flatshard.flat._partition import OriginalParam
from flatshard.flat._placement import ShardPlacement
from flatshard.flat._tensor_parallel import SplitParam, mark_split


@dataclass(frozen=True)
class ExpertSlice(SplitParam):
    """This rank's experts of a stacked expert weight: dim 0 cut across the EP group."""

    _parts_beside_model: ClassVar[bool] = False

    degree: int  # E > 1
    ep_group: dist.ProcessGroup
    data_groups: ShardGroups  # where the slice is sharded, and its gradient averaged

    @property
    def sharded(self) -> bool:
        return True

    @property
    def group(self) -> dist.ProcessGroup:
        return self.ep_group

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.shape[0] // self.degree, *self.shape[1:]))

    @property
    def how(self) -> str:
        return "by expert parallelism"

    def full(self, local: torch.Tensor) -> torch.Tensor:
        out = local.new_empty(self.degree * local.numel())
        all_gather_into(out, local.contiguous().reshape(-1), self.ep_group)
        return out.view(self.shape)

    def full_where_kept(self, local: torch.Tensor, keep: bool) -> torch.Tensor | None:
        """Joined on every rank: an EP group is part of the model's ranks, which do not
        keep alike (rank 0 only), so all of them take part and only keepers get it."""
        full = self.full(local)
        return full if keep else None

    def summoned(self, local: torch.Tensor) -> torch.Tensor:
        """Every expert: inside summon_full_params the model is whole on every rank, as in
        a full state dict, so state_dict(), load_state_dict() and a no-grad forward see
        what the unsharded model would."""
        return self.full(local)

    def summon_refusal(self) -> str | None:
        return None

    def startup_value(self, local: torch.Tensor) -> torch.Tensor | None:
        return None  # each rank holds its own experts


@dataclass(frozen=True)
class Experts(ShardPlacement):
    """Expert parallelism for a stacked expert weight ``(num_experts, ...)``: each group of
    ``degree`` consecutive ranks splits the experts between them (``num_experts / degree``
    each), and each slice is sharded across the ranks that hold the same experts. The module
    holding the weights receives, and returns, tokens sorted by expert with the count per
    expert, as torchtitan's ``GroupedExperts`` does; flatshard moves the tokens to the ranks
    that hold their experts and back ([Note: expert parallelism]).

    Give it through a rule, e.g. ``placement=lambda name, p: flatshard.Experts(2) if
    ".experts." in name else None``; given for the whole model it serves the 3-D weights.
    Shard the model over the whole world (the expert groups are made by every rank) with
    FULL_SHARD, SHARD_GRAD_OP or NO_SHARD.
    """

    degree: int = 1
    keeps_part: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) or self.degree < 1:
            raise ValueError(
                f"flatshard.Experts: degree must be a whole number >= 1 (the ranks that "
                f"split the experts between them), got {self.degree!r}"
            )

    def serves(self, orig: OriginalParam) -> bool:
        """Given for the whole model: the 3-D weights of modules that are not torch's own
        layers (a ``Conv1d`` weight is 3-D too)."""
        ours = all(not type(m).__module__.startswith("torch.nn") for m, _ in orig.usages)
        return orig.param.dim() == 3 and ours

    def part_refusal(
        self, orig: OriginalParam, siblings: Sequence[tuple[OriginalParam, ShardPlacement]]
    ) -> str | None:
        """The module holding expert weights computes this rank's experts only: each of
        its parameters must be cut alike (a per-expert bias left whole would be indexed
        by local expert, silently the wrong expert's)."""
        experts = orig.param.shape[0]
        for other, placement in siblings:
            if placement != self:
                return (
                    f"its module also holds '{other.fqn}' (shape "
                    f"{tuple(other.param.shape)}), placed {placement!r}; the module is "
                    f"called with this rank's experts only, so give every parameter of it "
                    f"{self!r} (a rule naming them, e.g. placement=lambda name, p: "
                    f"flatshard.Experts({self.degree}) if '.experts.' in name else None), "
                    "or move the others to another module"
                )
            if other.param.dim() < 1 or other.param.shape[0] != experts:
                return (
                    f"its module also holds '{other.fqn}' of shape "
                    f"{tuple(other.param.shape)}, whose dim 0 is not the {experts} experts "
                    f"of shape {tuple(orig.param.shape)}: every parameter of the experts "
                    "module must be stacked by expert"
                )
        return None

    def refusal(self, orig: OriginalParam, strategy: ShardingStrategy) -> str | None:
        shape = tuple(orig.param.shape)
        if orig.param.dim() < 1:
            return "a scalar has no expert dimension (dim 0)"
        if shape[0] % self.degree:
            return (
                f"its {shape[0]} experts (dim 0 of shape {shape}) are not divisible by the "
                f"expert-parallel degree {self.degree}; give a degree that divides "
                f"{shape[0]}"
            )
        if orig.tp is not None:
            return f"it is already split {orig.tp.how}"
        if strategy.is_hybrid:
            return (
                f"expert parallelism with {strategy.name} is not built yet; use FULL_SHARD, "
                "SHARD_GRAD_OP or NO_SHARD"
            )
        return None

    def take_part(
        self, orig: OriginalParam, model: dist.ProcessGroup, base: ShardGroups, rank: int
    ) -> None:
        size = dist.get_world_size(model)
        if size % self.degree:
            raise ValueError(
                f"flatshard.fully_shard: Experts(degree={self.degree}) for '{orig.fqn}' "
                f"(rank {rank}): the model's {size} ranks are not divisible into "
                f"expert-parallel groups of {self.degree}; give a degree that divides {size}."
            )
        if self.degree == 1:
            return  # every rank holds every expert: rows, as any parameter
        ep, data = expert_groups(model, self.degree)
        assert ep is not None, "a degree above 1 has an EP group"
        place = dist.get_rank(ep)
        whole = orig.param
        local = whole.shape[0] // self.degree
        start = place * local
        part = whole.detach()[start : start + local]
        param = nn.Parameter(
            part if whole.is_meta else part.clone(), requires_grad=whole.requires_grad
        )
        replicated = base.replicate is not None  # NO_SHARD: each slice whole on its ranks
        groups = ShardGroups(
            shard=None if replicated else data,
            replicate=data if replicated else None,
            averaged_over=size,
        )
        offset = (start, *(0 for _ in whole.shape[1:]))
        mark_split(param, ExpertSlice(whole.shape, whole.stride(), offset, self.degree, ep, groups))
        for module, name in orig.usages:
            module._parameters[name] = param
            _install_dispatch(module, name, whole.shape[0], ep, orig.fqn.rpartition(".")[0])
        orig.param = param

    def plan_refusal(self) -> str | None:
        return (
            "a simulated step runs on the meta device, where a router's choices (and so "
            "the tokens each expert gets) have no values. Plan the model without it for "
            "the rest of the step, and measure expert parallelism with flatshard bench "
            "--experts N --ep E."
        )

    def shard_groups(self, base: ShardGroups, members: Sequence[OriginalParam]) -> ShardGroups:
        split = members[0].tp
        return split.data_groups if isinstance(split, ExpertSlice) else base


# ---------------------------------------------------------------------- the token all-to-all


def _exchange(
    rows: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    label: str,
) -> torch.Tensor:
    """``_Exchange``, typed; ``label``: the experts module's name, for reports and waits."""
    moved: torch.Tensor = _Exchange.apply(rows, out_splits, in_splits, group, label)  # type: ignore[no-untyped-call]
    return moved


class TokenBytes:
    """Bytes this process received in the experts' token all-to-alls (rows and counts,
    forward and backward), since it started: what ``flatshard bench`` reports per step."""

    received: ClassVar[int] = 0


class _Exchange(torch.autograd.Function):
    """Rows to other ranks and back: forward sends ``in_splits[r]`` rows to rank r and
    receives ``out_splits[r]`` from it; backward sends the gradients the opposite way."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        label: str,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        exchange_rows(out, rows.contiguous(), out_splits, in_splits, group, Tag("forward", label))
        TokenBytes.received += out.numel() * out.element_size()
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        tag = Tag("backward", ctx.label)
        exchange_rows(back, grad.contiguous(), in_splits, out_splits, ctx.group, tag)
        TokenBytes.received += back.numel() * back.element_size()
        return back, None, None, None, None


@dataclass
class _Routed:
    """What the forward hook needs to send one call's outputs back."""

    back: torch.Tensor  # indices that put the experts' output rows in the received order
    out_splits: list[int]  # rows received from each EP rank
    in_splits: list[int]  # rows sent to each EP rank


_DISPATCH_ATTR = "_flatshard_expert_dispatch"


def _install_dispatch(
    module: nn.Module, weight: str, experts: int, ep: dist.ProcessGroup, label: str
) -> None:
    """Route the calls of ``module`` (holding the expert weight ``weight``) to the EP ranks
    holding each expert; not while it holds every expert (inside ``summon_full_params``,
    ``runtime/_by_hand.py``): it then computes them all, as the unsharded model does."""
    if getattr(module, _DISPATCH_ATTR, None) is not None:
        return
    pending: list[_Routed | None] = []  # one per call in flight (a recomputing forward nests)
    name = f"'{label}' ({type(module).__name__})"

    def before(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        tokens, counts, *rest = _call_args(args, name)
        held = module._parameters[weight]
        if held is not None and held.shape[0] == experts:  # whole: nothing to route
            pending.append(None)
            return args
        routed, received, local_counts = _dispatch(tokens, counts, experts, ep, label)
        pending.append(routed)
        return (received, local_counts.to(counts.dtype), *rest)

    def after(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        routed = pending.pop()
        if routed is None:
            return output
        if not isinstance(output, torch.Tensor) or output.shape[0] != routed.back.numel():
            raise TypeError(
                f"flatshard.Experts: the experts module {name} must return one tensor with "
                f"a row per token it was given ({routed.back.numel()}), got "
                f"{type(output).__name__}"
                + (f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else "")
            )
        received = output.index_select(0, routed.back)
        return _exchange(received, routed.in_splits, routed.out_splits, ep, label)

    handles = (module.register_forward_pre_hook(before), module.register_forward_hook(after))
    setattr(module, _DISPATCH_ATTR, handles)


def _call_args(args: tuple[Any, ...], name: str) -> tuple[Any, ...]:
    if (
        len(args) < 2
        or not isinstance(args[0], torch.Tensor)
        or not isinstance(args[1], torch.Tensor)
    ):
        raise TypeError(
            f"flatshard.Experts: the experts module {name} must be called with (tokens "
            "sorted by expert, tokens per expert), positionally, as torchtitan's "
            f"GroupedExperts is; got {len(args)} positional arguments. If it holds no "
            "experts, give Experts only to the expert weights, through a rule naming them."
        )
    return args


def _dispatch(
    tokens: torch.Tensor, counts: torch.Tensor, experts: int, ep: dist.ProcessGroup, label: str
) -> tuple[_Routed, torch.Tensor, torch.Tensor]:
    """Send each expert's rows to the EP rank holding it; return the rows this rank's
    experts got, grouped by local expert, and their counts per local expert."""
    degree, me = dist.get_world_size(ep), dist.get_rank(ep)
    local = experts // degree
    host = counts.detach().to("cpu", torch.int64)  # the splits are host numbers: one copy
    problem = _splits_problem(tokens, host, experts)
    # On the tokens' device: NCCL sends device tensors only.
    sent = torch.zeros(degree, 2 + local, dtype=torch.int64, device=tokens.device)
    sent[:, 0] = _COUNTS if problem is None else _BAD_COUNTS
    sent[:, 1] = experts
    if problem is None:
        sent[:, 2:] = host.view(degree, local)
    received_counts = torch.empty_like(sent)
    exchange_rows(received_counts, sent, [1] * degree, [1] * degree, ep, Tag("forward", label))
    TokenBytes.received += received_counts.numel() * received_counts.element_size()
    got = received_counts.cpu()
    ranks = dist.get_process_group_ranks(ep)
    name = f"'{label}'"
    if problem is not None:
        raise ValueError(f"flatshard.Experts: {name} on rank {ranks[me]}: {problem}")
    header = got[:, :2].tolist()  # (mark, experts) per source
    elsewhere = [ranks[s] for s, (mark, _) in enumerate(header) if mark not in _MARKS]
    if elsewhere:
        raise RuntimeError(
            f"flatshard.Experts: {name} on rank {ranks[me]}: what the ranks {elsewhere} of "
            "its expert-parallel group sent was not this call's token counts: they are "
            "elsewhere in the step (a rank skipped or repeated an MoE layer, or runs a "
            "backward the others do not). Every rank must call every experts module the "
            "same number of times, in the same order."
        )
    bad = [ranks[s] for s, (mark, n) in enumerate(header) if mark != _COUNTS or n != experts]
    if bad:
        raise ValueError(
            f"flatshard.Experts: {name} on rank {ranks[me]}: the ranks {bad} of its "
            "expert-parallel group passed tokens and counts that do not match (see the "
            "error on those ranks); every rank must call the experts with the same number "
            "of experts and counts that add up to its tokens."
        )
    matrix = got[:, 2:]  # (source, local expert): rows this rank receives
    in_splits = host.view(degree, local).sum(1).tolist()
    out_splits = matrix.sum(1).tolist()
    received = _exchange(tokens, out_splits, in_splits, ep, label)
    order = _by_local_expert(matrix).to(tokens.device)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    routed = _Routed(back, out_splits, in_splits)
    return routed, received.index_select(0, order), matrix.sum(0).to(counts.device)


# The first column of a count exchange: a mark that tells it from any other exchange
# (bytes of rows that a rank elsewhere in the step sent), and whether the sender's counts
# were good.
_COUNTS = 0x45585045525453  # "EXPERTS"
_BAD_COUNTS = _COUNTS + 1
_MARKS = (_COUNTS, _BAD_COUNTS)


def _splits_problem(tokens: torch.Tensor, counts: torch.Tensor, experts: int) -> str | None:
    if counts.dim() != 1 or counts.numel() != experts:
        return (
            f"the counts have shape {tuple(counts.shape)}, expected ({experts},): the tokens "
            "per expert of the whole model, every expert"
        )
    total = int(counts.sum())
    if total != tokens.shape[0]:
        return f"the counts add up to {total} tokens, but {tokens.shape[0]} rows were passed"
    return None


def _by_local_expert(matrix: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows received as (source, local expert) blocks into
    (local expert, source) blocks."""
    sources, local = matrix.shape
    starts = torch.cumsum(matrix.reshape(-1), 0) - matrix.reshape(-1)
    starts = starts.view(sources, local)
    pieces = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + matrix[s, e]))
        for e in range(local)
        for s in range(sources)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
