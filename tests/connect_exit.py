"""Processes of a connected mode that end through the interpreter's own exit (not ``os._exit``, as a
multiprocessing child does), run by ``tests/test_connect_long_run.py`` under ``python -X dev``.

``host FOLDER``: rank 0. Its first generation loses member 1 while the group is built; its second loses member 1 (killed
by the test) during a barrier, and that ``PeerLostError`` is not caught. ``victim FOLDER``: member 1 of the first
generation, which dies (SIGKILL) where it would build the group. ``member FOLDER``: member 1 of the second generation.
"""

from __future__ import annotations

import os
import signal
import sys
import time

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


def main(role: str, folder: str) -> None:
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
            print(f"lost {err.member} while forming", flush=True)
        comm = ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
        print("formed", flush=True)
        comm.barrier()  # member 1 is killed meanwhile: not caught, on purpose
    elif role == "victim":
        from rlightning_comm.connect import _connection

        def build_group(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        _connection.build_group = build_group
        ctx.connect(MODE, rank=1, world_size=2, address=_read(path), timeout=60)
    else:
        ctx.connect(MODE, rank=1, world_size=2, address=_read(path), timeout=60)
        print("formed", flush=True)
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
