"""Processes on the hosts of a network lab (``benchmarks/netlab``), one per host, each talking to the test over a pipe
of its own; every wait bounded, every host's traceback back to the test, every process killed at the end."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from world import PRELOAD

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import benchmarks.netlab as netlab  # noqa: E402

assert Path(netlab.__file__).resolve().parent == ROOT / "benchmarks" / "netlab", (
    netlab.__file__
)  # not another checkout's


class HostFailed(AssertionError):
    """A host's process failed, died or did not answer in time; the message says which and what it said."""


def _main(module: str, name: str, conn: Any, host: int, args: tuple) -> None:
    try:
        getattr(importlib.import_module(module), name)(conn, host, *args)
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        conn.send(("failed", traceback.format_exc()))


class Hosts:
    """``fn(conn, host, *args)`` (a module-level function) on every host of ``lab``, forked from the suite's fork server
    (torch imported once) and moved into its host's namespace before it runs."""

    def __init__(self, lab: Any, fn: Any, *args: Any, env: dict[int, dict[str, str]] | None = None) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.conns, self.procs = [], []
        for host in range(lab.hosts):
            parent, child = ctx.Pipe()
            host_env = (env or {}).get(host, lab.env(host))
            proc = lab.process(host, _main, fn.__module__, fn.__name__, child, host, args, env=host_env, context=ctx)
            self.conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> Hosts:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)

    def send(self, host: int, message: Any) -> None:
        self.conns[host].send(message)

    def recv(self, host: int, timeout: float) -> Any:
        """The next message of ``host``.

        Raises:
            HostFailed: the host sent its traceback, died or said nothing within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.conns[host].poll(0.05):
            if not self.procs[host].is_alive() and not self.conns[host].poll(0):
                raise HostFailed(f"host {host} died with exit code {self.procs[host].exitcode} before it answered")
            if time.monotonic() >= deadline:
                raise HostFailed(f"host {host} said nothing within {timeout:g} s")
        message = self.conns[host].recv()
        if isinstance(message, tuple) and message[:1] == ("failed",):
            raise HostFailed(f"host {host} failed:\n{message[1]}")
        return message

    def gather(self, timeout: float) -> list[Any]:
        """The next message of every host, in host order, within one ``timeout``."""
        deadline = time.monotonic() + timeout
        return [self.recv(h, max(0.0, deadline - time.monotonic())) for h in range(len(self.procs))]
