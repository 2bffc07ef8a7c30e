"""The network lab (``benchmarks/netlab``): it builds and removes only namespaces of its own on every path, its shaper
binds (the calibration's rate), gloo and a connected mode work across its hosts, and a connected mode listens where
``GLOO_SOCKET_IFNAME`` says (unit test without the lab).

The lab needs root and iproute2: its tests skip with the reason elsewhere. CI runs as root.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from netlab_hosts import ROOT, Hosts, netlab

from rlightning_comm import _compat

needs_lab = pytest.mark.skipif(netlab.unavailable() is not None, reason=str(netlab.unavailable()))


def _ours() -> set[str]:
    return {n for n in netlab._netns._namespaces() if n.startswith(f"{netlab.PREFIX}{os.getpid()}-")}


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True).stdout


# ---------------------------------------------------------------------- without the lab
def test_a_gloo_device_of_a_connected_mode_listens_on_the_interfaces_gloo_socket_ifname_names(monkeypatch):
    """torch builds gloo's devices from ``GLOO_SOCKET_IFNAME`` only in ``ProcessGroupGloo(store, rank, size, timeout)``;
    a connected mode builds its group from options, so it must read the variable itself."""
    wait = timedelta(seconds=5)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "rlcnl-none0")
    with pytest.raises(RuntimeError, match="rlcnl-none0"):  # the interface it names is looked up (and missing here)
        _compat.gloo_options(wait, None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert len(_compat.gloo_options(wait, None)._devices) == 2  # one device per interface, as torch's
    assert len(_compat.gloo_options(wait, "127.0.0.1")._devices) == 1  # a loopback meeting address wins
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert len(_compat.gloo_options(wait, None)._devices) == 1


def test_rates_parse_in_tcs_notation_and_a_bad_one_says_what_it_got():
    assert [netlab.parse_rate(r) for r in ("1gbit", "2500mbit", "100kbit", 5e8)] == [1e9, 2.5e9, 1e5, 5e8]
    with pytest.raises(ValueError, match="'fast' is not a rate"):
        netlab.parse_rate("fast")


def test_without_root_the_lab_says_it_needs_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netlab.LabError, match="needs root"):
        netlab.Lab(2).build()


# ---------------------------------------------------------------------- the lab itself
@needs_lab
def test_the_lab_builds_its_hosts_and_removes_them_after_an_exception_touching_nothing_in_the_root_namespace():
    before, links = _ours(), _root_links()
    with pytest.raises(KeyError, match="inside"):
        with netlab.Lab(3, netlab.parse_rate("1gbit")) as lab:
            assert _ours() - before == {*lab.namespaces, lab.bridge}
            assert sorted(n for _, n in lab.run_in(1, socket.if_nameindex)) == ["lo", netlab.IFNAME]
            assert _root_links() == links  # nothing created in the machine's own namespace
            raise KeyError("inside")
    assert _ours() == before


@needs_lab
def test_stale_namespaces_of_dead_builders_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    stale = f"{netlab.PREFIX}{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        with netlab.Lab(1) as lab:
            assert stale not in netlab._netns._namespaces()  # the lab removed it at start
            assert netlab.cleanup(stale_only=True) == []  # its own namespaces are live
            assert lab.namespaces[0] in netlab._netns._namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, timeout=10)


_DRIVER = """
import sys, time
sys.path.insert(0, {root!r})
from benchmarks.netlab import Lab
with Lab(2) as lab:
    print(" ".join([*lab.namespaces, lab.bridge]), flush=True)
    time.sleep(60)
"""


@needs_lab
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL then cleanup"])
def test_a_stopped_driver_leaves_no_namespace(how):
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        names = driver.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(netlab._netns._namespaces()), names
        driver.send_signal({"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}.get(how, signal.SIGKILL))
        driver.wait(10)
        if how.startswith("SIGKILL"):
            assert set(names) <= set(netlab._netns._namespaces())  # nothing ran in the killed driver
            cli = [sys.executable, "-m", "benchmarks.netlab", "cleanup"]
            out = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
            assert set(names) <= set(out.split()), out  # "removed N lab namespaces: <names>"
        left = set(names) & set(netlab._netns._namespaces())
        assert not left, f"{how}: the driver left {sorted(left)}"
    finally:
        driver.kill()
        driver.wait(10)


@needs_lab
@pytest.mark.parametrize("rate", ["1gbit", "2500mbit"])
def test_the_calibration_measures_the_shapers_rate(rate):
    """The lab's contract: the link's achieved rate is the configured one, +-25%. No transfer may beat the shaper; a
    loaded 2-core machine may slow one, so the best of up to three per direction counts for the lower bound."""
    with netlab.Lab(2, netlab.parse_rate(rate)) as lab:
        for src, dst in [(0, 1), (1, 0)]:
            got = []
            while len(got) < 3 and not any(g >= 0.75 * lab.rate_bit for g in got):
                got.append(netlab.calibrate(lab, src, dst).bits_per_s)
            assert max(got) <= 1.25 * lab.rate_bit, f"{rate} {src}->{dst}: {got} bit/s, faster than the shaper"
            assert max(got) >= 0.75 * lab.rate_bit, f"{rate} {src}->{dst}: {got} bit/s; expected {lab.rate_bit:g} +-25%"


_LAUNCHED = """
import os
import torch
import torch.distributed as dist
from rlightning_comm import launch

def main():
    t = torch.full((4,), float(int(os.environ["RANK"]) + 1))
    dist.all_reduce(t)
    os.write(1, f"host {os.environ['RLCNL_HOST']} {t.tolist()}\\n".encode())  # one write: the hosts share the pipe

if __name__ == "__main__":
    launch.run(main, timeout=30)
"""


@needs_lab
def test_run_starts_a_launch_run_script_once_per_host_as_one_world(tmp_path):
    """``python -m benchmarks.netlab run``: each host's process is a rank of one world (torchrun's variables), as
    :func:`rlightning_comm.launch.run` reads them."""
    script = tmp_path / "launched.py"
    script.write_text(_LAUNCHED)
    cli = [sys.executable, "-m", "benchmarks.netlab", "run", "--hosts", "2", "--rate", "1gbit", "--timeout", "60"]
    done = subprocess.run(
        [*cli, "--", sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("host")) == [
        "host 0 [3.0, 3.0, 3.0, 3.0]",
        "host 1 [3.0, 3.0, 3.0, 3.0]",
    ], done.stdout
    assert "calibration:" in done.stdout, done.stdout


# ---------------------------------------------------------------------- torch.distributed across hosts
def _all_reduce(conn, host: int, url: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=url, rank=host, world_size=3, timeout=timedelta(seconds=30))
    try:
        t = torch.arange(1000, dtype=torch.float64) * (host + 1) + host
        dist.all_reduce(t)
        peer = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        conn.send((t.tolist(), type(peer).__name__))  # plain values: a tensor would be shared through this process
    finally:
        dist.destroy_process_group()


@needs_lab
def test_a_gloo_all_reduce_across_three_hosts_equals_the_local_sum(tmp_path):
    with netlab.Lab(3, netlab.parse_rate("1gbit")) as lab, Hosts(lab, _all_reduce, f"file://{tmp_path}/store") as hosts:
        results = hosts.gather(60)
    expected = sum(torch.arange(1000, dtype=torch.float64) * (h + 1) + h for h in range(3))
    for got, _ in results:
        assert torch.equal(torch.tensor(got, dtype=torch.float64), expected)


_STATE = {"a": (1 << 20,), "b": (3, 1000)}


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {k: torch.randn(*shape, generator=g) for k, shape in _STATE.items()}


def _sha(state: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def _connected(conn, host: int, address: str) -> None:
    """Connect at host 0's lab address (this host's name resolves to 127.0.0.1), sync version 1, report the bytes."""
    from rlightning_comm import CommContext, broadcast_state_dict

    ctx = CommContext()
    try:
        ctx.connect("NETLAB", rank=host, world_size=3, address=address, timeout=30, liveness_timeout=5)
        state = _state(1) if host == 0 else {k: torch.zeros_like(v) for k, v in _state(1).items()}
        broadcast_state_dict(state, "NETLAB", src=0, version=1, atomic=True)
        conn.send((_sha(state), ctx.get_weight_version("NETLAB")))
        conn.recv()  # every host synced: leave together
    finally:
        ctx.destroy()


@needs_lab
def test_a_connected_mode_forms_across_hosts_whose_name_resolves_to_loopback_and_syncs_exactly():
    assert socket.gethostbyname(socket.gethostname()).startswith("127."), "this test wants a host name on loopback"
    with netlab.Lab(3, netlab.parse_rate("2500mbit")) as lab:
        address = f"{lab.addresses[0]}:29511"
        with Hosts(lab, _connected, address) as hosts:
            results = hosts.gather(90)
            for h in range(3):
                hosts.send(h, "leave")
    assert results == [(_sha(_state(1)), v) for v in (None, 1, 1)]
