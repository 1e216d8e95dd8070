"""``Record``: one flatshard collective as the watchdog keeps it and the reports name it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Record:
    """One collective (or one call every rank must make) on a group, in issue order."""

    seq: int  # this rank's count of flatshard collectives on the group, this one included
    group: str  # the group's name
    op: str  # "all_gather", "reduce", "all_reduce", "broadcast", ... ("call": an entry)
    numel: int  # elements this rank sends
    dtype: str
    phase: str  # "forward", "backward", "clip_grad_norm_", ...
    unit: str  # the unit's name, "" if none
    step: int  # backward passes the model's root completed

    def describe(self, sizes: bool = True) -> str:
        """In user terms, e.g. collective #7 (step 1, forward): all_gather of unit 'b' ...
        (``sizes=False``: without the elements this rank sends)."""
        if self.op == "call":
            return f"{self.phase} at step {self.step} (after collective #{self.seq})"
        unit = f" of unit '{self.unit}'" if self.unit else ""
        data = f"{self.numel:,} {self.dtype}" if sizes else self.dtype
        return f"collective #{self.seq} (step {self.step}, {self.phase}): {self.op}{unit} ({data})"

    def agreed(self) -> str:
        """What every rank's record of this collective must say alike: ``describe()``, but
        for an all-to-all without the elements this rank sent (uneven by design: each rank
        sends what the others asked of it)."""
        return self.describe(sizes=self.op != "all_to_all")

    def descriptor(self) -> str:
        """What every rank must agree on, as text that travels through the store."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_descriptor(text: str) -> Record:
        return Record(**json.loads(text))
