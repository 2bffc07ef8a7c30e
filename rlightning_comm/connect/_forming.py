"""Where the members of a connected mode meet, how they agree on a generation, and how they check, before any group
exists, that they match.

Every key lives under the mode's prefix in the store rank 0 hosts:

* ``open``: the generation rank 0 opened last (JSON: its key in this store, the store's nonce, the port of rank 0's
  watch); ``opened/<g>`` marks that ``g`` was opened.
* ``<g>/arrived``: a counter; the ``i``-th member to arrive posts what it is (:func:`member_info`, with its watch token
  and its proof of the secret) under ``<g>/member/<i>``.
* ``<g>/verdict``: rank 0's verdict: the tokens it counted (the first ``world_size`` arrivals that proved the secret and
  are connected to its watch), their infos, the generation's number, and the error every member raises, if any.
* ``<g>/lost``: the member the formed generation lost (rank 0's watch posts it).

Rank 0 decides alone, so every member raises the same error. A member joins the newest opened generation that it has not
been in and that has no verdict yet. One that arrives when the verdict is given without it (a late arrival) raises the
verdict's error if there is one, a :class:`CommMismatchError` naming who differs if it does not match the counted
members, and waits for the next generation only when the member whose rank it claims was lost (a replacement whose
predecessor was still counted).

A generation's *number* (what ``get_generation`` says) is one more than the largest any counted member was in before, or
this store's count if that is larger, so a new rank 0 (a new store) does not start the count again.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlightning_comm.connect._liveness import proof
from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError, PeerLostError

# After rank 0's own deadline the others wait this much longer for its verdict, which names who did not come.
VERDICT_GRACE = 5.0
# A late arrival claiming the rank of a counted member waits this long to learn that member was lost, before it is told
# the rank is taken (a replacement may come a moment before its predecessor's death is seen).
LATE_GRACE = 3.0
_POLL = 0.05  # how often a wait of the forming looks whether the generation was lost meanwhile
_COMPARED = ("world_size", "backend", "torch", "nccl", "NCCL_CUMEM_ENABLE")
_SECRET = re.compile(r"[A-Za-z0-9_-]{1,128}")


def parse_address(address: object) -> tuple[str, int, str | None]:
    """``"host:port"`` or ``"host:port/secret"`` (``"[::1]:port"`` for IPv6) as ``(host, port, secret or None)``.

    Raises:
        TypeError: not a str.
        ValueError: no host, a port outside 0..65535, or a secret of other characters than letters, digits, ``_``,
            ``-``.
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a str 'host:port'; got {type(address).__name__} {address!r}")
    where, slash, secret = address.partition("/")
    host, sep, port = where.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"address must be 'host:port' with a port in 0..65535 (e.g. '127.0.0.1:29600', '[::1]:0'), optionally "
            f"followed by '/secret'; got {address!r}"
        )
    if slash and not _SECRET.fullmatch(secret):
        raise ValueError(f"the secret after '/' must be 1 to 128 letters, digits, '_' or '-'; got {address!r}")
    return ("127.0.0.1" if host == "localhost" else host), int(port), (secret if slash else None)


def format_address(host: str, port: int, secret: str | None = None) -> str:
    """``(host, port)`` as ``"host:port"`` (IPv6 hosts in brackets), with ``"/secret"`` when there is one."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return where if secret is None else f"{where}/{secret}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (then every member runs on this machine)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Opening(NamedTuple):
    """A generation rank 0 opened: its key in the store, the nonce of the store that holds it, its watch's port."""

    generation: int
    nonce: str
    watch_port: int


class Late(Exception):
    """This process arrived at a generation that was decided without it and lost the member whose rank it claims (a
    signal to try the next one, never raised to the caller)."""


def member_info(rank: int, world_size: int, backend: str, uses_nccl: bool, last: int = -1) -> dict[str, Any]:
    """What this process brings to the preflight: what must match, who it is (for the messages), and the last
    generation number it was in on the mode (-1: none)."""
    info: dict[str, Any] = {"rank": rank, "world_size": world_size, "backend": backend, "torch": torch.__version__}
    if uses_nccl:
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
        info["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE")
    info["who"] = f"pid {os.getpid()} on {socket.gethostname()}"
    info["last"] = last
    return info


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


Interrupt = Callable[[], None]  # raises (a PeerLostError) when the generation was lost meanwhile


def wait(store: dist.Store, keys: list[str], deadline: float, interrupt: Interrupt) -> bool:
    """Wait until every key exists, or ``deadline`` (``time.monotonic()``) passed: whether they all exist.

    Polls (``check`` is one request, and it logs nothing, where a ``wait`` that times out logs a warning), calling
    ``interrupt`` between the polls.
    """
    pause = 0.002
    while True:
        if store.check(keys):  # first: a verdict posted before rank 0 closed the generation is still read
            return True
        try:
            interrupt()
        except PeerLostError:
            # The loss may have come between the check and now: rank 0 posts its verdict (and waits until the store
            # holds it) before it closes the generation, so a verdict is preferred over a later closing.
            if store.check(keys):
                return True
            raise
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL)


def post_verdict(store: dist.Store, key: int, verdict: dict[str, Any]) -> None:
    """On rank 0: post ``verdict`` on generation ``key``, returning once the store holds it.

    A store's ``set`` does not wait for the server; the ``check`` after it, on the same connection, does. Rank 0 closes
    the generation (its watch tells the members) only after this returns, so a member told of the closing finds the
    verdict in the store.
    """
    store.set(f"{key}/verdict", json.dumps(verdict))
    store.check([f"{key}/verdict"])


def open_generation(store: dist.Store, opening: Opening) -> None:
    """On rank 0: open a generation for the members to join."""
    store.set("open", json.dumps(opening._asdict()))
    store.set(f"opened/{opening.generation}", "1")


def find_generation(
    store: dist.Store, after: tuple[str, int] | None, deadline: float, mode: str, interrupt: Interrupt
) -> tuple[Opening, bool]:
    """On a member: the generation to join, the newest opened after ``after`` (the store's nonce and the last key
    joined, or that failed), and whether rank 0 gave its verdict on it already (this process is then a late arrival).

    Raises:
        CommTimeoutError: no such generation was opened by ``deadline``.
    """
    key = "open"
    while True:
        if not wait(store, [key], deadline, interrupt):
            last = "" if after is None else " after the one this process was in"
            raise CommTimeoutError(
                f"connect on mode {mode!r}: rank 0 opened no generation{last} in time; it has not called connect "
                "again, or is blocked"
            )
        opening = Opening(**json.loads(store.get("open")))
        g = opening.generation
        if after is not None and opening.nonce == after[0] and g <= after[1]:
            key = f"opened/{after[1] + 1}"
        else:
            return opening, store.check([f"{g}/verdict"])


def post(store: dist.Store, opening: Opening, info: dict[str, Any], secret: str | None) -> None:
    """Post this process's info to the preflight of ``opening``, with its proof of the secret."""
    g = opening.generation
    arrival = store.add(f"{g}/arrived", 1) - 1
    signed = json.dumps(info, sort_keys=True)
    store.set(
        f"{g}/member/{arrival}", json.dumps({"info": signed, "proof": proof(secret, g, opening.nonce, signed).hex()})
    )


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
        wait(store, [f"{g}/member/{seen}"], min(deadline, time.monotonic() + _POLL), interrupt)


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


def await_verdict(
    store: dist.Store, opening: Opening, deadline: float, interrupt: Interrupt, where: str
) -> dict[str, Any]:
    """On a member: rank 0's verdict on ``opening``.

    Raises:
        CommTimeoutError: rank 0 gave no verdict in time.
    """
    if not wait(store, [f"{opening.generation}/verdict"], deadline + VERDICT_GRACE, interrupt):
        raise CommTimeoutError(f"{where}: rank 0 gave no verdict on the members in time; it is blocked")
    return json.loads(store.get(f"{opening.generation}/verdict"))


def judge_late(
    store: dist.Store,
    opening: Opening,
    verdict: dict[str, Any],
    info: dict[str, Any],
    interrupt: Interrupt,
    mode: str,
    where: str,
) -> None:
    """On a member the verdict did not count: raise what it must (see the module docstring), or :class:`Late`."""
    if verdict["error"] is not None and verdict["error"][0] != "CommMismatchError":
        # A candidate died, or a member was missing (this one, maybe): every member forms the next generation.
        raise Late(opening.generation)
    raise_error(verdict, mode)  # a mismatch: the same error as the counted members'
    infos = verdict["infos"]
    world_size = len(infos)
    mine = {**info, "who": info["who"] + ", which arrived after the verdict"}
    problem = compare([*infos, mine], world_size)
    fields = [p for p in (problem or "").split("; ") if not p.startswith(f"rank {info['rank']} is claimed")]
    if fields:
        raise CommMismatchError(
            f"{where}: this process does not match the members of the generation: {'; '.join(fields)}"
        )
    holder = next(i for i in infos if i["rank"] == info["rank"])
    g = opening.generation
    deadline = time.monotonic() + LATE_GRACE
    while time.monotonic() < deadline:
        if store.check([f"{g}/lost"]) or store.check([f"opened/{g + 1}"]):
            raise Late(g)  # its predecessor is gone: the survivors form the next generation, with this process
        interrupt()
        time.sleep(_POLL)
    raise CommMismatchError(
        f"{where}: rank {info['rank']} is taken: {_who(holder)} holds it in the generation formed without this "
        f"process ({info['who']}), and is alive. Two processes claim the same rank"
    )
