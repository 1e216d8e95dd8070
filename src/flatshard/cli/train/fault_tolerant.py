"""``flatshard train --ft-replicas N --ft-replica-id I``: this run as one replica group of a
fault-tolerant run on torchft (``flatshard.integrations.torchft``).

The group shards the model over its own ranks as any run does; torchft's manager (one per
rank) joins the quorum of the live groups before every step, averages each reduced
gradient shard over it, and commits the step only where it went through. A group that
comes back (its torchrun restarts it, or it starts late) copies a live group's model,
optimizer state and step count at its first quorum. The step count is the manager's: the
data and the learning rate of a step follow from it, so a healed group reads on where the
others are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict

import torch
from torch import nn

from flatshard.cli.config import ConfigError
from flatshard.cli.lm.config import TrainConfig
from flatshard.integrations.torchft import LayoutMismatch, NoQuorum, ReplicaGroups

RETRY_PAUSE_S = 1.0  # between attempts at a step too few groups took part in
# The options each replica group may set its own way (where it writes, how it reaches
# the Lighthouse, how it starts and restarts: --nproc is not read under torchrun, and the
# ranks per group are compared by the layout): every other option must match the others'.
PER_GROUP = {
    "ft_replica_id", "ft_lighthouse", "ft_quorum_timeout", "nproc", "max_restarts", "device",
    "share_gpus", "out_dir", "log_every", "log_to", "ckpt_dir", "ckpt_every", "keep_ckpts",
    "ckpt_async", "ckpt_on_preempt", "resume", "exact_resume", "sample_bytes",
}  # fmt: skip


class FaultTolerance:
    """This rank's replica group (``flatshard.integrations.torchft.ReplicaGroup``) and its
    optimizer, which steps only what torchft commits."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, config: TrainConfig) -> None:
        groups = ReplicaGroups(
            config.ft_replicas,
            config.ft_replica_id,
            config.ft_lighthouse,
            config.ft_min_replicas,
            config.ft_quorum_timeout,
        )
        agreed = {k: v for k, v in asdict(config).items() if k not in PER_GROUP}
        try:
            with _said_once():
                self.group = groups.join(model, [optim], settings=agreed)
        except ValueError as error:  # no Lighthouse given, or not a URL
            raise ConfigError(str(error).replace("give its address", "--ft-lighthouse")) from None
        self.optim = self.group.wrap(optim)

    @property
    def step(self) -> int:
        return self.group.step

    def start(self, step: int) -> None:
        """The first quorum (a late or restarted group heals in it), from ``step`` (a
        resumed checkpoint's)."""
        if step:
            self.group.manager.load_state_dict({"step": step, "batches_committed": 0})
        with _said_once():
            self.group.start_quorum()

    def take(self, attempt: Callable[[int], float]) -> float:
        """Take the next step (``attempt(step)``, 1-based, returns the loss) again until
        torchft commits it or the group heals past it; the loss of the last attempt."""
        waiting_since = None
        while True:
            target = self.step + 1
            with _said_once():
                loss = attempt(target)
            if self.step >= target:
                return loss
            # Not committed: a peer failed inside the step (taken again at once), or too
            # few groups took part (again after a pause); either, for longer than the
            # quorum timeout, stops the run by name instead of retrying forever.
            members = self.group.manager.num_participants()
            few = members < self.group.groups.min_replicas
            waiting_since = waiting_since or time.monotonic()
            seconds = self.group.timeout.total_seconds()
            if time.monotonic() - waiting_since > seconds and few:
                raise ConfigError(
                    f"--ft-min-replicas {self.group.groups.min_replicas}: step {target} "
                    f"found only {members} replica group(s) in its quorum for {seconds:g} s "
                    f"and never committed. {self.group.seen()} Start the missing groups, or "
                    "lower --ft-min-replicas."
                )
            if time.monotonic() - waiting_since > seconds:
                raise ConfigError(
                    f"replica group {self.group.groups.index}: step {target} was taken again "
                    f"for {seconds:g} s and never committed (torchft: "
                    f"{self.group.manager.errored()}). {self.group.seen()}"
                )
            if few:
                time.sleep(RETRY_PAUSE_S)

    def close(self) -> None:
        self.group.close()


@contextmanager
def _said_once() -> Iterator[None]:
    """Inside, no quorum in time and groups of other layouts are one-line errors (every
    rank of the group finds them alike)."""
    try:
        yield
    except NoQuorum as error:
        message = str(error).replace("(the quorum timeout)", "(--ft-quorum-timeout)")
        raise ConfigError(message) from None
    except LayoutMismatch as error:
        message = str(error).replace("told the same number of groups", "given one --ft-replicas")
        raise ConfigError(message) from None
