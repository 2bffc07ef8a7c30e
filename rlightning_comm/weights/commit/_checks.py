"""How a verified sync's members compare their digests: against one source's (:class:`SourceCheck`, both calls'
default; :func:`broadcast_state_dict`), or tallied by sender and receiver (``reshard/_tally.py``)."""

from __future__ import annotations

import json
from typing import Any

from rlightning_comm.weights.commit._digest import differing, fingerprint


def shown(names: list[str]) -> str:
    """Up to eight names, quoted."""
    return ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")


class SourceCheck:
    """Verification against one source: every member's digests must equal the source's (a fingerprint of two words
    per member, then the texts of the source and of the members that differ)."""

    def __init__(self, comm: Any, src: int) -> None:
        self._comm = comm
        self._src = src

    def words(self, mine: dict[str, int]) -> list[int]:
        """This member's words for the round: a fingerprint of its digests."""
        return fingerprint(mine)

    def bad(self, rows: list[list[int]]) -> list[int]:
        """The ranks whose digests differ from the source's."""
        src_row = rows[self._comm.ranks.index(self._src)]
        return [rank for rank, row in zip(self._comm.ranks, rows) if row != src_row]

    def text(self, mine: dict[str, int], bad: list[int]) -> str | None:
        """This member's digests when they are needed to name the tensors (the source's, a differing member's)."""
        me = self._comm._global_rank
        return json.dumps(mine) if me == self._src or me in bad else None

    def mismatch(self, texts: dict[int, str | None], bad: list[int]) -> str:
        """The message naming each differing member's tensors."""
        reference = json.loads(texts[self._src] or "{}")
        named = []
        for rank in bad:
            names = differing(reference, json.loads(texts[rank] or "{}"))
            named.append(f"rank {rank}: {len(names)} tensors differ ({shown(names)})")
        return f"digests differ from the source's (rank {self._src}): {'; '.join(named)}"
