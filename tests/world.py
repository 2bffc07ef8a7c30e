"""Reusable worlds of spawned gloo ranks for multi-process tests.

Starting a process and importing torch is the slow part of a multi-rank test, so a :class:`World` keeps its ranks alive
across tests and hands each of them one task at a time. Ranks are forked from a fork server (``forkserver``): a process
started once per test process that imports torch and the library and does nothing else, so every rank starts from that
clean single-purpose process (never from pytest's, with its threads and state) without importing torch again. Every task
gets a fresh file store (no ports, nothing shared between xdist workers) and every rank destroys its process groups and
restores its environment afterwards, so tests stay independent. Every wait is
bounded: a rank that does not report in time fails the test with every
rank's traceback or fate. After any failure the world is killed and started again for the next test.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT = 60.0
# After one rank fails, peers blocked in a collective it skipped never report: wait this long for them instead of the
# full timeout.
FAILURE_GRACE = 5.0
# How long a rank that finished waits for the go-ahead to tear down (the parent sends it once every rank reported).
CLEANUP_WAIT = 300.0
# What the fork server imports once, before it forks any rank.
PRELOAD = ["torch", "rlightning_comm"]
# The environment this process started with (conftest imports this module before any test runs): the fork server,
# started by the first world, keeps the environment it starts with, so it must not be a test's patched one.
_START_ENV = dict(os.environ)


class WorldError(AssertionError):
    """A task failed or timed out on at least one rank; the message holds every rank's report."""


def free_port() -> int:
    """A loopback port the OS reports free now (another process may still take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world_size: int, url: str, backend: str = "gloo", timeout: float = 60):
    """Initialise the library's context in a worker; returns the context."""
    from rlightning_comm import CommContext

    ctx = CommContext()
    ctx.init_distributed_env(world_size=world_size, rank=rank, backend=backend, dist_url=url, timeout=timeout)
    return ctx


def _cleanup() -> None:
    import torch.distributed as dist

    from rlightning_comm import CommContext

    try:
        CommContext().destroy()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(rank: int, size: int, tasks: Any, results: Any) -> None:
    import torch  # noqa: F401  (import once, up front: it is the slow part)

    while True:
        item = tasks.get()
        if item is None:
            return
        task_id, fn, args, url, env = item
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            out = fn(rank, size, url, *args)
            report = (task_id, rank, True, out)
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            report = (task_id, rank, False, traceback.format_exc())
        try:
            results.put(("report", *report))
        except Exception:  # noqa: BLE001 - an unpicklable result
            report = (task_id, rank, False, "could not send the result back:\n" + traceback.format_exc())
            results.put(("report", *report))
        if report[2]:
            # A rank that finished must not tear its groups down while a peer is still opening connections to them
            # (gloo's connectFullMesh then fails on the peer): wait for the parent's go-ahead. A rank that failed tears
            # down at once, so peers blocked in a collective it skipped fail fast.
            try:
                message = tasks.get(timeout=CLEANUP_WAIT)
            except queue.Empty:
                message = ("cleanup", task_id)
            if message is None:
                _cleanup()
                return
        cleaned: tuple[bool, str] = (True, "")
        try:
            _cleanup()
        except BaseException:  # noqa: BLE001
            cleaned = (False, "cleanup failed:\n" + traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(saved)
        results.put(("cleaned", task_id, rank, *cleaned))


class World:
    """``size`` spawned ranks that run tasks ``fn(rank, size, store_url, *args)`` together."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._task_id = 0
        self._root = tempfile.mkdtemp(prefix=f"rlc-world{size}-")

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        self._procs = [
            ctx.Process(
                target=_worker_main, args=(r, self.size, self._tasks[r], self._results), daemon=True, name=f"rank{r}"
            )
            for r in range(self.size)
        ]
        patched = dict(os.environ)
        os.environ.clear()
        os.environ.update(_START_ENV)
        try:
            for p in self._procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(patched)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None
    ) -> list[Any]:
        """Run ``fn(rank, size, store_url, *args)`` on every rank; return the results in rank order.

        Raises:
            WorldError: a rank raised, died or did not report within ``timeout``.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._task_id += 1
        store = tempfile.mkdtemp(dir=self._root)
        url = f"file://{store}/store"
        for q in self._tasks:
            q.put((self._task_id, fn, args, url, dict(env or {})))
        reports: dict[int, tuple[bool, Any]] = {}
        cleaned: dict[int, tuple[bool, str]] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < self.size:
            message = self._next(deadline)
            if message is None:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in reports]
                for r in dead:
                    reports[r] = (False, f"process died with exit code {self._procs[r].exitcode}")
                if dead:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                if time.monotonic() >= deadline:
                    break
                continue
            kind, task_id, rank, ok, payload = message
            if task_id != self._task_id:
                continue
            if kind == "cleaned":
                cleaned[rank] = (ok, payload)
                continue
            reports[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        if len(reports) == self.size:
            for r, (ok, _) in reports.items():
                if ok:
                    self._tasks[r].put(("cleanup", self._task_id))
            cleanup_deadline = time.monotonic() + 30
            alive = {r for r, p in enumerate(self._procs) if p.is_alive()}
            while not alive <= set(cleaned) and time.monotonic() < cleanup_deadline:
                message = self._next(cleanup_deadline)
                if message is not None and message[0] == "cleaned" and message[1] == self._task_id:
                    cleaned[message[2]] = (message[3], message[4])
                alive = {r for r, p in enumerate(self._procs) if p.is_alive()}
            for r in range(self.size):
                if not reports[r][0]:
                    continue  # its failure is the report
                if r not in cleaned:
                    reports[r] = (False, "did not finish its cleanup (destroying its groups) within 30 s")
                elif not cleaned[r][0]:
                    reports[r] = (False, cleaned[r][1])
        if len(reports) == self.size and all(ok for ok, _ in reports.values()):
            return [reports[r][1] for r in range(self.size)]
        lines = [f"{getattr(fn, '__name__', fn)} failed on a world of {self.size}:"]
        for r in range(self.size):
            if r not in reports:
                lines.append(f"--- rank {r}: no report within the bound (timeout {timeout}s); killed")
            elif not reports[r][0]:
                lines.append(f"--- rank {r}:\n{reports[r][1]}")
            else:
                lines.append(f"--- rank {r}: ok")
        # A rank that failed may hold broken torch.distributed state (a half-made group, say): the next test gets new
        # ranks. Forking them from the fork server is cheap.
        self.close()
        raise WorldError("\n".join(lines))

    def _next(self, deadline: float) -> tuple[Any, ...] | None:
        """The next message from a rank, or ``None`` after half a second (or at ``deadline``) without one."""
        try:
            return self._results.get(timeout=max(0.01, min(deadline - time.monotonic(), 0.5)))
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop every rank (politely, then by force) and forget the queues."""
        for q in self._tasks:
            with contextlib.suppress(Exception):  # a rank's queue may be closed already: it is being stopped anyway
                q.put(None)
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._tasks = []
        self._results = None
