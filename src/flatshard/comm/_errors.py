"""The errors ranks raise when they stop agreeing on collectives (all public as flatshard.*)."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """Ranks disagree on flatshard's collectives, or one stopped taking part."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives: the results would pair wrongly."""


class CollectiveTimeoutError(CollectiveError):
    """A flatshard collective did not complete within the timeout (``flatshard.Checks``)."""


class PeerLostError(CollectiveError):
    """A rank left (crashed, was killed, or raised) while others waited in a collective."""


for _error in (CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError):
    _error.__module__ = "flatshard"  # their public home, in tracebacks
