"""Meta ops answered from what the same op answered before on the same shapes.

[Note: meta ops remembered]
A plan runs a real training step on the meta device ([Note: simulated step]), and much of
torch's meta support is Python: a layer norm's output shapes cost 1-3 ms to derive through
torch's reference decompositions, an elementwise op's 0.1-0.3 ms, where the recorder's own
bookkeeping costs tens of microseconds. A step repeats the same ops on the same shapes
(every block alike), a plan runs two steps, and a budget search plans tens of candidates
of one model. What a meta op makes depends only on the op, its arguments' sizes, strides
and dtypes and its other arguments, so the first answer is kept and later calls are
answered from it:

- an op that makes new tensors and aliases none of its inputs: new empty meta tensors of
  the remembered sizes, strides and dtypes (its storage's size checked the first time: an
  answer that an empty tensor would not repeat is not kept);
- an in-place op (torch's ``inplace`` tag without ``inplace_view``: it writes its first
  argument and changes no size or stride): its first argument, or nothing where the op
  returns nothing (the ``_foreach_`` ops);
- everything else runs: views (they share their input's storage), collectives, ops that
  resize or change a tensor's shape in place, ops on anything but plain meta tensors, and
  arguments that cannot be a dictionary key.

A call that raised is not remembered, so it raises again. ``tests/test_plan.py`` plans
the same setups with and without remembering and compares every recorded op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Empty:
    """A new tensor as remembered: what an empty meta tensor needs to be the same."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


_Answer = Any  # an _Empty, a tuple or list of answers, or None
_Kind = str  # "new" (fresh outputs), "in place" (its first argument), "" (always run)
_PLAIN = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
# Tensors with no dispatch of their own (a subclass such as DTensor has: its ops run).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_FIRST = "its first argument"  # what an in-place op returns, or None
_MOST_KEPT = 100_000  # answers; the dictionary starts over past this (a NaN argument ...)
_RESIZING = ("resize", "set_", "as_strided")


class _Unkeyable(Exception):
    """An argument that cannot be part of a dictionary key."""


class MetaOps:
    """``__call__(func, args, kwargs)``: what ``func(*args, **kwargs)`` returns, from a
    remembered answer where there is one ([Note: meta ops remembered])."""

    def __init__(self) -> None:
        self.enabled = True
        self._kinds: dict[Any, _Kind] = {}
        self._answers: dict[tuple[Any, ...], _Answer] = {}

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind = self._kind(func)
        if not kind or not self.enabled:
            return func(*args, **kwargs)
        try:
            # a factory op without a dtype or device takes the process's defaults
            defaults = (torch.get_default_dtype(), torch.get_default_device())
            key = (func, defaults, _key(args), _key(kwargs))
        except _Unkeyable:
            return func(*args, **kwargs)
        if key in self._answers:
            answer = self._answers[key]
            if kind == "in place":
                return args[0] if answer == _FIRST else None
            return _made(answer)
        out = func(*args, **kwargs)
        if len(self._answers) >= _MOST_KEPT:
            self._answers.clear()
        if kind == "in place":
            if out is args[0] or out is None:  # foreach ops return nothing
                self._answers[key] = _FIRST if out is args[0] else None
        else:
            answer = _answer(out, args, kwargs)
            if answer is not None:
                self._answers[key] = answer
        return out

    def _kind(self, func: Any) -> _Kind:
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind_of(func)
        return kind


def _kind_of(func: Any) -> _Kind:
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
        return ""
    schema = func._schema
    name = func.__name__
    if any(part in name for part in _RESIZING):
        return ""
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if torch.Tag.inplace in func.tags and torch.Tag.inplace_view not in func.tags:
        first = schema.arguments[0] if schema.arguments else None
        return "in place" if written and written == [first] else ""
    if schema.is_mutable or written or any(r.alias_info is not None for r in schema.returns):
        return ""
    return "new"


def _key(value: Any) -> Any:
    if type(value) in _PLAIN_TENSORS:
        if not value.is_meta or value.layout != torch.strided:
            raise _Unkeyable
        return (value.shape, value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, _PLAIN):
        # With its type: 2 == 2.0 == True, but an integer tensor plus 2.0 is a float one.
        return (type(value), value)
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_key, value))
    if isinstance(value, dict):
        return tuple((name, _key(item)) for name, item in value.items())
    raise _Unkeyable


def _answer(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Answer:
    """What to keep of ``out``: None where empty tensors would not repeat it."""
    inputs = {id(t.untyped_storage()) for t in tensors([args, kwargs])}
    outputs = tensors(out)
    storages = {id(t.untyped_storage()) for t in outputs}
    if len(storages) != len(outputs) or storages & inputs:
        return None
    try:
        answer = _kept(out)
    except _Unkeyable:
        return None
    again = tensors(_made(answer))
    same = all(
        a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        for a, b in zip(again, outputs, strict=True)
    )
    return answer if same else None


def _kept(out: Any) -> _Answer:
    if type(out) is torch.Tensor:
        if not out.is_meta or out.layout != torch.strided or out.storage_offset() != 0:
            raise _Unkeyable
        return _Empty(tuple(out.shape), out.stride(), out.dtype)
    if out is None:
        return None
    if isinstance(out, list | tuple):
        return type(out)(map(_kept, out))
    raise _Unkeyable


def _made(answer: _Answer) -> Any:
    if isinstance(answer, _Empty):
        return torch.empty_strided(answer.sizes, answer.strides, dtype=answer.dtype, device="meta")
    if isinstance(answer, list | tuple):
        return type(answer)(map(_made, answer))
    return None


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a tree of lists, tuples and dictionaries (an op's arguments)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors(item)]
    return []


REMEMBERED = MetaOps()


@contextmanager
def not_remembered() -> Iterator[None]:
    """Every meta op runs (the reference ``tests/test_plan.py`` compares against)."""
    REMEMBERED.enabled = False
    try:
        yield
    finally:
        REMEMBERED.enabled = True
