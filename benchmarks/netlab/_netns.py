"""The machine's side of the lab: its names, ``ip``/``tc`` commands, network namespaces (entering, listing, removing
the lab's) and rates in ``tc``'s notation."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "rlcnl-"
"""Every namespace the lab creates starts with this."""

IFNAME = "rlcnl0"
"""The lab interface's name inside every host (one ``GLOO_SOCKET_IFNAME`` fits every host)."""

SUBNET = ipaddress.ip_network("198.18.0.0/24")
"""The hosts' addresses: the range reserved for network benchmarks (RFC 2544); host ``i`` is the ``i + 1``-th."""

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT = 10.0  # seconds for one ``ip``/``tc`` call; they take milliseconds
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(br|h\d+)$")


class LabError(RuntimeError):
    """The lab cannot be built here (no root, no ``ip``/``tc``) or an ``ip``/``tc`` command failed."""


def unavailable() -> str | None:
    """Why no lab can be built on this machine, or ``None`` when one can (root, ``ip`` and ``tc``)."""
    if os.geteuid() != 0:
        return f"the network lab needs root (network namespaces, veth pairs, tc); running as uid {os.geteuid()}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs iproute2's {' and '.join(missing)} on PATH; not found"
    return None


def parse_rate(rate: str | float) -> float:
    """Bits per second from ``tc``'s notation (``"1gbit"``, ``"2500mbit"``, ``"100kbit"``) or a number.

    Raises:
        ValueError: not a positive rate in that notation.
    """
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit)?\s*", rate.lower())
        if match is None:
            raise ValueError(f"rate {rate!r} is not a rate; expected e.g. '1gbit', '2500mbit' or bits per second")
        value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    if not value > 0:
        raise ValueError(f"rate must be positive; got {rate!r}")
    return value


def format_rate(bits: float) -> str:
    """``2.5 Gbit/s``, ``800 Mbit/s``."""
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"


def run(*argv: str) -> None:
    """Run an ``ip``/``tc`` command; raise :class:`LabError` with its stderr when it fails or takes over 10 s."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as err:
        raise LabError(f"`{' '.join(argv)}` did not finish within {_COMMAND_TIMEOUT:g} s") from err
    if done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed with exit code {done.returncode}: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(stale_only: bool = False) -> list[str]:
    """Remove lab namespaces (``rlcnl-<pid>-<n>-...``); with ``stale_only``, only those whose building process is dead.

    Returns:
        The namespaces removed.
    """
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match is None or (stale_only and _alive(int(match.group(1)))):
            continue
        with contextlib.suppress(LabError):  # another process removed it meanwhile
            run("ip", "netns", "delete", name)
            removed.append(name)
    return removed


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (threads it starts afterwards are there too; the
    sockets it opened before stay where they were).

    Raises:
        LabError: the namespace does not exist or ``setns`` failed.
    """
    path = NETNS_DIR / namespace
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise LabError(f"network namespace {namespace!r} not found at {path}: {err}") from err
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise LabError(f"setns into {namespace!r} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)


def in_namespace(namespace: str, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn()`` in a short-lived thread moved into ``namespace`` and return its result (sockets it opens stay in
    that namespace); the calling thread stays where it is.

    Raises:
        LabError: the thread did not finish within ``timeout`` seconds; or what ``fn`` raised.
    """
    out: list[Any] = []

    def body() -> None:
        try:
            enter(namespace)
            out.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
            out.append((False, err))

    thread = threading.Thread(target=body, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not out:
        raise LabError(f"a thread in namespace {namespace!r} did not finish within {timeout:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value
