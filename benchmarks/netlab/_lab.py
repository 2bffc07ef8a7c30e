"""The lab: hosts in network namespaces of their own, each linked to a bridge (in a namespace of its own) by a veth pair
shaped with ``tc tbf`` in both directions.

Everything the lab creates lives in namespaces named ``rlcnl-<pid>-<n>-...`` (``<pid>`` the process that built it):
nothing is created in the machine's own namespace, and only namespaces of that form are ever removed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from ._netns import (
    IFNAME,
    NETNS_DIR,
    PREFIX,
    SUBNET,
    LabError,
    cleanup,
    enter,
    format_rate,
    in_namespace,
    parse_rate,
    unavailable,
)
from ._netns import run as _run

_serial = iter(range(1 << 30))


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
