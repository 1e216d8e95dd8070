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

``ReplicaGroups(count, index, ...).join(model, optimizers)`` does all of it for a sharded
model (``flatshard train --ft-replicas`` and the Lightning strategy use it): the manager
over the group's ranks, the hook, the state, an optimizer that steps only what torchft
commits, and the quorum's members by step; the lower parts stay public for a loop of
one's own (torchtitan's way).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from flatshard.runtime import (
    agreed_configuration,
    set_all_reduce_hook,
    sharding_summary,
    unit_modules,
)

__all__ = [
    "CommittingOptimizer",
    "LayoutMismatch",
    "ManagerAllReduce",
    "NoQuorum",
    "ReplicaGroup",
    "ReplicaGroups",
    "replicate_with",
    "state_dict_fns",
]


class LayoutMismatch(ValueError):
    """Replica groups that built other models, sharded them otherwise or were told other
    numbers of groups met in a quorum, or in a heal."""


class NoQuorum(RuntimeError):
    """No quorum took this group's step within the quorum timeout (the message names the
    groups the Lighthouse has heard from)."""


@dataclass(frozen=True)
class ReplicaGroups:
    """This run as replica group ``index`` of ``count`` on torchft: each group its own
    run (its own ranks, the model sharded over them alike), every step averaged over the
    groups alive. ``lighthouse``: torchft's Lighthouse (``http://host:29510``; empty: the
    TORCHFT_LIGHTHOUSE variable); ``min_replicas``: the fewest groups a step commits with;
    ``quorum_timeout``: seconds a step waits for a quorum before ``NoQuorum``, and for a
    peer group's all-reduce or a heal's transfer before the step fails."""

    count: int
    index: int
    lighthouse: str = ""
    min_replicas: int = 1
    quorum_timeout: float = 60.0

    def __post_init__(self) -> None:
        where = "flatshard.integrations.torchft.ReplicaGroups"
        if self.count < 2:
            raise ValueError(f"{where}: count must be >= 2 replica groups, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"{where}: index must be 0 to {self.count - 1}, got {self.index}")
        if not 1 <= self.min_replicas <= self.count:
            raise ValueError(
                f"{where}: min_replicas must be 1 to {self.count}, got {self.min_replicas}"
            )
        if self.quorum_timeout <= 0:
            raise ValueError(f"{where}: quorum_timeout must be > 0 s, got {self.quorum_timeout}")

    def join(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> ReplicaGroup:
        """Join the replica groups with sharded ``model`` and its optimizers (every rank of
        the group, after ``fully_shard``); ``extra``: the caller's own state a recovering
        group receives too (see ``state_dict_fns``); ``settings``: what else every group
        must share (the training options: a group whose settings, optimizer settings or
        layout differ is named, [Note: replica groups agree on their layout])."""
        return ReplicaGroup(self, model, optimizers, extra, settings or {})


class ReplicaGroup:
    """This rank's part of a replica group: torchft's manager, the hook that averages the
    gradients over the quorum, and the quorum's members by committed step. Step with
    ``wrap(optimizer)``'s optimizer: its ``zero_grad`` starts the next quorum (a heal
    lands there, before the next forward), its ``step`` steps only what torchft commits."""

    def __init__(
        self,
        groups: ReplicaGroups,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        extra: tuple[Callable[[], Any], Callable[[Any], None]] | None,
        settings: Mapping[str, Any],
    ) -> None:
        _require_torchft()
        from torchft import Manager  # type: ignore[import-untyped]
        from torchft.process_group import (  # type: ignore[import-untyped]
            ProcessGroupGloo,
            ProcessGroupNCCL,
        )

        self.groups = groups
        self.lighthouse = groups.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not self.lighthouse:
            raise ValueError(
                "flatshard.integrations.torchft: replica groups need torchft's Lighthouse: "
                "give its address (http://host:29510) or set TORCHFT_LIGHTHOUSE (start one "
                "with: torchft_lighthouse --min_replicas 1 --bind [::]:29510)"
            )
        if not re.match(r"https?://[^/]+", self.lighthouse):
            raise ValueError(
                "flatshard.integrations.torchft: the Lighthouse's address must be a URL "
                f"such as http://host:29510, got {self.lighthouse!r}"
            )
        self.timeout = timedelta(seconds=groups.quorum_timeout)
        self._store, address, port = _group_store()  # (served as long as it lives)
        agreed = {**settings, "optimizers": optimizer_settings(optimizers)}
        layout = layout_digest(model, agreed)
        agreed_state = (layout, groups.count, agreed)
        load, save = state_dict_fns(model, optimizers, extra, agreed_state, groups.index)
        device = next(model.parameters()).device
        kind = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo
        try:
            self.manager = Manager(
                pg=kind(timeout=self.timeout),  # a frozen peer: this long, then the step fails
                min_replica_size=groups.min_replicas,
                load_state_dict=load,
                state_dict=save,
                replica_id=f"group{groups.index}",
                store_addr=address,
                store_port=port,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                lighthouse_addr=self.lighthouse,
                use_async_quorum=False,  # a heal applies before the step's forward
                quorum_timeout=self.timeout,
                timeout=self.timeout,
                connect_timeout=self.timeout,
            )
        except RuntimeError as error:  # torchft's client could not reach the Lighthouse
            raise NoQuorum(
                f"replica group {groups.index}: torchft's Lighthouse at {self.lighthouse} "
                f"did not answer within {self.timeout.total_seconds():g} s ({error}); check "
                "the address from this host, and that the Lighthouse runs."
            ) from None
        self.hook = replicate_with(model, self.manager, groups.index, groups.count, layout)
        self.quorum: tuple[int, ...] = ()  # the groups of the last committed step
        self.change: str | None = None  # how that step's quorum differs from the one before
        self.fewer = 0  # committed steps taken with fewer groups than ``count``
        self._pending = True  # the next step's quorum is still to start

    @property
    def step(self) -> int:
        """Optimizer steps committed so far (the manager's count, healed ones included)."""
        return int(self.manager.current_step())

    def start_quorum(self) -> None:
        """The next step's quorum, where it has not started yet (a late or restarted group
        heals in its first)."""
        if self._pending:
            self._pending = False
            with self.named_timeouts():
                self.manager.start_quorum()
                self.manager.wait_quorum()

    def should_commit(self) -> bool:
        """Whether the step's all-reduces went through on every group of the quorum and
        it took at least ``min_replicas`` groups (torchft's decision, every rank alike)."""
        with self.named_timeouts():
            committed = bool(self.manager.should_commit())
        self._pending = True
        if committed:
            self._note_quorum()
        return committed

    def wrap(self, optimizer: torch.optim.Optimizer) -> CommittingOptimizer:
        return CommittingOptimizer(optimizer, self)

    @contextmanager
    def named_timeouts(self) -> Iterator[None]:
        """Inside, torchft's quorum timeout is a ``NoQuorum`` naming the groups seen."""
        try:
            yield
        except TimeoutError:
            raise NoQuorum(
                f"replica group {self.groups.index}: no quorum formed within "
                f"{self.timeout.total_seconds():g} s (the quorum timeout). {self.seen()} "
                "The Lighthouse forms one once its --min_replicas groups ask: start the "
                "missing groups, or start the Lighthouse with fewer."
            ) from None

    def seen(self) -> str:
        """What the Lighthouse says of the groups it sees (its status page), if it answers."""
        try:
            with urllib.request.urlopen(f"{self.lighthouse}/status", timeout=5) as page:
                text = page.read().decode(errors="replace")
        except (OSError, ValueError):
            return f"The Lighthouse at {self.lighthouse} did not answer."
        status = re.search(r"Next quorum status:\s*([^<\n]*)", text)
        heard = sorted(set(re.findall(r"(group\d+):", text)))
        return (
            f"The Lighthouse at {self.lighthouse} says: "
            f"{status.group(1).strip() if status else 'nothing'}; groups it has heard from: "
            f"{', '.join(heard) or 'none'}."
        )

    def _note_quorum(self) -> None:
        """The quorum of the step just committed, and how it changed."""
        before = self.quorum
        self.quorum = self.hook.members or (self.groups.index,)
        if len(self.quorum) < self.groups.count:
            self.fewer += 1
        left = sorted(set(before) - set(self.quorum)) if before else []
        joined = sorted(set(self.quorum) - set(before)) if before else []
        said = [f"group {', '.join(map(str, left))} left"] if left else []
        said += [f"group {', '.join(map(str, joined))} joined"] if joined else []
        self.change = None
        if said:
            self.change = (
                f"step {self.step}: replica {' and '.join(said)}; {len(self.quorum)} of "
                f"{self.groups.count} groups in the quorum"
            )

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class CommittingOptimizer(torch.optim.Optimizer):
    """``optimizer`` stepping only what torchft commits: ``zero_grad`` starts the next
    step's quorum (where it has not started), ``step`` runs the closure (if any), asks
    ``should_commit`` and steps the optimizer only then (it returns the closure's loss)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: ReplicaGroup) -> None:
        # Not Optimizer.__init__: the wrapped optimizer holds the state and the groups.
        self.optimizer, self.group = optimizer, group
        self.committed = False  # whether the last step was

    @property
    def param_groups(  # type: ignore[override]
        self,
    ) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(  # type: ignore[override]
        self,
    ) -> Any:
        return self.optimizer.state

    @property
    def defaults(  # type: ignore[override]
        self,
    ) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.group.start_quorum()
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        self.committed = self.group.should_commit()
        if self.committed:
            self.optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"CommittingOptimizer({self.optimizer!r})"


class ManagerAllReduce:
    """The all-reduce hook that averages a reduced gradient shard over torchft's quorum:
    ``Manager.allreduce`` (a no-op once the step has failed; ``should_commit`` then says
    False on every group). With ``layout`` (``replicate_with`` gives it), the first shard
    of each step is preceded by the groups' check of their layouts ([Note: replica groups
    agree on their layout]); with ``group`` of ``groups`` too, that check also finds
    which groups are in the step's quorum (``members``)."""

    averages_replicas = True  # flatshard.set_all_reduce_hook refuses to replace it

    def __init__(
        self,
        manager: Any,
        layout: torch.Tensor | None = None,
        group: int | None = None,
        groups: int = 0,
    ) -> None:
        self.manager = manager
        self.layout = layout
        self.group, self.groups = group, groups
        self.members: tuple[int, ...] | None = None  # the groups of the last checked quorum
        self._checked: tuple[int, Any] | None = None

    def __call__(self, shard: torch.Tensor) -> None:
        # Once a step and quorum: a step taken again under a new quorum (a group left
        # inside its all-reduce) is checked again. (The quorum's id is torchft's own
        # attribute; without it, once a step.)
        key = (int(self.manager.current_step()), getattr(self.manager, "_quorum_id", None))
        if self.layout is not None and key != self._checked:
            self._checked = key
            self._check_layout()
        self.manager.allreduce(shard).wait()

    def _check_layout(self) -> None:
        """[Note: replica groups agree on their layout]
        A group that built another model, or sharded it otherwise (strategy, units, ranks
        per group), would average gradient shards of other rows with the others' and
        train silently wrong. Each step, before its first shard, the groups sum their
        layout's digest (three 16-bit parts, exact in float64) and the number of
        groups they were told of: a group whose numbers times the quorum's size differ
        from the sum finds out, and every group of the quorum with it. Then each group
        adds a one at its own index, so the sum says which groups the quorum holds (the
        console's and metrics.jsonl's "who left, who joined"; its length agreed by the
        first sum). Two all-reduces of a few numbers a step and quorum: a step taken
        again under the same quorum is not checked again (groups whose commits differed
        are at different steps, and the next quorum heals the one behind to the others'
        step before any all-reduce)."""
        assert self.layout is not None
        mine = torch.cat([self.layout, self.layout.new_tensor([self.groups])])
        total = self._sum(mine)
        if total is None:
            return
        if not torch.equal(total, mine * self.manager.num_participants()):
            raise LayoutMismatch(
                "flatshard.integrations.torchft: the replica groups in this step's quorum "
                "built different models, sharded them otherwise or count the groups "
                f"otherwise (their layouts' digests differ; this group's is "
                f"{_digest_text(self.layout)}, of {self.groups} groups). Every group must "
                "build the same model and shard it alike (strategy, units, ranks per "
                "group), and be told the same number of groups."
            )
        if self.group is None:
            return
        one = torch.zeros(self.groups, dtype=mine.dtype, device=mine.device)
        one[self.group] = 1
        present = self._sum(one)
        if present is None:
            return
        if present[self.group] > 1:  # the others' step fails with these groups gone
            raise LayoutMismatch(
                f"flatshard.integrations.torchft: {int(present[self.group])} replica groups "
                f"of this step's quorum took the index {self.group}: each group needs its "
                "own (ReplicaGroups.index, flatshard train's --ft-replica-id)"
            )
        self.members = tuple(int(i) for i in present.nonzero().flatten().tolist())

    def _sum(self, mine: torch.Tensor) -> torch.Tensor | None:
        """The quorum's sum of ``mine`` (None where the step failed, or where this group
        only heals and takes no part)."""
        self.members = None
        total = mine.clone()
        self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None or not self.manager.is_participating():
            return None
        return total


def replicate_with(
    model: nn.Module,
    manager: Any,
    group: int | None = None,
    groups: int = 0,
    layout: torch.Tensor | None = None,
) -> ManagerAllReduce:
    """Average the gradients of every unit inside sharded ``model`` across torchft's replica
    groups each step, through ``manager`` (a ``torchft.Manager``; see the module's note).
    Wrap the optimizers in ``torchft.optim.OptimizerWrapper(manager, optim)`` (the quorum
    at ``zero_grad``, ``should_commit`` before ``step``), and give the manager
    ``state_dict_fns(model, optimizers)``. With this group's index ``group`` of ``groups``
    (every group gives the same ``groups``), the returned hook's ``members`` names the
    groups in each step's quorum. ``layout``: the digest the groups compare (by default
    ``layout_digest(model)``)."""
    _require_torchft()
    if not unit_modules(model):
        raise ValueError(
            "flatshard.integrations.torchft.replicate_with: the model is not sharded; call "
            "flatshard.fully_shard on it first (over the replica group's own ranks)"
        )
    if group is not None and not 0 <= group < groups:
        raise ValueError(
            f"flatshard.integrations.torchft.replicate_with: group must be 0 to groups - 1 "
            f"({groups - 1}), got {group}"
        )
    layout = layout if layout is not None else layout_digest(model)
    hook = ManagerAllReduce(manager, layout, group, groups)
    set_all_reduce_hook(model, hook)
    return hook


def layout_digest(model: nn.Module, settings: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The model's layout as three 16-bit numbers: its parameters' names, shapes and
    dtypes, how flatshard shards them (units, rows per rank, the ranks), each unit's
    agreed options (strategy, dtypes, divide factor, hooks: what decides the reduced
    shards the groups sum) less the all-reduce hook (each group's own names its group),
    and ``settings`` (optimizer settings, training options)."""
    text = repr(sorted((settings or {}).items()))
    text += repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()])
    text += str(sharding_summary(model))
    options = agreed_configuration(model)
    text += "\n".join(line for line in options if not line.lstrip().startswith("all_reduce_hook="))
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")
    parts = [(value >> shift) & 0xFFFF for shift in (32, 16, 0)]
    device = next(model.parameters()).device
    # float64: the digest times the quorum's size stays exact for any number of groups
    return torch.tensor(parts, dtype=torch.float64, device=device)


def optimizer_settings(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """Each optimizer's class and its groups' settings (learning rate, betas, weight decay,
    ...; not the parameters), as the groups compare them."""
    return [
        (
            type(o).__qualname__,
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
        )
        for o in optimizers
    ]


def _digest_text(layout: torch.Tensor) -> str:
    return "".join(f"{int(v):04x}" for v in layout.tolist())


def state_dict_fns(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    agreed: tuple[torch.Tensor, int, Mapping[str, Any]] | None = None,
    index: int | None = None,
) -> tuple[Callable[[dict[str, Any]], None], Callable[[], dict[str, Any]]]:
    """``(load_state_dict, state_dict)`` for ``torchft.Manager``: this rank's shards of the
    parameters and buffers and its optimizers' state, exactly as they live (every group has
    the same layout, and rank r of a recovering group copies rank r of a live one).
    ``extra``: (get, set) of the caller's own state to send along (the data position).
    ``agreed``: (layout digest, number of groups, settings), sent along and compared by a
    recovering group before it takes anything: a group that differs refuses the state by
    name, alone, before it ever sums with the live groups. ``index``: this group's index
    (``ReplicaGroups.index``), sent along too: a recovering group that took the index of
    the live group it heals from (a job started twice) stops alone, and the live groups
    train on."""

    def state_dict() -> dict[str, Any]:
        state: dict[str, Any] = {
            "params": [p.detach() for p in model.parameters()],
            "buffers": [b.detach() for b in model.buffers()],
            "optimizers": [o.state_dict() for o in optimizers],
        }
        if extra is not None:
            state["extra"] = extra[0]()
        if agreed is not None:
            state["agreed"] = (agreed[0].tolist(), agreed[1], dict(agreed[2]))
        if index is not None:
            state["index"] = index
        return state

    def load_state_dict(state: dict[str, Any]) -> None:
        if index is not None and state.get("index") == index:
            raise LayoutMismatch(
                f"flatshard.integrations.torchft: the live replica group this group would "
                f"heal from has the index {index} too; this group takes no part. Each group "
                "needs its own index (ReplicaGroups.index, flatshard train's "
                "--ft-replica-id): is the same job running twice?"
            )
        if agreed is not None and "agreed" in state:
            _check_agreed(agreed, state["agreed"])
        params, buffers = list(model.parameters()), list(model.buffers())
        if len(state["params"]) != len(params) or len(state["buffers"]) != len(buffers):
            raise LayoutMismatch(
                "flatshard.integrations.torchft: the state a live replica group sent holds "
                f"{len(state['params'])} parameters and {len(state['buffers'])} buffers, "
                f"this group's model {len(params)} and {len(buffers)}: the groups must "
                "build the same model and shard it alike (strategy, ranks per group)"
            )
        pairs = list(zip(params + buffers, state["params"] + state["buffers"], strict=True))
        for mine, theirs in pairs:  # every shape before anything is copied
            if mine.shape != theirs.shape:
                raise LayoutMismatch(
                    "flatshard.integrations.torchft: a live replica group's shard has "
                    f"shape {tuple(theirs.shape)}, this group's {tuple(mine.shape)}: the "
                    "groups must shard alike (strategy, ranks per group)"
                )
        with torch.no_grad():
            for mine, theirs in pairs:
                mine.copy_(theirs)
        for optim, saved in zip(optimizers, state["optimizers"], strict=True):
            try:
                optim.load_state_dict(saved)
            except ValueError as error:
                raise LayoutMismatch(
                    "flatshard.integrations.torchft: a live replica group's optimizer state "
                    f"does not fit this group's {type(optim).__qualname__} ({error}): every "
                    "group must use the same optimizer and parameter groups"
                ) from None
        if extra is not None:
            extra[1](state["extra"])

    return load_state_dict, state_dict


def _check_agreed(mine: tuple[torch.Tensor, int, Mapping[str, Any]], theirs: Any) -> None:
    """A recovering group's check of a live group's layout, group count and settings."""
    layout, count, settings = theirs
    if layout == mine[0].tolist() and count == mine[1]:
        return
    here = mine[2]
    keys = [k for k in set(settings) | set(here) if repr(settings.get(k)) != repr(here.get(k))]
    if len(keys) > 1:  # the optimizers' settings follow from the options named beside them
        keys = [k for k in keys if k != "optimizers"]
    differ = sorted(f"{k}: {settings.get(k)!r} there, {here.get(k)!r} here" for k in keys)
    what = "; ".join(differ) if differ else "the model, its sharding or its units' options"
    if count != mine[1]:
        what = f"the number of groups: {count} there, {mine[1]} here; " + what
    raise LayoutMismatch(
        "flatshard.integrations.torchft: this replica group differs from the live group it "
        f"would heal from ({what}); it takes no part. Every group must build the same "
        "model, shard it alike, train it with the same settings and be told the same "
        "number of groups."
    )


def _require_torchft() -> None:
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            "flatshard.integrations.torchft needs torchft: pip install 'flatshard[ft]' "
            "(or pip install torchft)"
        )


def _group_store() -> tuple[Any, str, int]:
    """A store of this group's own for its managers (rank 0's, None elsewhere): rank 0
    serves it, every rank learns where (torchrun's store would do too, but
    ``flatshard train``'s own launch uses a file)."""
    store = None
    if dist.get_rank() == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]  # exported, not in __all__
            "0.0.0.0", 0, dist.get_world_size(), is_master=True, wait_for_workers=False
        )
    where: list[Any] = [(os.environ.get("MASTER_ADDR", "localhost"), store.port if store else 0)]
    dist.broadcast_object_list(where, src=0)
    return store, where[0][0], int(where[0][1])
