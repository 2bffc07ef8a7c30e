"""examples/ray_rl_loop.py on a local Ray instance (skipped without the ``ray`` extra), and the library's independence from Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOUND = 240  # seconds: the run takes ~25 s on 2 busy cores


def _session(sid: int) -> list[int]:
    """Every live process of session ``sid``: the driver (started in a session of its own) and Ray's GCS, raylet and workers,
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
        "    importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_ray_rl_loop_syncs_every_rollout_bit_for_bit() -> None:
    pytest.importorskip("ray", reason="the Ray example needs the ray extra: pip install '.[ray]'")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "ray_rl_loop.py"), "--steps", "3"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        _kill(_session(proc.pid))
        out, _ = proc.communicate()
        pytest.fail(f"the Ray example did not finish within {BOUND} s; its processes were killed. Output:\n{out}")
    finally:
        if proc.returncode != 0:
            _kill(_session(proc.pid))  # a failed driver may leave Ray's processes behind
    assert proc.returncode == 0, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("weight sync" in line and "MiB per trainer" in line for line in steps), out
    assert "rank 3 receives in thread 'weight-updater'" in out
    assert "every rollout holds its trainer's weights, bit for bit" in out
