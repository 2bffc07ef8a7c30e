"""How rank 0 judges the arrivals at a generation of a connected mode, and what a process that arrives after its verdict
does.

Rank 0 decides alone, so every member raises the same error: it counts the first ``world_size`` arrivals that proved the
secret and are connected to its watch, and compares them (:func:`compare`): the verdict is the generation, or the error
every counted member raises. A process the verdict did not count (a late arrival, :func:`judge_late`):

* raises the verdict's error when it is a mismatch (the same error as the counted members');
* joins the next generation when the verdict failed otherwise (a candidate was lost, a member did not come);
* waits for the next generation, within its ``connect_timeout``, when its arguments differ from the formed generation's
  (another world size, backend, ...): the members may be re-forming the mode with them (a fleet that grows or shrinks),
  and it is judged against that one; a :class:`CommMismatchError` naming what differs when none opens in time;
* claiming the rank of a counted member with the same arguments, waits a moment to learn that member was lost (a
  replacement that came before its predecessor's death was seen), and then joins the next generation; else it is told
  the rank is taken.

A generation's *number* (what ``get_generation`` says) is one more than the largest any counted member was in before, or
this store's count if that is larger, so a new rank 0 (a new store) does not start the count again.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rlightning_comm.connect._forming import POLL, Interrupt, Opening, wait
from rlightning_comm.connect._messages import proof
from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError, PeerLostError

# A late arrival claiming the rank of a counted member waits this long to learn that member was lost, before it is told
# the rank is taken (a replacement may come a moment before its predecessor's death is seen).
LATE_GRACE = 3.0
_COMPARED = ("world_size", "backend", "torch", "nccl", "NCCL_CUMEM_ENABLE")


class Late(Exception):
    """This process arrived at a generation that was decided without it and lost the member whose rank it claims (a
    signal to try the next one, never raised to the caller)."""


def _who(info: dict[str, Any]) -> str:
    return f"rank {info['rank']} ({info['who']})"


def compare(infos: list[dict[str, Any]], world_size: int) -> str | None:
    """What differs between the members (rank 0's ``world_size`` is the mode's), naming who; ``None`` when all match."""
    infos = sorted(infos, key=lambda info: info["rank"])  # the messages in rank order, whatever order they came in
    problems = []
    for field in _COMPARED:
        values: dict[str, list[str]] = {}
        for info in infos:
            values.setdefault(json.dumps(info.get(field, "(not compared)")), []).append(_who(info))
        if len(values) > 1:
            problems.append(
                f"{field} differs: " + "; ".join(f"{json.loads(v)} on {', '.join(who)}" for v, who in values.items())
            )
    claimed: dict[int, list[str]] = {}
    for info in infos:
        claimed.setdefault(info["rank"], []).append(info["who"])
    for rank, who in sorted(claimed.items()):
        if not 0 <= rank < world_size:
            problems.append(f"rank {rank} is out of range for world_size {world_size} ({', '.join(who)})")
        elif len(who) > 1:
            problems.append(f"rank {rank} is claimed {len(who)} times ({', '.join(who)})")
    missing = [r for r in range(world_size) if r not in claimed]
    if missing:
        problems.append(f"no process claimed ranks {missing}")
    return "; ".join(problems) or None


def decide(
    store: dist.Store,
    opening: Opening,
    world_size: int,
    secret: str | None,
    own: str,
    candidates: Callable[[], dict[str, int]],
    deadline: float,
    interrupt: Interrupt,
    where: str,
) -> dict[str, Any]:
    """On rank 0: judge the first ``world_size`` arrivals that proved the secret and are connected to the watch (an
    arrival without the proof is ignored); the verdict (see the module docstring), not yet posted.

    Raises:
        PeerLostError: from ``interrupt``: a candidate died or left before the verdict (the caller posts it).
    """
    g, seen, counted = opening.generation, 0, []
    unread: set[int] = set()  # arrivals counted but not posted yet (posted right after the counter, or never)
    waiting: list[dict[str, Any]] = []  # proved arrivals whose watch connection is not (yet) there
    while True:
        interrupt()
        arrived = int(store.add(f"{g}/arrived", 0))
        unread.update(range(seen, arrived))
        seen = arrived
        for i in sorted(unread):
            if store.check([f"{g}/member/{i}"]):
                unread.discard(i)
                entry = _entry(store.get(f"{g}/member/{i}"))
                if entry is not None and hmac.compare_digest(
                    proof(secret, g, opening.nonce, entry["info"]).hex(), entry["proof"]
                ):
                    waiting.append(json.loads(entry["info"]))  # else a process without the secret: ignored
        connected = candidates()
        tokens = {info["token"] for info in counted}
        for info in list(waiting):
            if info["token"] in tokens:
                waiting.remove(info)  # the same arrival posted twice (a replay): counted once
            elif info["token"] == own or connected.get(info["token"]) == info["rank"]:
                waiting.remove(info)
                if len(counted) < world_size:
                    counted.append(info)
                    tokens.add(info["token"])
        if len(counted) == world_size:
            problem = compare(counted, world_size)
            error = (
                None
                if problem is None
                else ["CommMismatchError", f"{where}: the members do not match: {problem}. No group was built", None]
            )
            return _verdict(counted, opening, error)
        if time.monotonic() >= deadline:
            missing = sorted(set(range(world_size)) - {info["rank"] for info in counted})
            came = ", ".join(map(_who, sorted(counted, key=lambda i: i["rank"])))
            message = f"{where}: ranks {missing} did not arrive in time (arrived: {came}). No group was built"
            return _verdict(counted, opening, ["CommTimeoutError", message, None])
        # Until the next arrival, or a slice: a candidate still in its handshake, or a loss, is seen at the next one.
        wait(store, [f"{g}/member/{seen}"], min(deadline, time.monotonic() + POLL), interrupt)


def _entry(raw: bytes) -> dict[str, Any] | None:
    """A preflight entry as posted, or ``None`` for anything else (what a process without the secret wrote)."""
    try:
        entry = json.loads(raw)
        return entry if isinstance(entry.get("info"), str) and isinstance(entry.get("proof"), str) else None
    except (ValueError, AttributeError):
        return None


def _verdict(counted: list[dict[str, Any]], opening: Opening, error: list[Any] | None) -> dict[str, Any]:
    number = max([opening.generation] + [info["last"] + 1 for info in counted])
    return {"admitted": [i["token"] for i in counted], "infos": counted, "generation": number, "error": error}


def lost_verdict(opening: Opening, message: str, member: int | None) -> dict[str, Any]:
    """The verdict when a candidate was lost before rank 0 decided."""
    return {"admitted": [], "infos": [], "generation": opening.generation, "error": ["PeerLostError", message, member]}


def raise_error(verdict: dict[str, Any], mode: str) -> None:
    """Raise the verdict's error, if any."""
    if verdict["error"] is None:
        return
    kind, message, member = verdict["error"]
    if kind == "PeerLostError":
        raise PeerLostError(message, mode, verdict["generation"], member)
    raise {"CommMismatchError": CommMismatchError, "CommTimeoutError": CommTimeoutError}.get(kind, CommError)(message)


def judge_late(
    store: dist.Store,
    opening: Opening,
    verdict: dict[str, Any],
    info: dict[str, Any],
    deadline: float,
    interrupt: Interrupt,
    mode: str,
    where: str,
) -> None:
    """On a member the verdict did not count: raise what it must (see the module docstring), or :class:`Late` once the
    next generation is the one to join (by ``deadline``, connect's)."""
    if verdict["error"] is not None and verdict["error"][0] != "CommMismatchError":
        # A candidate died, or a member was missing (this one, maybe): every member forms the next generation.
        raise Late(opening.generation)
    raise_error(verdict, mode)  # a mismatch: the same error as the counted members'
    infos = verdict["infos"]
    world_size = len(infos)
    mine = {**info, "who": info["who"] + ", which arrived after the verdict"}
    problem = compare([*infos, mine], world_size)
    fields = [p for p in (problem or "").split("; ") if not p.startswith(f"rank {info['rank']} is claimed")]
    g = opening.generation
    if fields:
        # Not a member of this generation: the mode may be re-forming with these arguments (a fleet that grows or
        # shrinks; its members call connect once they are done with this one), so the next generation decides.
        if wait(store, [f"opened/{g + 1}"], deadline, interrupt):
            raise Late(g)
        raise CommMismatchError(
            f"{where}: this process does not match the members of the generation formed without it, and rank 0 "
            f"opened no later generation within connect_timeout: {'; '.join(fields)}"
        )
    holder = next(i for i in infos if i["rank"] == info["rank"])
    grace = min(deadline, time.monotonic() + LATE_GRACE)
    while time.monotonic() < grace:
        if store.check([f"{g}/lost"]) or store.check([f"opened/{g + 1}"]):
            raise Late(g)  # its predecessor is gone: the survivors form the next generation, with this process
        interrupt()
        time.sleep(POLL)
    raise CommMismatchError(
        f"{where}: rank {info['rank']} is taken: {_who(holder)} holds it in the generation formed without this "
        f"process ({info['who']}), and is alive. Two processes claim the same rank"
    )
