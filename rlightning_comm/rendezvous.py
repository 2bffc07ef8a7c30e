"""World initialisation whose store listens on loopback only, when the rendezvous address is a loopback one.

torch's ``TCPStore`` server listens on every interface whatever host the URL names, so ``tcp://127.0.0.1:29500`` exposes
an unauthenticated key-value store (which the process groups trust) to the whole network. When the rendezvous address is
loopback (``tcp://127.0.0.1:port``, ``tcp://localhost:port``, ``tcp://[::1]:port``, or ``env://`` with such a
``MASTER_ADDR`` outside a torchrun agent), rank 0 binds the listening socket to that address itself and hands it to the
store. Every other URL goes to torch unchanged.

The backend's own connections are another matter: gloo listens on the interface its host name resolves to unless
``GLOO_SOCKET_IFNAME`` names one. :func:`pin_gloo_to_loopback` sets it for processes that are known to be single-node
(``rlightning_comm.launch.run`` does so for the ranks it spawns).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import weakref
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from rlightning_comm import _compat
from rlightning_comm.errors import CommError


def loopback_address(init_method: str) -> tuple[str, int] | None:
    """The ``(host, port)`` of a loopback TCP rendezvous, or ``None`` for any other init method."""
    url = urlparse(init_method)
    if url.scheme == "tcp" and not url.query:
        try:
            host, port = url.hostname, url.port
        except ValueError:
            return None
    elif url.scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Under a torchrun agent the agent already serves the store; workers only connect.
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    else:
        return None
    if host is None or port is None:
        return None
    if host == "localhost":
        host = "127.0.0.1"
    try:
        if not ipaddress.ip_address(host).is_loopback:
            return None
        return host, int(port)
    except ValueError:
        return None  # not an IP literal, or a bad port: torch reports it


def init_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    timeout: timedelta,
    device_id: torch.device | None = None,
) -> None:
    """``torch.distributed.init_process_group``, with a loopback-only store for a loopback rendezvous address.

    The world's store is made here (a loopback ``TCPStore``, or torch's public ``torch.distributed.rendezvous`` for
    every other URL, as ``init_process_group`` itself does) and kept for :func:`world_store`.

    ``device_id`` (an NCCL world's GPU) binds the world to that device: torch connects the world's communicator at once,
    refuses a tensor on another device, and creates later NCCL groups by splitting the world's communicator (every rank
    of the world must then take part in every group creation, members or not;
    :func:`rlightning_comm.context._groups.new_group` makes the members of a gloo group take part too).

    Raises:
        CommError: rank 0 could not listen on the loopback address.
    """
    address = loopback_address(init_method)
    if address is None:
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    else:
        host, port = address
        if rank == 0:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                True,
                timeout,
                master_listen_fd=listen_fd(host, port, world_size, f"the store of {init_method!r} (rank 0 hosts it)"),
                use_libuv=True,
            )
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout, use_libuv=True)
    # The key layout torch gives the store it makes from a URL, so peers that let torch initialise interoperate.
    store = dist.PrefixStore(_compat.DEFAULT_PG_STORE_PREFIX, store)
    dist.init_process_group(
        backend=backend, store=store, world_size=world_size, rank=rank, timeout=timeout, device_id=device_id
    )
    _STORES[dist.group.WORLD] = store


def listen_fd(host: str, port: int, peers: int, what: str) -> int:
    """A socket listening on ``host:port`` only (port 0: one the OS picks), as a file descriptor for
    ``TCPStore(master_listen_fd=...)``.

    Raises:
        CommError: the address cannot be listened on (the message names ``what`` it was for).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=max(128, peers)).detach()
    except OSError as err:
        raise CommError(f"could not listen on {host}:{port} for {what}: {err}") from err


# Group -> the store its members share (the world's, a connected mode's); an entry goes with its group, so a destroyed
# group's store (and port) is not kept alive.
_STORES: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.Store] = weakref.WeakKeyDictionary()


def register_store(group: object, store: dist.Store) -> None:
    """Record ``store`` as the one every member of ``group`` reaches: a group outside the world, made with a store of
    its own."""
    _STORES[group] = store


def own_store(group: object) -> dist.Store | None:
    """The store registered for ``group`` (:func:`register_store`), or ``None`` for a group of the world."""
    return None if group is dist.group.WORLD else _STORES.get(group)


def world_store() -> dist.Store:
    """The store the world was initialised with: the one every rank of the world reaches.

    Raises:
        CommError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise CommError("torch.distributed is not initialised: there is no world store")
    store = _STORES.get(dist.group.WORLD)
    return _compat.default_store() if store is None else store  # a world initialised outside the library


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or ``None`` if there is none."""
    names = [name for _, name in getattr(socket, "if_nameindex", list)()]
    return next((name for name in names if name in ("lo", "lo0")), None)


def pin_gloo_to_loopback() -> None:
    """Make gloo listen on the loopback interface in this process, unless ``GLOO_SOCKET_IFNAME`` is set already.

    Only for processes whose peers all run on this host; call it before the world is initialised.
    """
    name = loopback_interface()
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
