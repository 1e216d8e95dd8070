"""``no_sync``: accumulate gradients locally, reduce once (paper mechanism 7)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from torch import nn

from flatshard.runtime._join import note_span
from flatshard.runtime._step import StepContext, agree, contexts_under


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced.

    The first backward outside the context adds its gradient to the kept ones and reduces
    the sum once per flat parameter group. It costs a full-size (unsharded) gradient per
    flat parameter group between those backward passes, and saves all their communication.
    Enter it on every rank alike.
    """
    contexts = contexts_under(model, "no_sync")
    note_span(lambda: no_sync(model))  # (inside join: first, as its replay enters it)
    agree(model, "no_sync")
    try:
        with sync_off(contexts):
            yield
    finally:
        note_span(None)


@contextmanager
def sync_off(contexts: list[StepContext]) -> Iterator[None]:
    """Gradient sync off for the body, without agreeing: for a caller every rank agreed
    on already (``no_sync`` itself, ``train_step``)."""
    previous = [context.sync_gradients for context in contexts]
    for context in contexts:
        context.switches = replace(context.switches, requires_gradient_sync=False)
    try:
        yield
    finally:
        for context, value in zip(contexts, previous, strict=True):
            context.switches = replace(context.switches, requires_gradient_sync=value)
