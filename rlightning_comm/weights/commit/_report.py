"""What a weight-sync call reports on every member of the mode: the bytes it moved per peer, the version it carried,
the digests it verified and how its plan was made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class WeightSyncReport:
    """What one weight-sync call (:func:`broadcast_state_dict`, :func:`reshard_state_dict`) did on this member.

    Keyword-only, with a default for every field, so that later fields extend it without breaking code that reads or
    builds it.

    Attributes:
        sent: Bytes of tensor data this member sent, per peer (the peer's rank in the mode: a global rank on a mode of
            the world, ``0`` to ``world_size - 1`` on a connected mode). Peers it sent nothing are absent; copies within
            this member are not counted.
        received: Bytes of tensor data this member received, per peer, the same way.
        version: The version the call carried (``None``: an unversioned sync). On a destination it is the version its
            weights are at now, recorded for :meth:`CommContext.get_weight_version`.
        digests: With ``verify=True`` (or ``atomic=True``), each tensor's digest, an unsigned 64-bit int: a sum of its
            bytes, each weighted by its position in the global tensor (:func:`tensor_digest` computes it for a tensor at
            hand). It does not depend on the bucketing nor on the member that sent a byte: after a sync every member
            that holds the same bytes reports the same digest. :func:`broadcast_state_dict` reports every tensor;
            :func:`reshard_state_dict` reports each name this member wants, over its wanted slices of it (the slices'
            parts add up: the digest of the whole tensor is the sum, mod 2**64, of its slices'). An integrity check
            against corruption and mix-ups, not a cryptographic hash. Empty otherwise.
        plan_cached: Whether the plan of an earlier call on the mode was reused (its metadata unchanged: the members
            exchanged only a fingerprint of it) rather than agreed anew.
        kinds: With ``delta=True``, how each destination (its rank in the mode) got this call's tensors: ``"delta"``
            (only the elements that changed since the version it held, written in place) or ``"full"``; on every
            member, every destination of the call. Empty with ``delta=False``.
        delivered: With ``delta=True``, the bytes of tensor data each destination received over the wire (a delta's
            encoded changes, or the full tensors), on every member for every destination. Empty with ``delta=False``.
    """

    sent: Mapping[int, int] = field(default_factory=dict)
    received: Mapping[int, int] = field(default_factory=dict)
    version: int | None = None
    digests: dict[str, int] = field(default_factory=dict)
    plan_cached: bool = False
    kinds: Mapping[int, str] = field(default_factory=dict)
    delivered: Mapping[int, int] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        """Bytes sent to every peer together."""
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        """Bytes received from every peer together."""
        return sum(self.received.values())
