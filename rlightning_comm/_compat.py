"""The one home of what differs between torch releases and of the private torch APIs the library relies on, and of
what differs between Python releases at the interpreter's exit.

Everything version-dependent or private is looked up here once, at import, so a torch release that moves it fails in one
place (and in ``tests/test_compat.py``), not deep inside a collective.

Native calls on the library's daemon threads are kept out of the interpreter's finalisation (:func:`native_call`).

Before Python 3.14, a daemon thread that takes the interpreter lock back once the interpreter has begun finalising is
ended on the spot with ``pthread_exit``. When that happens as a call into torch returns, inside the destructor of
pybind11's ``gil_scoped_release`` (which released the lock for the call, and is ``noexcept``), the forced unwinding of
``pthread_exit`` cannot pass it: libstdc++ aborts the process ("terminate called without an active exception"). A
connected mode makes such calls on its daemon threads: the watch posting a loss in the store and breaking the group (a
gloo wait, an NCCL ``abort``), the grace timer breaking it, a group build left behind by a loss.

So those calls run inside :func:`native_call`: at the interpreter's exit (an ``atexit`` hook, which runs before the
finalisation begins) no new one starts, and the hook waits for the ones in flight, at most :data:`EXIT_WAIT` seconds.
A call that may last longer ends when :func:`exiting` says so (the group build's store, in :mod:`.connect._groups`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives and deprecated the old names; older releases only have those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(output, input, group=..., async_op=...)``: gather equal-sized flat inputs into one output."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(output, input, op=..., group=..., async_op=...)``: reduce, then keep this rank's slice."""

# ------------------------------------------------------------------ private torch details
# Each is checked by tests/test_compat.py, so a torch release that changes one fails there, loudly.

DEFAULT_PG_STORE_PREFIX = "default_pg"
"""The prefix ``init_process_group`` puts on the store it makes from a URL (``PrefixStore("default_pg", store)``).

Not an API, a key layout: a world initialised from our own store uses it so
that ranks initialised by torch from the same URL meet ours in the store.
"""

TENSOR_PICKLE_GLOBALS = (("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"))
"""The globals a pickled dense CPU tensor names: ``(rebuild the tensor, load its storage)``.

Safe mode's unpickler resolves exactly these (to checked replacements of its own); they are the wire format of
``torch.distributed.broadcast_object_list``, not functions the library calls.
"""


COALESCING: dict[Any, list[Any]] = dist.distributed_c10d._world.pg_coalesce_state
"""Process group -> the collectives torch's ``_coalescing_manager`` has recorded for it; a group is a key while a
manager is open on it.

The dict object itself (torch only ever mutates it), so testing ``group in
COALESCING`` costs one lookup. Inside the manager, torch's ``all_reduce``,
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` record their call and
the manager issues them as one coalesced call when it exits.
"""


BACKEND_METHODS = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
}
"""The methods of a backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``) that the communicators call by a
``ProcessGroup``'s name.

A connected mode's group is a backend object built outside the world (no
``ProcessGroup`` wraps it, which would take torch's private ``_register_backend``);
it takes the same arguments under these names.
"""


def gloo_options(timeout: timedelta, host: str | None) -> Any:
    """Options of a ``ProcessGroupGloo`` with ``timeout`` whose devices listen on ``host``, or with ``host`` ``None`` on
    the interfaces ``GLOO_SOCKET_IFNAME`` names (a comma-separated list), else on the address the host name resolves
    to: what torch's ``ProcessGroupGloo(store, rank, size, timeout)`` does, which building from options skips."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if host:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    elif interfaces := gloo_interfaces():
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=name) for name in interfaces]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


def gloo_interfaces() -> list[str]:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names, in order (torch reads it only when it builds gloo's devices itself,
    and ignores a value of one character)."""
    value = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return [name for name in value.split(",") if name] if len(value) > 1 else []


def default_store() -> dist.Store:
    """The store of a default process group the library did not create (torch has no public accessor)."""
    return dist.distributed_c10d._get_default_store()


def rebuild_tensor(
    storage: torch.storage.TypedStorage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """A tensor viewing ``storage`` (public API: ``Tensor.set_``, which checks the view stays inside the storage)."""
    return torch.empty(0, dtype=storage.dtype, device=storage.device).set_(storage.untyped(), offset, size, stride)


def join_world_split() -> None:
    """On a world bound to a device, take part in the split of the world's communicator that torch runs on every
    non-member.

    With ``init_process_group(device_id=...)``, torch's ``new_group`` makes every rank outside the new group run the
    world communicator's no-color split (``ncclCommSplit`` is collective over the whole world), whatever the new group's
    backend. The members of a new NCCL group split with their color, but the members of a new gloo group make no split
    at all, so the non-members would wait for them (pytorch#145376 is this mismatch). A member of a new non-NCCL group
    calls this after ``new_group``: every rank of the world then makes one split per group. No-op on an unbound world.
    """
    c10d = dist.distributed_c10d
    world = c10d._get_default_group()
    device = world.bound_device_id
    if device is None:
        return
    source = c10d._get_split_source(world)
    if source is not None:
        source.perform_nocolor_split(device)


# ------------------------------------------------------------------ native calls at the interpreter's exit

EXIT_WAIT = 5.0  # seconds the interpreter's exit waits for the native calls in flight

_cond = threading.Condition()
_active = 0
_exiting = False


@contextlib.contextmanager
def native_call() -> Iterator[bool]:
    """Run a native call of a daemon thread inside this block; it yields whether the call may start (``False`` once the
    interpreter exits: skip it)."""
    global _active
    with _cond:
        allowed = not _exiting
        if allowed:
            _active += 1
    try:
        yield allowed
    finally:
        if allowed:
            with _cond:
                _active -= 1
                _cond.notify_all()


def exiting() -> bool:
    """Whether the interpreter is exiting (a long native call ends when it is)."""
    return _exiting


def _at_exit() -> None:
    global _exiting
    with _cond:
        _exiting = True
        _cond.wait_for(lambda: _active == 0, EXIT_WAIT)


atexit.register(_at_exit)
