"""What every rank must agree on: the configuration that decides which collectives a
model's ranks issue, and the startup check's lines (the model's structure and values).

[Note: the agreed configuration]
Ranks that differ in any option deciding their collectives (which, in what order, of what
size) hang in a collective, abort inside gloo on a size mismatch, or train silently wrong.
So those options are two frozen values, compared across ranks as lines of text:
- ``UnitConfig``, per unit: the options of the ``fully_shard`` call that made it (strategy,
  mixed precision, prefetch) and the per-unit calls after it (divide factor,
  communication hook, all-reduce hook, custom collectives, ``set_unshard_in_backward``,
  ``set_prefetch``);
- ``Switches``, per model (``StepContext``): the step's switches (FSDP2's ``set_*``).
Their lines are made from the dataclass fields (``config_lines``), so an option added as a
field is compared without anyone remembering to: ``fully_shard``'s startup check compares
the new units' ``UnitConfig`` (with the world size and the meta-init seed), and the values
change only through ``change_units`` / ``change_switches``, which agree the call and its
value on every rank through the c10d store (``collective_call``) before anything changes:
a rank that differs gets ``CollectiveMismatchError`` on every rank, a rank that calls alone
waits there and is reported, and nothing reaches the backend. Derived state (a reduction's
divide factor and hook, a group's custom collectives) is written from the value by
``Unit.configure`` alone.

The startup check also compares what every rank built: one line per unit, parameter (with
its placement) and buffer (``structure_lines``), and the values every rank must hold alike
(``value_lines``: replicated buffers, and weights with ``check_weights``). Ranks that built
different models would otherwise hang in a collective or train silently wrong (users
report this as a common failure). Each check is one small all-gather of a digest; only
when digests differ do the ranks exchange their descriptions to say what differs.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from flatshard.comm._agreement import join_name
from flatshard.comm._mesh import ShardingStrategy
from flatshard.flat._lookup_options import LOOKUPS
from flatshard.flat._mixed_precision import MixedPrecision
from flatshard.flat._partition import UnitMembers
from flatshard.flat._placement import ShardPlacement
from flatshard.runtime._prefetch import Prefetch, Prefetchable


@dataclass(frozen=True)
class UnitConfig:
    """How a unit runs: the options of the ``fully_shard`` call that made it, and the
    per-unit calls since. Every rank holds the same value (see the module's note)."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision | None
    prefetch: Prefetch
    # set_gradient_divide_factor: None divides by the world size (the average)
    gradient_divide_factor: float | None = None
    # flatshard.comm_hooks.register_comm_hook: None is the built-in reduction
    comm_hook: Callable[..., Any] | None = None
    # set_all_reduce_hook: runs on each reduced gradient shard (the replicas' all-reduce)
    all_reduce_hook: Callable[..., Any] | None = None
    # set_custom_all_gather / set_custom_reduce_scatter: None is torch's
    custom_all_gather: Callable[..., Any] | None = None
    custom_reduce_scatter: Callable[..., Any] | None = None
    # set_unshard_in_backward ([Note: a unit backward does not read])
    unshard_in_backward: bool = True
    # set_prefetch: the units named (compared by their labels), None: the predicted order
    prefetch_forward: tuple[Prefetchable, ...] | None = None
    prefetch_backward: tuple[Prefetchable, ...] | None = None


@dataclass(frozen=True)
class Switches:
    """A model's step switches, FSDP2's ``set_*`` methods (``_switches.py``); ``no_sync``
    sets ``requires_gradient_sync`` for its body."""

    requires_gradient_sync: bool = True
    # False: units stay gathered after backward for the next micro-batch's forward
    reshard_after_backward: bool = True
    # True/False for every unit whatever its strategy; an int N: to groups of N ranks;
    # None: as the strategy says (FULL_SHARD reshards, SHARD_GRAD_OP keeps)
    reshard_after_forward: bool | int | None = None
    # False, hybrid: reduce-scatter inside the shard group only, all-reduce the sum later
    requires_all_reduce: bool = True
    separate_reduce_scatter_group: bool = False


def config_lines(value: object, indent: str = "") -> list[str]:
    """One line per field of the dataclass ``value``: what ranks compare."""
    assert dataclasses.is_dataclass(value)
    return [f"{indent}{f.name}={describe(getattr(value, f.name))}" for f in fields(value)]


def describe(value: object) -> str:
    """``value`` as text that is equal on two ranks exactly when the values act alike:
    objects by class and fields (never by address), sets sorted."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Prefetchable):  # a unit, named as it is now (adoption renames)
        return value.label
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(describe(v) for v in value)) + "}"
    if dataclasses.is_dataclass(value):
        inner = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in fields(value))
        return f"{type(value).__qualname__}({inner})"
    if isinstance(value, functools.partial):  # what it calls, and with what
        return (
            f"functools.partial({describe(value.func)}, {describe(value.args)}, "
            f"{describe(value.keywords)})"
        )
    if inspect.ismethod(value):  # a bound method: its object's fields too
        return f"{describe(value.__self__)}.{value.__func__.__name__}"
    if callable(value) and hasattr(value, "__qualname__"):  # a function
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    kind = type(value)
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):  # an object: its class and its plain fields
        plain = {k: v for k, v in sorted(state.items()) if _is_plain(v)}
        inner = ", ".join(f"{k}={describe(v)}" for k, v in plain.items())
        return f"{kind.__module__}.{kind.__qualname__}({inner})"
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_plain(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str | torch.dtype | enum.Enum)


def unit_lines(label: str, config: UnitConfig) -> list[str]:
    return [f"unit '{label}':", *config_lines(config, indent="  ")]


def model_lines(switches: Switches, units: Iterator[tuple[str, UnitConfig]]) -> list[str]:
    """A whole model's configuration: its switches and every unit's options."""
    lines = ["switches:", *config_lines(switches, indent="  ")]
    for label, config in units:
        lines += unit_lines(label, config)
    return lines


# -------------------------------------- the startup check's lines: structure and values
_CHUNK_BYTES = 1 << 23  # bytes checksummed at a time
_WRAP = 1 << 64


def structure_lines(
    units: list[UnitMembers], options: list[str], placements: Mapping[str, ShardPlacement]
) -> list[str]:
    """The ``fully_shard`` call's ``options``, then one line per unit, parameter (with its
    placement) and buffer: what every rank must agree on."""
    lines = list(options)
    for members in units:
        lines.append(f"unit '{members.fqn or '<root>'}'")
        for orig in members.originals:
            p = orig.param
            lines.append(
                f"  parameter '{orig.fqn}' shape {tuple(p.shape)} {str(p.dtype)[6:]} "
                f"requires_grad={p.requires_grad} {placements[orig.fqn]!r}"
            )
            lookups = [m for m, _ in orig.usages if isinstance(m, LOOKUPS)]
            lines += [f"  '{orig.fqn}' looked up by {_lookup_line(m)}" for m in lookups]
        for mname, module in members.modules:
            for bname, buf in module._buffers.items():
                if buf is not None:
                    name = join_name(mname, bname)
                    lines.append(f"  buffer '{name}' shape {tuple(buf.shape)} {str(buf.dtype)[6:]}")
    return lines


def _lookup_line(e: nn.Embedding | nn.EmbeddingBag) -> str:
    """An embedding's options: each changes the result, or the path that serves it."""
    bag = f", mode={e.mode}" if isinstance(e, nn.EmbeddingBag) else ""
    return (
        f"nn.{type(e).__name__}(padding_idx={e.padding_idx}, max_norm={e.max_norm}, "
        f"norm_type={e.norm_type}, scale_grad_by_freq={e.scale_grad_by_freq}, "
        f"sparse={e.sparse}{bag})"
    )


def value_lines(
    members: UnitMembers, with_params: bool, skip: frozenset[str] = frozenset()
) -> list[str]:
    """Exact checksums of the unit's buffers (and parameters, before sharding; but those
    named in ``skip``), each line starting with ``parameter '<name>'`` or ``buffer``."""
    named: list[tuple[str, torch.Tensor]] = []
    if with_params:
        for o in members.originals:
            if o.fqn in skip:
                continue
            value = o.param.detach() if o.tp is None else o.tp.startup_value(o.param.detach())
            if value is not None:
                named.append((f"parameter '{o.fqn}'", value))
    for mname, module in members.modules:
        for bname, buf in module._buffers.items():
            if buf is not None:
                named.append((f"buffer '{join_name(mname, bname)}'", buf))
    return [f"{name} checksum {checksum(t)}" for name, t in named if not t.is_meta]


def checksum(tensor: torch.Tensor, chunk: int = _CHUNK_BYTES) -> str:
    """An exact, order-sensitive checksum of the tensor's bytes (integer arithmetic): equal
    on every rank for equal bits (NaNs included), whatever the device. What the startup
    check, a write-back summon and a full state dict's load compare across ranks.

    The bytes are read as 8-byte words where their count allows (else 4-byte, else single
    bytes): a parameter costs one widening per 8 bytes, not per byte (it runs by default
    on every replicated parameter at ``fully_shard``: docs/performance.md). The words are
    summed plain and weighted by their position (from 1) in int64, products and sums
    wrapping the same on every rank. Taken ``chunk`` bytes at a time, the position weights
    made once (a chunk's are the first chunk's plus its start), so the extra memory is
    about twice ``chunk`` (plus the copy a non-contiguous tensor needs), not a multiple of
    the tensor, which would not fit beside a large unit on a GPU. The sums stay on the
    tensor's device: the host reads them once, at the end.
    """
    words = _words(tensor.detach().contiguous().reshape(-1))
    step = max(1, chunk // words.element_size())
    positions = torch.arange(1, min(step, words.numel()) + 1, device=words.device)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), step):
        part = words[start : start + step].to(torch.int64, copy=True)
        total = part.sum()
        plain += total
        weighted += part.mul_(positions[: part.numel()]).sum() + total * start
        del part  # before the next chunk's: loop variables outlive their turn
    return f"{int(plain) % _WRAP}:{int(weighted) % _WRAP}"  # int64's wrap, for any ``chunk``


def _words(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s bytes as the widest integer words that divide them."""
    data = flat.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if data.numel() % size == 0 and data.storage_offset() % size == 0:
            return data.view(dtype)
    return data
