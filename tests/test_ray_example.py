"""examples/ray_rl_loop.py on a local Ray instance (skipped without the ``ray`` extra), and the library's independence
from Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from example_commands import documented, environment

ROOT = Path(__file__).resolve().parents[1]
BOUND = 240  # seconds: the run takes ~25 s on 2 busy cores


def _session(sid: int) -> list[int]:
    """Every live process of session ``sid``: the driver (started in a session of its own) and Ray's GCS, raylet and
    workers,
    which stay in it even when the driver has exited and they were re-parented."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # the field after pid, comm, state, ppid, pgrp: the session id
                found.append(int(entry.name))
    return found


def _is_loopback(hex_ip: str) -> bool:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host order, little-endian here)."""
    if len(hex_ip) == 8:
        return hex_ip[6:] == "7F"  # 127.x.y.z
    return hex_ip == "00000000000000000000000001000000" or (
        hex_ip.startswith("0000000000000000FFFF0000") and hex_ip[30:] == "7F"
    )  # ::1, ::ffff:127.x


def _wide_listeners(pids: list[int]) -> set[str]:
    """The listening TCP sockets of ``pids`` bound beyond loopback, as ``pid hexaddr:port``."""
    wide = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and not _is_loopback(fields[1].split(":")[0]):  # 0A: LISTEN
                wide[f"socket:[{fields[9]}]"] = fields[1]
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone meanwhile
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if link in wide:
                found.add(f"{pid} {wide[link]}")
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_library_never_imports_ray() -> None:
    code = (
        "import importlib, pkgutil, sys, rlightning_comm\n"
        "for m in pkgutil.walk_packages(rlightning_comm.__path__, 'rlightning_comm.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as err:  # the vLLM backend's modules, where vLLM is absent\n"
        "        if err.name.split('.')[0] != 'vllm':\n"
        "            raise\n"
        "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def run_example(command: list[str], bound: float = BOUND) -> str:
    """Run an example's ``command`` (:func:`documented`) in a session of its own, bounded; its output once it exited 0
    and listened on loopback only.

    Fails the test when it runs past ``bound`` (its processes are killed by id), exits otherwise than 0 (idem, as a
    failed driver may leave Ray's processes behind), or any of its processes listened beyond loopback.
    """
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wide: set[str] = set()
    deadline = time.monotonic() + bound
    try:
        while proc.poll() is None and time.monotonic() < deadline:  # Ray must listen on loopback only, all the while
            wide |= _wide_listeners(_session(proc.pid))
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(_session(proc.pid))
        out, _ = proc.communicate()
        pytest.fail(f"{command[1:]} did not finish within {bound} s; its processes were killed. Output:\n{out}")
    finally:
        if proc.returncode != 0:
            _kill(_session(proc.pid))
    assert proc.returncode == 0, out
    assert not wide, f"processes of {command[1:]} listened beyond loopback: {sorted(wide)}"
    return out


def test_ray_rl_loop_syncs_every_rollout_bit_for_bit() -> None:
    pytest.importorskip("ray", reason="the Ray example needs the ray extra: pip install '.[ray]'")
    out = run_example(documented("ray_rl_loop.py", False, "--steps", "3"))
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("weight sync" in line and "MiB per trainer" in line for line in steps), out
    assert "rank 3 receives in thread 'weight-updater'" in out
    assert "every rollout holds its trainer's weights, bit for bit" in out
