"""A real multi-node launch: two torchrun "nodes" on this machine run examples/parallel_layout.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from layout_oracle import expected_groups
from world import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "parallel_layout.py"
BOUND = 150.0  # seconds for the whole job, launch included


def _stop(proc: subprocess.Popen) -> None:
    """End torchrun and its workers: they share the process group it leads."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _launch(args: list[str], tmp_path: Path, nodes: int = 2, per_node: int = 2) -> tuple[list[int | None], list[str]]:
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    procs, logs = [], []
    try:
        for node in range(nodes):
            log = tmp_path / f"node{node}.log"
            logs.append(log)
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
            ]
            cmd += [
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "--local-addr",
                "127.0.0.1",
            ]
            cmd += ["--max-restarts", "0", str(EXAMPLE), *args]
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
                    )
                )
        deadline = time.monotonic() + BOUND
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs:
            _stop(proc)
    return [p.returncode if p.returncode is not None else None for p in procs], [log.read_text() for log in logs]


def test_two_torchrun_nodes_build_and_check_the_full_layout(tmp_path: Path) -> None:
    started = time.monotonic()
    codes, outputs = _launch(["--tp", "2", "--timeout", "60"], tmp_path)
    if codes != [0, 0] and any("address already in use" in out.lower() for out in outputs):
        codes, outputs = _launch(["--tp", "2", "--timeout", "60"], tmp_path)  # another process took the free port first
    report = "\n".join(f"--- node {i} (exit {c}):\n{o[-4000:]}" for i, (c, o) in enumerate(zip(codes, outputs)))
    assert time.monotonic() - started < BOUND + 30, report
    assert codes == [0, 0], report
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("LAYOUT_JSON ")]
    assert len(lines) == 1, report
    layout = json.loads(lines[0].removeprefix("LAYOUT_JSON "))
    expected = {m: g for m, g in expected_groups(4, 2, 1, 2, "tp-sp-dp").items()}
    # torchrun numbers ranks node by node: ranks 0, 1 on one node, 2, 3 on the other.
    expected.update(
        GLOBAL=[[0, 1, 2, 3]], INTRA_NODE=[[0, 1], [2, 3]], INTER_NODE=[[0, 2], [1, 3]], WEIGHT_TRANSFER=[[0, 1, 2, 3]]
    )
    assert layout == {"world_size": 4, "groups": expected, "failures": 0}, report
    assert "bit-identical" in "".join(outputs), report
