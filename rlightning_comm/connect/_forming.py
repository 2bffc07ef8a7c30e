"""Where the members of a connected mode meet: the address, the keys of rank 0's store, and the waits on them.

Every key lives under the mode's prefix in the store rank 0 hosts:

* ``open``: the generation rank 0 opened last (JSON: its key in this store, the store's nonce, the port of rank 0's
  watch); ``opened/<g>`` marks that ``g`` was opened.
* ``<g>/arrived``: a counter; the ``i``-th member to arrive posts what it is (:func:`member_info`, with its watch token
  and its proof of the secret) under ``<g>/member/<i>``.
* ``<g>/verdict``: rank 0's verdict: the tokens it counted (the first ``world_size`` arrivals that proved the secret and
  are connected to its watch), their infos, the generation's number, and the error every member raises, if any.
* ``<g>/lost``: the member the formed generation lost (rank 0's watch posts it).

A member joins the newest opened generation that it has not been in and that has no verdict yet; how rank 0 judges the
arrivals, and what a process that arrives after the verdict does, is :mod:`._judging`'s.
"""

from __future__ import annotations

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

from rlightning_comm.connect._messages import proof
from rlightning_comm.errors import CommTimeoutError, PeerLostError

# After rank 0's own deadline the others wait this much longer for its verdict, which names who did not come.
VERDICT_GRACE = 5.0
POLL = 0.05  # how often a wait of the forming looks whether the generation was lost meanwhile
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
        pause = min(pause * 2, POLL)


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
