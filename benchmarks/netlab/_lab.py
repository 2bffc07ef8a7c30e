"""The lab: hosts in network namespaces of their own, each linked to a bridge (in a namespace of its own) by a veth pair
shaped with ``tc tbf`` in both directions.

Everything the lab creates lives in namespaces named ``rlcnl-<pid>-<n>-...`` (``<pid>`` the process that built it):
nothing is created in the machine's own namespace, and only namespaces of that form are ever removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import multiprocessing as mp
import os
import re
import shutil
import signal
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
_serial = iter(range(1 << 30))


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


def _run(*argv: str) -> None:
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
            _run("ip", "netns", "delete", name)
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


def _host_main(namespace: str, env: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    enter(namespace)  # before anything opens a socket: every thread started from here on is in the host too
    os.environ.update(env)
    target(*args)


class Lab:
    """``hosts`` hosts, each in a network namespace of its own, linked to one bridge (in a namespace of its own) by a
    veth pair shaped to ``rate_bit`` bits per second in both directions (``None``: unshaped).

    Build it with ``with Lab(...) as lab:`` (or :meth:`build` and :meth:`close`): every namespace is removed when the
    block ends, by an exception, ``Ctrl-C`` or ``SIGTERM`` too. Stale namespaces of dead builders are removed first.

    Args:
        hosts: Number of hosts (at least 1, at most 250).
        rate_bit: Each link's rate in bits per second, each direction (``tc tbf``), or ``None`` for none.
        burst_bytes: The token bucket's size (``None``: 2 ms at the rate, at least 256 KiB: a TCP segment offload
            burst of 64 KiB must fit).
    """

    def __init__(self, hosts: int, rate_bit: float | None = None, *, burst_bytes: int | None = None) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be an integer from 1 to 250; got {hosts!r}")
        self.hosts = hosts
        self.rate_bit = None if rate_bit is None else parse_rate(rate_bit)
        rate_bytes = (self.rate_bit or 0) / 8
        self.burst_bytes = burst_bytes if burst_bytes is not None else max(256 * 1024, int(rate_bytes * 0.002))
        self.name = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.bridge = f"{self.name}-br"
        self.namespaces = [f"{self.name}-h{i}" for i in range(hosts)]
        self.addresses = [str(SUBNET.network_address + i + 1) for i in range(hosts)]
        self._built: list[str] = []
        self._handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    def build(self) -> Lab:
        """Create the bridge, the hosts and their shaped links (removing stale lab namespaces of dead builders first).

        Raises:
            LabError: no root, ``ip``/``tc`` missing, or a command failed (what was built is removed).
        """
        why = unavailable()
        if why is not None:
            raise LabError(why)
        cleanup(stale_only=True)
        try:
            self._ns(self.bridge)
            _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                self._ns(ns)
                port = f"h{i}"
                _run("ip", "-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/{SUBNET.prefixlen}", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "up")
                if self.rate_bit is not None:
                    self._shape(ns, IFNAME)  # host -> bridge
                    self._shape(self.bridge, port)  # bridge -> host
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every namespace this lab created (their veths and qdiscs go with them); idempotent."""
        errors = []
        while self._built:
            ns = self._built.pop()
            try:
                _run("ip", "netns", "delete", ns)
            except LabError as err:
                if (NETNS_DIR / ns).exists():
                    errors.append(str(err))
        self._restore_signals()
        if errors:
            raise LabError("could not remove every lab namespace: " + "; ".join(errors))

    def __enter__(self) -> Lab:
        self._catch_signals()
        try:
            return self.build()
        except BaseException:
            self._restore_signals()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, name: str) -> None:
        if (NETNS_DIR / name).exists():  # ours by name (pid and serial): a dead process's whose pid this one reuses
            _run("ip", "netns", "delete", name)
        _run("ip", "netns", "add", name)
        self._built.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{int(self.rate_bit)}bit"
        _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
             str(self.burst_bytes), "latency", "50ms")  # fmt: skip

    def _catch_signals(self) -> None:
        """SIGTERM and SIGHUP raise ``SystemExit`` (as Ctrl-C raises ``KeyboardInterrupt``), so the ``with`` block
        unwinds and removes the lab; only from the main thread (elsewhere Python cannot install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        while self._handlers:
            sig, previous = self._handlers.popitem()
            signal.signal(sig, previous)

    # ------------------------------------------------------------------ using it
    def env(
        self, host: int, rank: int | None = None, world_size: int | None = None, port: int = 29500
    ) -> dict[str, str]:
        """The environment a rank on ``host`` needs: gloo on the lab interface, and the world's meeting point at host
        0 (torchrun's variables; ``RANK``/``WORLD_SIZE`` only when given)."""
        env = {
            "GLOO_SOCKET_IFNAME": IFNAME,
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(port),
            "RLCNL_HOST": str(host),
            "RLCNL_NETNS": self.namespaces[host],
        }
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
        if world_size is not None:
            env["WORLD_SIZE"] = str(world_size)
        return env

    def command(self, host: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run on ``host``: ``ip netns exec <ns> env K=V ... argv``."""
        pairs = [f"{k}={v}" for k, v in (self.env(host) if env is None else env).items()]
        return ["ip", "netns", "exec", self.namespaces[host], "env", *pairs, *argv]

    def process(
        self, host: int, target: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, context: Any = None
    ) -> Any:
        """A process (not started) that runs ``target(*args)`` on ``host``: it enters the host's namespace first thing,
        then sets ``env`` (default :meth:`env`). ``context`` is a ``multiprocessing`` context (default ``spawn``;
        never ``fork``: a forked copy of a threaded parent is in the parent's namespace in every other thread)."""
        ctx = context if context is not None else mp.get_context("spawn")
        env = self.env(host) if env is None else env
        return ctx.Process(target=_host_main, args=(self.namespaces[host], env, target, args), name=f"lab-h{host}")

    def run_in(self, host: int, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """``fn()`` in a thread of this process on ``host`` (see :func:`in_namespace`)."""
        return in_namespace(self.namespaces[host], fn, timeout)

    def cut(self, host: int) -> None:
        """Cut ``host``'s link at the bridge: its port leaves the bridge, so nothing passes in either direction, while
        the host's own interface stays up (as when a switch port or cable fails; no reset reaches anyone)."""
        _run("ip", "-n", self.bridge, "link", "set", f"h{host}", "nomaster")

    def port_bytes(self, host: int) -> tuple[int, int]:
        """Bytes ``host`` has sent into its link and received from it so far (its bridge port's counters)."""

        def read() -> str:
            with open("/proc/thread-self/net/dev") as f:  # this thread's namespace (``/proc/net`` is the process's)
                return f.read()

        for line in self.run_in_bridge(read).splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == f"h{host}":
                values = fields.split()
                return int(values[0]), int(values[8])  # the port receives what the host sends, and the other way
        raise LabError(f"no port h{host} on the bridge of {self.name}")

    def run_in_bridge(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """``fn()`` in a thread of this process in the bridge's namespace."""
        return in_namespace(self.bridge, fn, timeout)

    def restore(self, host: int) -> None:
        """Undo :meth:`cut`."""
        _run("ip", "-n", self.bridge, "link", "set", f"h{host}", "master", "br0")
        _run("ip", "-n", self.bridge, "link", "set", f"h{host}", "up")

    def describe(self) -> str:
        """One line: hosts, rate, addresses."""
        rate = "unshaped" if self.rate_bit is None else f"tbf {format_rate(self.rate_bit)} each direction"
        return f"netlab {self.name}: {self.hosts} hosts ({self.addresses[0]}..{self.addresses[-1]}), {rate}"
