"""Fault-tolerant replica groups on torchft: flatshard inside each group, torchft across them.

[Note: what flatshard hands torchft]
torchft (``pip install 'flatshard[ft]'``) makes data parallelism across *replica groups*
survive failures without a restart: every step a quorum of the live groups forms (its
Lighthouse decides), the groups' gradients are averaged over that quorum through its
managed process group, and ``should_commit`` decides whether the optimizer steps (not
where an all-reduce failed, or too few groups took part); a group that joins late, or
comes back, copies the model and optimizer state from a live group over the network.
Inside a group, flatshard shards as usual over the group's own ranks (any strategy;
``torchrun`` per group). flatshard hands torchft:
- the replicas' sum: the all-reduce hook (``flatshard.set_all_reduce_hook``) of every
  unit, ``Manager.allreduce`` on each reduced gradient shard (already averaged over the
  group's ranks; torchft divides by the quorum's groups): rank r of every group holds the
  same rows, so the groups' ranks r sum the same shards;
- the state a recovering group receives (``state_dict_fns``): each rank's shards of the
  parameters and buffers, its optimizers' state, as they live (the same layout in every
  group), and what the caller adds (the data position).
torchft owns the quorum, the Lighthouse, the managed process group, the commit decision,
the step count and the transfer of the state. A whole group fails together: torchft
tolerates the loss of groups, not of some ranks of one (those stop their group, and
torchrun's restart brings it back as a recovering group).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flatshard.runtime import set_all_reduce_hook, sharding_summary, unit_modules

__all__ = ["ManagerAllReduce", "replicate_with", "state_dict_fns"]


class ManagerAllReduce:
    """The all-reduce hook that averages a reduced gradient shard over torchft's quorum:
    ``Manager.allreduce`` (a no-op once the step has failed; ``should_commit`` then says
    False on every group). With ``layout`` (``replicate_with`` gives it), the first shard
    of each step is preceded by the groups' check of their layouts ([Note: replica groups
    agree on their layout])."""

    def __init__(self, manager: Any, layout: torch.Tensor | None = None) -> None:
        self.manager = manager
        self.layout = layout
        self._checked_step = -1

    def __call__(self, shard: torch.Tensor) -> None:
        step = int(self.manager.current_step())
        if self.layout is not None and step != self._checked_step:
            self._checked_step = step
            self._check_layout()
        self.manager.allreduce(shard).wait()

    def _check_layout(self) -> None:
        """[Note: replica groups agree on their layout]
        A group that built another model, or sharded it otherwise (strategy, units, ranks
        per group), would average gradient shards of other rows with the others' and
        train silently wrong. Each step, before its first shard, the groups average their
        layout's digest (three 16-bit parts, exact in floating point): a group whose
        digest differs from the average finds out, and every group of the quorum with it.
        One all-reduce of three numbers a step, keyed on the step count: a step taken again
        is not checked again (groups whose commits differed are at different steps, and the
        next quorum heals the one behind to the others' step before any all-reduce)."""
        assert self.layout is not None
        average = self.layout.clone()
        self.manager.allreduce(average).wait()
        if not torch.equal(average, self.layout):
            raise ValueError(
                "flatshard.integrations.torchft: the replica groups in this step's quorum "
                "built different models or sharded them otherwise (their layouts' digests "
                f"differ; this group's is {_digest_text(self.layout)}). Every group must "
                "build the same model and shard it alike (strategy, units, ranks per group)."
            )


def replicate_with(model: nn.Module, manager: Any) -> None:
    """Average the gradients of every unit inside sharded ``model`` across torchft's replica
    groups each step, through ``manager`` (a ``torchft.Manager``; see the module's note).
    Wrap the optimizers in ``torchft.optim.OptimizerWrapper(manager, optim)`` (the quorum
    at ``zero_grad``, ``should_commit`` before ``step``), and give the manager
    ``state_dict_fns(model, optimizers)``."""
    _require_torchft()
    if not unit_modules(model):
        raise ValueError(
            "flatshard.integrations.torchft.replicate_with: the model is not sharded; call "
            "flatshard.fully_shard on it first (over the replica group's own ranks)"
        )
    set_all_reduce_hook(model, ManagerAllReduce(manager, layout_digest(model)))


def layout_digest(model: nn.Module) -> torch.Tensor:
    """The model's layout as three 16-bit numbers: its parameters' names, shapes and
    dtypes, and how flatshard shards them (units, rows per rank, the ranks)."""
    text = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()])
    text += str(sharding_summary(model))
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")
    parts = [(value >> shift) & 0xFFFF for shift in (32, 16, 0)]
    device = next(model.parameters()).device
    return torch.tensor(parts, dtype=torch.float32, device=device)


def _digest_text(layout: torch.Tensor) -> str:
    return "".join(f"{int(v):04x}" for v in layout.tolist())


def state_dict_fns(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
) -> tuple[Callable[[dict[str, Any]], None], Callable[[], dict[str, Any]]]:
    """``(load_state_dict, state_dict)`` for ``torchft.Manager``: this rank's shards of the
    parameters and buffers and its optimizers' state, exactly as they live (every group has
    the same layout, and rank r of a recovering group copies rank r of a live one).
    ``extra``: (get, set) of the caller's own state to send along (the data position)."""

    def state_dict() -> dict[str, Any]:
        state: dict[str, Any] = {
            "params": [p.detach() for p in model.parameters()],
            "buffers": [b.detach() for b in model.buffers()],
            "optimizers": [o.state_dict() for o in optimizers],
        }
        if extra is not None:
            state["extra"] = extra[0]()
        return state

    def load_state_dict(state: dict[str, Any]) -> None:
        params, buffers = list(model.parameters()), list(model.buffers())
        if len(state["params"]) != len(params) or len(state["buffers"]) != len(buffers):
            raise ValueError(
                "flatshard.integrations.torchft: the state a live replica group sent holds "
                f"{len(state['params'])} parameters and {len(state['buffers'])} buffers, "
                f"this group's model {len(params)} and {len(buffers)}: the groups must "
                "build the same model and shard it alike (strategy, ranks per group)"
            )
        with torch.no_grad():
            for mine, theirs in zip(
                params + buffers, state["params"] + state["buffers"], strict=True
            ):
                if mine.shape != theirs.shape:
                    raise ValueError(
                        "flatshard.integrations.torchft: a live replica group's shard has "
                        f"shape {tuple(theirs.shape)}, this group's {tuple(mine.shape)}: the "
                        "groups must shard alike (strategy, ranks per group)"
                    )
                mine.copy_(theirs)
        for optim, saved in zip(optimizers, state["optimizers"], strict=True):
            optim.load_state_dict(saved)
        if extra is not None:
            extra[1](state["extra"])

    return load_state_dict, state_dict


def _require_torchft() -> None:
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            "flatshard.integrations.torchft needs torchft: pip install 'flatshard[ft]' "
            "(or pip install torchft)"
        )
