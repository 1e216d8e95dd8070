"""The errors ranks raise when they stop agreeing on collectives, and the warning before
them (all public as flatshard.*)."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """Ranks disagree on flatshard's collectives, or one stopped taking part."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives: the results would pair wrongly."""


class CollectiveTimeoutError(CollectiveError):
    """A flatshard collective did not complete within the timeout (``flatshard.Checks``)."""


class PeerLostError(CollectiveError):
    """A rank left (crashed, was killed, or raised) while others waited in a collective."""


class SlowCollectiveWarning(UserWarning):
    """A flatshard collective has waited far longer than a step takes: the diagnosis the
    timeout would raise, printed early while the wait goes on (``flatshard.Checks``)."""


for _error in (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    SlowCollectiveWarning,
):
    _error.__module__ = "flatshard"  # their public home, in tracebacks
