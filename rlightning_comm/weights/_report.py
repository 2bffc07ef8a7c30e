"""What one weight sync did, as every member of the mode saw it: the report a weight-sync call returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WeightSyncReport:
    """What a weight sync moved and committed, on one member of the mode.

    Attributes:
        sent: Bytes of tensor data this member sent, per peer (its rank in the mode); empty on a member that sent
            nothing.
        received: Bytes of tensor data this member received, per peer (its rank in the mode).
        version: The version the call carried (``None``: an unversioned sync). On a destination it is the version its
            weights are at now, recorded for :meth:`CommContext.get_weight_version`.
        digests: With ``verify=True`` (or ``atomic=True``), each tensor's digest: the SHA-256 (hex) of its bytes in
            row-major order, the same on every member after a sync, whatever the bucketing or the member that sent
            them. Empty otherwise.
        plan_cached: Whether the call reused the plan of an earlier call on the mode (its metadata unchanged) rather
            than agreeing on a new one.
    """

    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    version: int | None = None
    digests: dict[str, str] = field(default_factory=dict)
    plan_cached: bool = False
