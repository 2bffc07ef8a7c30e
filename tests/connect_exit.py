"""Processes of a connected mode that end through the interpreter's own exit (not ``os._exit``, as a
multiprocessing child does), run by ``tests/test_connect_long_run.py`` under ``python -X dev``.

``host FOLDER [--exit-during-a-break]``: rank 0. Its first generation loses member 1 while the group is built (it says
how many group builds are left running then); its second loses member 1 (killed by the test) during a barrier, and that
``PeerLostError`` is not caught. With ``--exit-during-a-break`` the watch's handling of that loss is still in a native
call when the interpreter exits (see :func:`_exit_during_a_break`). ``victim FOLDER``: member 1 of the first generation,
which dies (SIGKILL) where it would build the group. ``member FOLDER``: member 1 of the second generation.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from rlightning_comm import CommContext, PeerLostError

MODE = "M"


def _read(path: str) -> str:
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def _builds_left(wait: float = 5.0) -> int:
    """The group builds still running, once they had ``wait`` seconds to stop."""
    deadline = time.monotonic() + wait
    while True:
        builds = [t for t in threading.enumerate() if t.name.startswith("rlightning-comm-build")]
        if not builds or time.monotonic() > deadline:
            return len(builds)
        time.sleep(0.01)


class _SlowFinalisation:
    def __del__(self, time=time) -> None:  # noqa: B008 - the module's globals are gone by then
        time.sleep(1.0)


def _exit_during_a_break() -> None:
    """The watch's break of the group after the next loss first makes a native call of half a second (a store's wait, as
    the break's own gloo wait, only longer), and the interpreter's finalisation lasts a second (a garbage cycle whose
    ``__del__`` sleeps, collected only then): that call would return into the finalisation, which aborts a process
    unless its exit waits for the call."""
    from rlightning_comm.connect import _generation

    break_group = _generation.break_group

    def slow_break(group) -> None:
        with contextlib.suppress(RuntimeError):
            dist.HashStore().wait(["never"], timedelta(seconds=0.5))
        break_group(group)

    _generation.break_group = slow_break
    gc.disable()
    cycle = _SlowFinalisation()
    cycle.cycle = cycle


def main(role: str, folder: str, *flags: str) -> None:
    ctx = CommContext()
    path = os.path.join(folder, "address")
    if role == "host":
        address = ctx.listen("127.0.0.1:0")
        with open(path + ".tmp", "w") as f:
            f.write(address)
        os.replace(path + ".tmp", path)
        try:
            ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
        except PeerLostError as err:
            print(f"lost {err.member} while forming; builds left {_builds_left()}", flush=True)
        comm = ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
        if "--exit-during-a-break" in flags:
            _exit_during_a_break()
        print("formed", flush=True)
        comm.barrier()  # member 1 is killed meanwhile: not caught, on purpose
    elif role == "victim":
        from rlightning_comm.connect import _groups

        def build_group(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        _groups.build_group = build_group
        ctx.connect(MODE, rank=1, world_size=2, address=_read(path), timeout=60)
    else:
        ctx.connect(MODE, rank=1, world_size=2, address=_read(path), timeout=60)
        print("formed", flush=True)
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
