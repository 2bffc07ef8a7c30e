"""The examples run as their docstrings show, with and without a launcher, and print the right values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from example_commands import EXAMPLES, commands, documented, environment

ROOT = Path(__file__).resolve().parent.parent
# Spawner options of an example without a launcher: under torchrun the launcher decides the ranks.
SPAWNER_OPTIONS = ("--nproc", "--nprocs", "--simulated-nodes")


def _run(*cmd: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _check_quickstart(out: str, world: int) -> None:
    for rank in range(world):
        mine = [line for line in out.splitlines() if line.startswith(f"[rank {rank}]")]
        text = "\n".join(mine)
        assert re.search(rf"all_reduce\(SUM\) of rank\+1 +-> {world * (world + 1) // 2}$", text, re.MULTILINE), text
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert f"DATA_PARALLEL pair {pair} -> {pair[0] + pair[1] + 2}" in text, text
        assert f"all_gather of rank*10            -> {[10 * r for r in range(world)]}" in text, text
        assert f"broadcast from rank {world - 1}            -> {world - 1}" in text, text
        assert f"scatter from rank 0              -> {100 + rank}" in text, text
        assert "broadcast_object_list            -> {'config': 'from rank 0', 'lr': 0.0003}" in text, text
        assert f"tokens={128 * world}" in text, text
    assert f"gather of rank**2 on rank 0      -> {[float(r * r) for r in range(world)]}" in out


def test_quickstart_without_a_launcher():
    _check_quickstart(_run(*documented("quickstart.py")), 4)


def test_quickstart_under_torchrun():
    # The one torchrun command the suite runs: run() under a launcher is one code path for every example.
    _check_quickstart(_run(*documented("quickstart.py", True), timeout=180), 4)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_shows_a_command_a_test_runs_and_its_torchrun_form_agrees(example):
    shown = commands(example)
    plain = documented(example)  # exactly one command without a launcher
    assert shown and all(f"examples/{example}" == c.split()[1 + c.startswith("torchrun ") * 2] for c in shown), shown
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    assert f'documented("{example}"' in tests, f"no test runs the command examples/{example} shows: {plain}"
    if any(c.startswith("torchrun ") for c in shown):
        under = documented(example, True)
        assert under[4:6] == ["--nproc-per-node", under[5]] and under[6] == f"examples/{example}", under
        kept, args = [], iter(plain[2:])
        for arg in args:
            if arg in SPAWNER_OPTIONS:
                next(args)
            else:
                kept.append(arg)
        assert under[7:] == kept, (
            f"examples/{example}: the torchrun command takes {under[7:]}, the one without a launcher {kept}"
        )


def test_custom_backend_example_records_every_call():
    out = _run(*documented("custom_backend.py"))
    for rank in range(2):
        # 3 all_reduces + 1 from all_reduce_dict; 3 x 256 float32 + 2 float64 (a dict of numbers is reduced in float64)
        # = 3088 bytes.
        assert (
            f"[rank {rank}] RecordingCommunicator calls={{'all_reduce': 4, 'broadcast': 1}} "
            f"bytes={{'all_reduce': 3088, 'broadcast': 64}}" in out
        ), out


NO_NUMPY_SCRIPT = """
from rlightning_comm import CommContext, broadcast_state_dict, collective, run


def main():
    import torch

    try:
        import numpy  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("numpy is importable in this rank: the test would prove nothing")
    rank = CommContext().get_global_rank()
    objs = [{"rank": rank, "t": torch.arange(3)}, "x" * 1000] if rank == 1 else [None, None]
    collective.broadcast_object_list(objs, "GLOBAL", src=1)
    assert objs[0]["rank"] == 1 and objs[0]["t"].tolist() == [0, 1, 2] and objs[1] == "x" * 1000, objs
    # The library's own object exchanges: node placements and the weight-transfer verdicts.
    ctx = CommContext()
    ctx.init_node_groups(node_rank=rank, local_rank=0, local_world_size=1)
    assert ctx.get_ranks_in_group("INTER_NODE") == [0, 1] and ctx.get_ranks_in_group("INTRA_NODE") == [rank]
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    weights = {"w": torch.full((4,), float(rank)), "n": torch.tensor([rank])}
    broadcast_state_dict(weights)
    assert weights["w"].tolist() == [0.0] * 4 and weights["n"].tolist() == [0], weights
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    run(main, 2)
"""


def _without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment whose processes, and their children and fork servers, cannot import numpy (as with
    ``--no-deps``)."""
    fake = tmp_path / "no_numpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('numpy is hidden by the test', name='numpy')\n")
    return {**environment(), "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}


def test_object_collectives_work_without_numpy(tmp_path):
    # torch.distributed's object collectives need numpy to receive; the library's must not.
    script = tmp_path / "no_numpy.py"
    script.write_text(NO_NUMPY_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=ROOT,
        env=_without_numpy(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, proc.stdout


def test_parallel_layout_example_runs_without_numpy(tmp_path):
    proc = subprocess.run(
        documented("parallel_layout.py"),
        check=False,
        cwd=ROOT,
        env=_without_numpy(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed to initialize NumPy" in proc.stderr  # numpy really was missing
    assert "checks: all passed" in proc.stdout and "bit-identical" in proc.stdout, proc.stdout
