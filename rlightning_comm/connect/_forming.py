"""Where the members of a connected mode meet, how they agree on a generation, and how they check, before any group
exists, that they match.

Every key lives under the mode's prefix in the store rank 0 hosts:

* ``open``: the generation rank 0 opened last (JSON: its number, the store's
  nonce, the port of rank 0's watch); ``opened/<g>`` marks that ``g`` was opened.
* ``<g>/arrived``: a counter; the ``i``-th member to arrive posts what it is
  (:func:`member_info`) under ``<g>/member/<i>``.
* ``<g>/verdict``: rank 0's verdict once the first ``world_size`` arrivals are
  in (or its timeout passed): how many arrivals it covers, and the error every
  member raises, if any.

Rank 0 decides alone, so every member raises the same error. A member joins
the newest opened generation that it has not been in and that has no verdict
yet: a survivor waits for the one after its own, a replacement joins the one
the survivors form, and a process that comes after the verdict (a
replacement whose predecessor was still counted) waits for the next.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError

# After rank 0's own deadline the others wait this much longer for its verdict, which names who did not come.
VERDICT_GRACE = 5.0
_COMPARED = ("world_size", "backend", "torch", "nccl", "NCCL_CUMEM_ENABLE")
_ERRORS: dict[str, type[CommError]] = {cls.__name__: cls for cls in (CommError, CommMismatchError, CommTimeoutError)}


def parse_address(address: object) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) as ``(host, port)``.

    Raises:
        TypeError: not a str.
        ValueError: no host, or a port outside 0..65535.
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a str 'host:port'; got {type(address).__name__} {address!r}")
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"address must be 'host:port' with a port in 0..65535 (e.g. '127.0.0.1:29600', '[::1]:0'); got {address!r}"
        )
    return ("127.0.0.1" if host == "localhost" else host), int(port)


def format_address(host: str, port: int) -> str:
    """``(host, port)`` as ``"host:port"`` (IPv6 hosts in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (then every member runs on this machine)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Opening(NamedTuple):
    """A generation rank 0 opened: its number, the nonce of the store that holds it, the port of rank 0's watch."""

    generation: int
    nonce: str
    watch_port: int


class Late(Exception):
    """This process arrived at a generation that was decided without it (a signal to try the next one, never raised to
    the caller)."""


def member_info(rank: int, world_size: int, backend: str, uses_nccl: bool) -> dict[str, Any]:
    """What this process brings to the preflight: what must match, and who it is (for the messages)."""
    info: dict[str, Any] = {"rank": rank, "world_size": world_size, "backend": backend, "torch": torch.__version__}
    if uses_nccl:
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
        info["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE")
    info["who"] = f"pid {os.getpid()} on {socket.gethostname()}"
    return info


def _who(info: dict[str, Any]) -> str:
    return f"rank {info['rank']} ({info['who']})"


def compare(infos: list[dict[str, Any]], world_size: int) -> str | None:
    """What differs between the members (rank 0's ``world_size`` is the mode's), naming who; ``None`` when all match."""
    infos = sorted(
        infos, key=lambda info: info["rank"]
    )  # the messages in rank order, whatever order the members came in
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


def _wait(store: dist.Store, keys: list[str], deadline: float) -> bool:
    """Wait until every key exists, or ``deadline`` (``time.monotonic()``) passed: whether they all exist."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return store.check(keys)
    try:
        store.wait(keys, timedelta(seconds=remaining))
    except dist.DistStoreError:
        return store.check(keys)
    return True


def open_generation(store: dist.Store, opening: Opening) -> None:
    """On rank 0: open a generation for the members to join."""
    store.set("open", json.dumps(opening._asdict()))
    store.set(f"opened/{opening.generation}", "1")


def find_generation(store: dist.Store, after: tuple[str, int] | None, deadline: float, mode: str) -> Opening:
    """On a member: the generation to join, the first opened after ``after`` (the store's nonce and the last one
    joined).

    Raises:
        CommTimeoutError: no such generation was opened by ``deadline``.
    """
    key = "open"
    while True:
        if not _wait(store, [key], deadline):
            last = "" if after is None else f" after generation {after[1]}"
            raise CommTimeoutError(
                f"connect on mode {mode!r}: rank 0 opened no generation{last} in time; it has not called connect "
                "again, or is blocked"
            )
        opening = Opening(**json.loads(store.get("open")))
        g = opening.generation
        if after is not None and opening.nonce == after[0] and g <= after[1]:
            key = f"opened/{after[1] + 1}"
        elif store.check([f"{g}/verdict"]):
            key = f"opened/{g + 1}"  # decided without this process
        else:
            return opening


def preflight(store: dist.Store, generation: int, info: dict[str, Any], deadline: float, where: str) -> None:
    """Post this process's info and wait for rank 0's verdict (rank 0 gives it): raise what every member raises.

    ``where`` starts every message (``"connect on mode 'X' (generation 3, timeout 30 s)"``).

    Raises:
        CommMismatchError: the members differ (world size, ranks, backend, torch, NCCL version or
            ``NCCL_CUMEM_ENABLE``).
        CommTimeoutError: a member did not arrive in time (named), or rank 0 gave no verdict.
        Late: on a member, the generation was decided without it.
    """
    g = generation
    arrival = store.add(f"{g}/arrived", 1) - 1
    store.set(f"{g}/member/{arrival}", json.dumps(info))
    if info["rank"] == 0:
        verdict = _decide(store, g, info["world_size"], deadline, where)
        store.set(f"{g}/verdict", json.dumps(verdict))
    else:
        if not _wait(store, [f"{g}/verdict"], deadline + VERDICT_GRACE):
            raise CommTimeoutError(f"{where}: rank 0 gave no verdict on the members in time; it is blocked, or died")
        verdict = json.loads(store.get(f"{g}/verdict"))
        if arrival >= verdict["members"]:
            raise Late(g)
    if verdict["error"] is not None:
        kind, message = verdict["error"]
        raise _ERRORS[kind](message)


def _decide(store: dist.Store, g: int, world_size: int, deadline: float, where: str) -> dict[str, Any]:
    keys = [f"{g}/member/{i}" for i in range(world_size)]
    if _wait(store, keys, deadline):
        problem = compare([json.loads(v) for v in store.multi_get(keys)], world_size)
        error = (
            None
            if problem is None
            else ["CommMismatchError", f"{where}: the members do not match: {problem}. No group was built"]
        )
        return {"members": world_size, "error": error}
    arrived = [json.loads(store.get(key)) for key in keys if store.check([key])]
    missing = sorted(set(range(world_size)) - {info["rank"] for info in arrived})
    came = ", ".join(map(_who, arrived))
    message = f"{where}: ranks {missing} did not arrive in time (arrived: {came}). No group was built"
    return {"members": world_size, "error": ["CommTimeoutError", message]}
