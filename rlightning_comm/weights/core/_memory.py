"""What a communicator keeps between weight-sync calls: plans, staging buffers, hashes, an unwaited transfer, and for
``delta=True`` a source's snapshot of what it last sent and a destination's note of what it last received.

It lives on the communicator (an attribute), so it goes with the communicator's generation, never outlives it.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the kept plans are broadcast_state_dict's; this room only holds them
    from rlightning_comm.weights.broadcast._plan import Delivery, Entry, Plan


class Kept:
    """What a communicator keeps between calls: per source, the last agreed plan; the staging buffers; this rank's last
    manifest and its hashes."""

    def __init__(self) -> None:
        # source -> (the source's plan key, its plan, the plan's deliveries for a load callable or None)
        self.plans: dict[int, tuple[tuple[int, int], Plan, tuple[Delivery, ...] | None]] = {}
        self.slots: list[torch.Tensor | None] = [None, None]
        self.mirrors: list[Any] = [None, None]
        self.unfinished: Any = None  # an async transfer not yet waited: it holds the slots
        # (manifest, bucket_bytes, hash of its sorted names/dtypes/shapes, hash of (manifest, bucket_bytes) or None)
        self.hashed: tuple[list[Entry], int, tuple[int, int], tuple[int, int] | None] | None = None
        self.stream: Any = None  # the handshake's own CUDA stream
        self.rounds = 0  # the point-to-point rounds this member took part in (every member counts the same)
        # async_op=True: the publishes on this mode in order (a _publish.StateDictTransfer each), the capture buffers
        self.publishes: list[Any] = []
        self.publish_lock = threading.Lock()
        self.captures: Any = None
        self.staged: tuple[Any, list[torch.Tensor]] | None = None  # an atomic sync's staging: (its key, the tensors)
        # reshard_state_dict's: (its key, the schedule, this member's metadata hash and metadata when it was made)
        self.reshard_plan: tuple[tuple[int, int], Any, tuple[int, int], Any] | None = None
        # delta=True: what this member last sent (a _snapshots.Snapshot, on the host), and what it last received: (the
        # version, the content key of the tensors that hold it); None when the next delta sync must be full.
        self.snapshot: Any = None
        self.held: tuple[int, tuple[int, int]] | None = None
        self.inbox: Any = None  # a delta destination's receive buffer, kept between calls

    def drop_delta(self) -> None:
        """Forget everything kept for delta syncs: the next one from or to this member is full."""
        self.snapshot = self.held = self.inbox = None

    def hashes(
        self, manifest: list[Entry], bucket_bytes: int, is_source: bool
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """The hash of ``manifest``'s sorted names, dtypes and shapes, and (on the source) of the plan's inputs;
        recomputed only when they changed since the last call."""
        kept = self.hashed
        if kept is None or kept[0] != manifest:
            kept = (manifest, bucket_bytes, hash_key(sorted(e[:3] for e in manifest)), None)
        if is_source and (kept[3] is None or kept[1] != bucket_bytes):
            kept = (manifest, bucket_bytes, kept[2], hash_key((manifest, bucket_bytes)))
        self.hashed = kept
        return kept[2], kept[3] if is_source and kept[3] is not None else (0, 0)


def kept(comm: Any) -> Kept:
    """What ``comm`` kept from its last transfer.

    An attribute of the communicator, not an entry of a weak-keyed dict: the unfinished transfer it holds refers to the
    communicator, and a value that refers to its own weak key keeps both alive forever (a generation of a connected mode
    never went, nor its buffers). As an attribute they form a cycle that goes with the communicator.
    """
    memory = comm.__dict__.get("_weights_kept")
    if memory is None:
        memory = comm._weights_kept = Kept()
    return memory


def forget(comm: Any, transfer: Any) -> None:
    """Drop ``transfer`` (a sync or transfer that finished or failed) from what ``comm`` keeps: it holds the caller's
    tensors, the communicator and, after a failure, its broken group."""
    memory = kept(comm)
    if memory.unfinished is transfer:
        memory.unfinished = None


def hash_key(obj: Any) -> tuple[int, int]:
    """A 128-bit hash of ``repr(obj)`` as two signed 64-bit words (what the handshakes exchange)."""
    digest = hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True)
