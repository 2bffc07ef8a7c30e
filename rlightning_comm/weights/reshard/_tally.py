"""Verification of a :func:`reshard_state_dict`: digests of pieces, tallied by who sent them and who received them.

A wanted slice may be assembled from pieces of several holders, so there is no one source to compare with. The digest
(:mod:`._digest`) is a sum over global positions, so each piece contributes a part that does not depend on who sent it
or how it was bucketed: a sender adds the part of every piece it sends to its tally for that destination, a destination
the part of every piece it received (a copy within a member counts on both sides). Then one round of words: each
member's received total and its sent total per destination, each folded over names with a weight per name. A destination
whose received total is not the sum of what the members sent it got other bytes than were sent; only then a second round
of texts names its tensors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from rlightning_comm.weights.commit._checks import shown
from rlightning_comm.weights.commit._digest import block_digest

_MASK = (1 << 64) - 1


def _name_weight(name: str) -> int:
    """An odd 64-bit weight per name: a piece counted under the wrong name changes the fold."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


class Tally:
    """One member's digests of a reshard: what it sent per destination (group rank) and name, what it received per
    name; also the check :class:`~._commit.Sync` runs with them.

    Args:
        comm: The communicator.
        shapes: Each name's global shape.
    """

    def __init__(self, comm: Any, shapes: dict[str, tuple[int, ...]]) -> None:
        self._comm = comm
        self._shapes = shapes
        self._sent: dict[tuple[int, str], torch.Tensor] = {}
        self._received: dict[str, torch.Tensor] = {}
        self._sent_ints: dict[tuple[int, str], int] = {}

    def _add(self, into: dict, key: Any, part: torch.Tensor) -> None:
        kept = into.get(key)
        into[key] = part if kept is None else kept + part

    def sent(self, dst: int, name: str, data: torch.Tensor, lo: tuple[int, ...]) -> None:
        """A piece this member sends to group rank ``dst`` (``data``: its values, at ``lo`` of the global tensor)."""
        self._add(self._sent, (dst, name), block_digest(data, lo, self._shapes[name]))

    def received(self, name: str, data: torch.Tensor, lo: tuple[int, ...]) -> None:
        """A piece this member received (``data``: its values as written, at ``lo``)."""
        self._add(self._received, name, block_digest(data, lo, self._shapes[name]))

    def copied(self, me: int, name: str, data: torch.Tensor, lo: tuple[int, ...]) -> None:
        """A piece this member copied to itself: sent and received at once."""
        part = block_digest(data, lo, self._shapes[name])
        self._add(self._sent, (me, name), part)
        self._add(self._received, name, part)

    # ------------------------------------------------------------------ what Sync calls
    def settle(self) -> None:
        """Nothing runs behind (the parts are computed as the pieces pass)."""

    def close(self) -> None:
        """Nothing to stop."""

    def result(self) -> dict[str, int]:
        """The digest of each name this member received, over all its wanted slices of it (one read of the device)."""
        keys = [("r", n) for n in self._received] + [("s", k) for k in self._sent]
        values = [self._received[n] for n in self._received] + [self._sent[k] for k in self._sent]
        ints: dict[Any, int] = {}
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(values):
            by_device.setdefault(v.device, []).append(i)
        for idx in by_device.values():
            ints.update(zip(idx, torch.stack([values[i] for i in idx]).tolist()))
        out: dict[str, int] = {}
        for i, (kind, key) in enumerate(keys):
            if kind == "r":
                out[key] = ints[i] & _MASK
            else:
                self._sent_ints[key] = ints[i] & _MASK
        return dict(sorted(out.items()))

    def words(self, mine: dict[str, int]) -> list[int]:
        """This member's received total, then its sent total per destination (in group-rank order)."""
        received = sum(_name_weight(n) * d for n, d in mine.items())
        sent = [0] * self._comm.world_size
        for (dst, name), d in self._sent_ints.items():
            sent[dst] += _name_weight(name) * d
        return [_signed(received), *(_signed(v) for v in sent)]

    def bad(self, rows: list[list[int]]) -> list[int]:
        """The ranks whose received total is not what the members sent them."""
        ranks = self._comm.ranks
        return [
            ranks[d]
            for d in range(len(rows))
            if (sum(row[1 + d] for row in rows) - rows[d][0]) & _MASK  # the same on every member: the rows are
        ]

    def text(self, mine: dict[str, int], bad: list[int]) -> str | None:
        """What this member received, and what it sent to the differing destinations, per name."""
        dests = {self._comm.ranks.index(r) for r in bad}
        sent = {f"{d}\0{n}": v for (d, n), v in self._sent_ints.items() if d in dests}
        return json.dumps({"received": mine, "sent": sent})

    def mismatch(self, texts: dict[int, str | None], bad: list[int]) -> str:
        """The message naming, per differing destination, the names whose received digest is not the sum sent."""
        shared = {rank: json.loads(t or "{}") for rank, t in texts.items()}
        named = []
        for rank in bad:
            d = self._comm.ranks.index(rank)
            expected: dict[str, int] = {}
            for got in shared.values():
                for key, v in got.get("sent", {}).items():
                    dst, name = key.split("\0", 1)
                    if int(dst) == d:
                        expected[name] = (expected.get(name, 0) + v) & _MASK
            received = shared[rank].get("received", {})
            names = sorted(n for n in set(expected) | set(received) if expected.get(n, 0) != received.get(n, 0))
            named.append(f"rank {rank}: {len(names)} tensors differ ({shown(names)})")
        return f"digests differ from the bytes the holders sent: {'; '.join(named)}"
