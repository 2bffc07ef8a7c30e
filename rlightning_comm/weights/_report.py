"""What a weight-sync call reports on every member: the bytes it moved per peer, and how its plan was made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class WeightSyncReport:
    """What one weight-sync call did on this member.

    Keyword-only and with defaults for everything but the counts, so that
    later fields (a committed ``version``, per-tensor ``digests``) extend it
    without breaking code that reads or builds it.

    Attributes:
        sent: Bytes of tensor data this member sent, per peer (the peer's rank
            in the mode: a global rank on a mode of the world, ``0`` to
            ``world_size - 1`` on a connected mode). Peers it sent nothing are
            absent; copies within this member are not counted.
        received: Bytes of tensor data this member received, per peer, the same way.
        plan_cached: Whether the plan of an earlier call was reused (the
            members exchanged only a fingerprint of their metadata).
    """

    sent: Mapping[int, int] = field(default_factory=dict)
    received: Mapping[int, int] = field(default_factory=dict)
    plan_cached: bool = False

    @property
    def bytes_sent(self) -> int:
        """Bytes sent to every peer together."""
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        """Bytes received from every peer together."""
        return sum(self.received.values())
