"""benchmarks/gpu_check on a CPU machine: its CPU mode end to end, and its machinery (oracles, roots, lockstep,
probes, kills).

The check's own cells run here on gloo through the library's real ops; a test-only communicator with a wrong
``all_reduce`` must be reported wrong while the same check passes the real one.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from world import init_world

from rlightning_comm.bench.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "benchmarks" / "gpu_check"


def _module(name: str):
    """``benchmarks.gpu_check.<name>`` of this checkout (the package's own modules import each other relatively)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"benchmarks.gpu_check.{name}")
    assert Path(module.__file__).resolve() == PACKAGE / f"{name}.py", module.__file__  # not another checkout's
    return module


def test_cpu_mode_runs_end_to_end_skips_every_cuda_step_and_reports_a_wrong_op(tmp_path, capsys):
    gpu_check = _module("_cli")
    status = gpu_check.main(
        [
            "--cpu-only",
            "--out",
            str(tmp_path),
            "--budget-s",
            "300",
            "--quick",
            "--inject-wrong",
            "--steps",
            "nccl_world1,cuda_tests,bench",
        ]
    )
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 1 and doc["cuda"] is False
    steps = doc["steps"]
    assert list(steps) == list(gpu_check.STEPS) and all(s["needs"] and "seconds" in s for s in steps.values())
    assert {n: (s["status"], s.get("reason")) for n, s in steps.items() if n != "nccl_world1"} == {
        "cuda_tests": ("SKIP", "no CUDA"),
        "nccl_ranks": ("SKIP", "not selected (--steps)"),
        "cuda_branches": ("SKIP", "not selected (--steps)"),
        "bench": ("SKIP", "no CUDA"),
    }
    step1 = steps["nccl_world1"]
    assert step1["status"] == "FAIL" and "no CUDA" in step1["note"] and step1["runs"]["bounded"]["status"] == "skipped"
    run = step1["runs"]["world1"]
    assert run["status"] == "ok" and run["ranks"][0]["exit"] == 0
    cells = {c["cell"]: c for c in run["cells"]}
    assert all({"cell", "rank", "status", "detail"} <= set(c) for c in cells.values())
    reduced = [c for name, c in cells.items() if name.startswith("all_reduce|")]
    assert len(reduced) == 8 and all(
        c["status"] == "wrong" and "got" in c["detail"] for c in reduced
    )  # 2 dtypes x sync/async x plain/debug
    untouched = [c for name, c in cells.items() if name.startswith(("broadcast|", "all_gather_object|"))]
    assert len(untouched) == 8 + 4 and all(c["status"] == "ok" for c in untouched)
    assert cells["init_distributed_env"]["backend"] == "gpu_check_wrong_gloo" and cells["destroy"]["status"] == "ok"
    assert all(
        cells[f"pg.{name}(asyncOp=False)"]["detail"] == "returns Work" for name in ("allreduce", "broadcast", "barrier")
    )
    out = capsys.readouterr().out
    assert "nccl_world1    FAIL" in out and "all_reduce|float32|sync|plain: wrong" in out


def test_the_command_runs_by_path_from_another_folder_with_nothing_on_pythonpath(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as on a bare GPU machine
    argv = ["--cpu-only", "--quick", "--steps", "nccl_world1", "--out", "out"]
    done = subprocess.run(
        [sys.executable, str(PACKAGE), *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert doc["root"] == str(ROOT) and doc["command"][1:] == [str(PACKAGE), *argv]
    run = doc["steps"]["nccl_world1"]["runs"]["world1"]
    assert run["status"] == "ok" and run["cells"] and all(c["status"] not in ("wrong", "error") for c in run["cells"])


def _cells_on_two_ranks(rank, size, url):
    import torch.distributed as dist

    matrix, probes, comms, cells = (
        _module("_matrix"),
        _module("_probes"),
        _module("_comms"),
        _module("_cells"),
    )
    ctx = init_world(rank, size, url, timeout=30)
    store = dist.FileStore(os.path.join(url.removeprefix("file://").rsplit("/", 1)[0], "lockstep"), size)
    rec = cells.Recorder(rank=rank, lockstep=cells.Lockstep(store, rank, size, 30))
    ops = [
        "all_reduce",
        "all_to_all_single[uneven]",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "broadcast_state_dict",
    ]
    ops += [
        "broadcast_state_dict[load]",
        "broadcast_object_list",
        "sp.all_to_all",
        "sp.reduce_scatter_to_sequence_parallel_region",
    ]  # no async_op
    device = torch.device("cpu")
    matrix.run_matrix(rec, "GLOBAL", device, 1, ops=ops, dtypes=["float32", "complex64"], modes=["plain"])
    ctx.init_group([0, 1], "WRONG", backend=comms.WRONG_GLOO)
    matrix.run_matrix(
        rec,
        "WRONG",
        device,
        1,
        ops=["all_reduce", "broadcast"],
        dtypes=["int64"],
        modes=["plain", "stats"],
        prefix="WRONG:",
    )
    ctx.init_group([0, 1], "CUDA_GLOO", backend=comms.CUDA_GLOO)  # the step-4 communicator, staging on the CPU here
    matrix.run_matrix(
        rec,
        "CUDA_GLOO",
        device,
        1,
        ops=["all_reduce_dict", "broadcast_state_dict"],
        dtypes=["bfloat16"],
        modes=["stats"],
        prefix="CUDA_GLOO:",
    )
    probes.refusal_travels(
        rec, "CUDA_GLOO", device
    )  # NCCL's dtype table: rank 1's uint16 is a refusal every rank learns
    probes.refusal_travels(rec, "GLOBAL", device)  # gloo moves uint16: a mismatch every rank learns
    return rec.cells


def test_the_matrix_passes_the_librarys_ops_with_a_non_zero_root_and_reports_a_wrong_one(world2):
    for cells in world2.run(_cells_on_two_ranks, timeout=120):
        by_status = {}
        for c in cells:
            by_status.setdefault(c["status"], []).append(c["cell"])
        wrong = sorted(by_status.pop("wrong", []))
        assert wrong == sorted(
            f"WRONG:all_reduce|int64|{call}|{mode}" for call in ("sync", "async") for mode in ("plain", "stats")
        ), wrong
        assert set(by_status) == {"ok"}, {k: v[:5] for k, v in by_status.items()}
        # Binding SEQUENCE_PARALLEL; GLOBAL: 10 ops x 2 dtypes x sync/async, 3 ops x 2 dtypes; WRONG:broadcast;
        # CUDA_GLOO: 3; the refusals
        assert len(by_status["ok"]) == 1 + 10 * 4 + 3 * 2 + 4 + 3 + 2


def _skipped_call(rank, size, url):
    probes, cells = _module("_probes"), _module("_cells")
    init_world(rank, size, url, timeout=30)
    rec = cells.Recorder(rank=rank)
    probes.skip_call(rec, torch.device("cpu"), url.removeprefix("file://").rsplit("/", 1)[0], timeout=1.0, hold_s=20)
    return rec.cells


def test_a_call_one_rank_skips_is_measured_against_the_failure_table(world2):
    caller, skipper = world2.run(_skipped_call, timeout=60)
    verdicts = {c["cell"]: c for c in caller}
    assert verdicts["against the failure guide's table"]["status"] == "ok", verdicts
    assert verdicts["blocking all_reduce a peer skips"]["detail"].startswith("CommTimeoutError after")
    assert [c["cell"] for c in skipper] == ["init_group([0, 1], timeout=1)", "warm-up all_reduce"]


def test_cells_are_classified_by_who_refused(tmp_path):
    cells = _module("_cells")
    from rlightning_comm import CommContext

    rec = cells.Recorder(str(tmp_path / "cells.jsonl"))
    rec.run("library refusal", lambda: CommContext().set_debug("yes"))
    rec.run("script bug", lambda: int("x"))
    rec.run(
        "backend", lambda: (_ for _ in ()).throw(RuntimeError("x was refused by the backend's own check on this rank"))
    )
    rec.run("not here", lambda: (_ for _ in ()).throw(cells.NotApplicable("needs 2 ranks")))
    rec.deadline = time.time()
    rec.run("late", lambda: None)
    assert [(c["cell"], c["status"]) for c in rec.cells] == [
        ("library refusal", "refused"),
        ("script bug", "error"),
        ("backend", "backend_refused"),
        ("not here", "n/a"),
        ("late", "skipped"),
    ]
    launch = _module("_launch")
    with open(tmp_path / "cells.jsonl", "a") as f:
        f.write(
            json.dumps({"event": "start", "cell": "hangs here", "rank": 0}) + "\n" + '{"event": "cell", "cell": "cut sh'
        )  # a rank killed mid-cell
    done, _, unfinished = launch.read_cells(tmp_path / "cells.jsonl")
    assert [c["cell"] for c in done] == [c["cell"] for c in rec.cells] and unfinished == "hangs here"


def test_lockstep_stops_a_run_only_when_a_collective_may_be_half_done():
    import torch.distributed as dist

    cells = _module("_cells")
    store = dist.HashStore()
    steps = [cells.Lockstep(store, rank, 2, timeout=5) for rank in range(2)]
    outcomes = {}

    def agree(rank, raised):
        try:
            steps[rank].agree("cell", raised)
            outcomes[rank] = "in step"
        except cells.OutOfStep as err:
            outcomes[rank] = str(err)

    for pair in (("AttributeError", ""), ("!CommTimeoutError", "")):
        threads = [threading.Thread(target=agree, args=(rank, raised)) for rank, raised in enumerate(pair)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        if pair[0] == "AttributeError":
            assert outcomes == {0: "in step", 1: "in step"}  # a receiver's unpickling: nothing half-done
        else:
            assert all("out of step" in v for v in outcomes.values()), outcomes
    lonely = cells.Lockstep(dist.HashStore(), 0, 2, timeout=0.2)
    with pytest.raises(cells.OutOfStep, match="did not report"):
        lonely.agree("alone", "")


def test_a_hung_command_is_killed_with_its_children(tmp_path):
    launch = _module("_launch")
    child = tmp_path / "child.pid"
    result = launch.run_command("hang", ["bash", "-c", f"sleep 60 & echo $! > {child}; wait"], tmp_path, timeout=1)
    assert result["killed_at_deadline"] and result["seconds"] < 15
    pid = int(child.read_text())
    for _ in range(40):  # the orphaned child is reaped by init soon after the kill
        if not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command's child {pid} outlived the kill")


def test_the_cuda_tests_step_selects_what_skips_without_cuda():
    plugin = _module("_pytest_plugin")
    skip = pytest.mark.skipif
    assert plugin.needs_cuda([], "tests/test_nccl.py")
    assert plugin.needs_cuda(
        [skip(False, reason="CUDA tensors need a GPU; this machine has none").mark], "tests/test_x.py"
    )
    assert not plugin.needs_cuda(
        [skip(True, reason="needs CUDA").mark], "tests/test_x.py"
    )  # skipped on this machine too
    assert not plugin.needs_cuda([skip(False, reason="checks the CPU-only error").mark], "tests/test_x.py")
    assert not plugin.needs_cuda([], "tests/test_collective.py")


def test_bench_commands_are_valid_bench_arguments(tmp_path):
    commands = _module("_cli").bench_commands(tmp_path, "3")
    nccl = build_parser().parse_args(commands["nccl"][0])
    assert (nccl.backend, nccl.nproc) == ("nccl", 1)
    gloo = build_parser().parse_args(commands["gloo_cuda"][0])
    assert (gloo.backend, gloo.device, gloo.nproc) == ("gloo", "cuda", 4)
    assert commands["gloo_cuda"][1]["CUDA_VISIBLE_DEVICES"] == "3"  # all 4 ranks on one GPU
