"""A connected mode over 100 generations of kill-and-replace, each with a sync: nothing grows, ``destroy()`` frees all.

``tests/connect_long_run.py`` runs under ``python -X dev``; its trainer (rank 0) and engine 1 live through every
generation, and each generation's engine 2 syncs once, then kills itself (SIGKILL) on the first bucket of the next sync,
so the survivors' transfer fails midway, the case that kept a generation's communicator, buffers and gloo context alive.
Oracles: the source's digest, the survivors' own counts of descriptors, threads and memory after warm-up, and ``gc``'s
count of live communicators.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GENERATIONS = 100
WARM = range(10, 30)  # after warm-up (allocator, lazily started threads)
LAST = range(GENERATIONS - 20, GENERATIONS)
RSS_BAND = 24 * 2**20  # allocator noise; a leak of this mode's buffers alone is 4 MiB per generation and process


def test_a_hundred_generations_of_kill_and_replace_grow_nothing():
    program = Path(__file__).with_name("connect_long_run.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-X", "dev", str(program), str(GENERATIONS)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    gens = report["generations"]
    assert len(gens) == GENERATIONS
    for g, gen in enumerate(gens):
        assert gen["generation"] == [g, g, g] and gen["digests"] == 1, (g, gen)  # every member holds the source's
        assert gen["lost"] == [[g, 2], [g, 2]], (g, gen)  # both survivors named engine 2 in this generation
    for role in ("trainer", "engine1"):
        warm = [gens[g]["usage"][role] for g in WARM]
        last = [gens[g]["usage"][role] for g in LAST]
        fds, threads, rss = (max(u[i] for u in warm) for i in range(3))
        assert max(u[0] for u in last) <= fds + 2, f"{role}: descriptors grew: {warm} -> {last}"
        assert max(u[1] for u in last) <= threads + 1, f"{role}: threads grew: {warm} -> {last}"
        assert max(u[2] for u in last) <= rss + RSS_BAND, f"{role}: memory grew: {warm} -> {last}"
        destroyed = report["destroyed"][role]
        (fds0, threads0, *_), (fds1, threads1, rss1, _) = destroyed["before"], destroyed["after"]
        assert destroyed["communicators"] == 0, f"{role}: {destroyed['communicators']} communicators outlived destroy()"
        assert fds1 <= fds0 + 3 and threads1 <= threads0 + 1, f"{role}: destroy() kept {destroyed}"
        assert rss1 <= rss + RSS_BAND, f"{role}: destroy() kept memory: {destroyed}"
    # A member whose PeerLostError is not caught exits with it, and nothing native complains at exit.
    assert report["uncaught_exitcode"] == 1
    assert "PeerLostError" in done.stderr and "terminate called" not in done.stderr, done.stderr[-5000:]


@pytest.mark.parametrize("flags", [[], ["--exit-during-a-break"]], ids=["plain", "exit-during-a-break"])
def test_a_process_ends_cleanly_after_losses_while_forming_and_an_uncaught_peer_lost_error(tmp_path, flags):
    """Through the interpreter's own exit: a group build left behind by a loss (it stops with its generation) and an
    uncaught PeerLostError abort nothing ("terminate called", a fatal error), also when the watch is still handling the
    loss in a native call as the interpreter exits."""
    program = Path(__file__).with_name("connect_exit.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}

    def start(role, *args):
        return subprocess.Popen(
            [sys.executable, "-X", "dev", str(program), role, str(tmp_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    host, victim = start("host", *flags), start("victim")
    member = None
    try:
        assert host.stdout.readline() == "lost 1 while forming; builds left 0\n"
        member = start("member")
        assert member.stdout.readline() == "formed\n" and host.stdout.readline() == "formed\n"
        member.kill()
        _, err = host.communicate(timeout=60)
    finally:
        for p in (host, victim, member):
            if p is not None and p.poll() is None:
                p.kill()
    assert host.returncode == 1, err[-5000:]
    assert "PeerLostError" in err and "terminate called" not in err and "Fatal Python error" not in err, err[-5000:]
