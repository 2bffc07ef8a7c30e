"""A loopback rendezvous address gives a store that listens on loopback only (torch's own listens on every
interface)."""

from __future__ import annotations

import socket

import pytest
from world import free_port

from rlightning_comm.rendezvous import loopback_address, loopback_interface


@pytest.mark.parametrize(
    ("url", "env", "expected"),
    [
        ("tcp://127.0.0.1:29500", {}, ("127.0.0.1", 29500)),
        ("tcp://localhost:29501", {}, ("127.0.0.1", 29501)),
        ("tcp://[::1]:29502", {}, ("::1", 29502)),
        ("tcp://10.1.2.3:29500", {}, None),
        ("tcp://node7.cluster:29500", {}, None),
        ("tcp://127.0.0.1:29500?rank=0&world_size=2", {}, None),
        ("file:///tmp/store", {}, None),
        ("env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29503"}, ("127.0.0.1", 29503)),
        ("env://", {"MASTER_ADDR": "192.168.0.4", "MASTER_PORT": "29503"}, None),
        ("env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29503", "TORCHELASTIC_USE_AGENT_STORE": "True"}, None),
    ],
)
def test_loopback_address(monkeypatch, url, env, expected):
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert loopback_address(url) == expected


def _listening_addresses(port=None):
    """Local addresses of the sockets listening on ``port`` (default: those this process owns), from /proc (IPv4 and
    IPv6)."""
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                addr, hex_port = local.split(":")
                if state == "0A" and (int(hex_port, 16) == port if port is not None else inode in mine):
                    raw = bytes.fromhex(addr)
                    # /proc prints each 32-bit word in host (little-endian) order.
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words))
    return found


def _store_task(rank, size, url, port, use_env):
    import os

    import torch

    from rlightning_comm import CommContext

    if use_env:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = CommContext()
    ctx.init_distributed_env(
        world_size=size,
        rank=rank,
        backend="gloo",
        dist_url="env://" if use_env else f"tcp://127.0.0.1:{port}",
        timeout=30,
    )
    t = torch.ones(2)
    ctx.get_communicator().all_reduce(t)
    return t.tolist(), sorted(_listening_addresses(port))


@pytest.mark.parametrize("use_env", [False, True], ids=["tcp", "env"])
def test_loopback_store_listens_on_loopback_only(world2, use_env):
    port = free_port()
    results = world2.run(_store_task, port, use_env, timeout=60)
    for values, listening in results:
        assert values == [2.0, 2.0]
        assert listening == ["127.0.0.1"], listening


def _gloo_task(rank, size, url):
    import os

    import torch
    from world import init_world

    from rlightning_comm.rendezvous import pin_gloo_to_loopback

    pin_gloo_to_loopback()
    ctx = init_world(rank, size, url, timeout=30)
    t = torch.ones(2)
    ctx.get_communicator().all_reduce(t)
    return t.tolist(), os.environ.get("GLOO_SOCKET_IFNAME"), sorted(_listening_addresses())


def test_pinned_gloo_listens_on_loopback_only(world2):
    for values, ifname, listening in world2.run(_gloo_task, timeout=60):
        assert values == [2.0, 2.0]
        assert ifname == loopback_interface() == "lo"
        assert listening == ["127.0.0.1"], listening
