"""The bench command: bus factors, size parsing, argument errors, a real spawned run, wrong results, subgroups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlightning_comm.bandwidth import bus_factor
from rlightning_comm.bench import cli, report
from rlightning_comm.bench.config import OPS, BenchConfig, parse_ops, parse_size, parse_sizes
from rlightning_comm.cli import main as top_main

ROOT = Path(__file__).resolve().parents[1]

# nccl-tests' factors, written out by hand for n = 1, 2, 3, 4, 8 (doc/PERFORMANCE.md and
# src/{gather,scatter,alltoall}.cu).
NCCL_TESTS = {
    "all_reduce": [0.0, 1.0, 4 / 3, 1.5, 1.75],
    "all_reduce_dict": [0.0, 1.0, 4 / 3, 1.5, 1.75],
    "all_gather": [0.0, 0.5, 2 / 3, 0.75, 0.875],
    "reduce_scatter": [0.0, 0.5, 2 / 3, 0.75, 0.875],
    "all_to_all": [0.0, 0.5, 2 / 3, 0.75, 0.875],
    "gather": [0.0, 0.5, 2 / 3, 0.75, 0.875],
    "scatter": [0.0, 0.5, 2 / 3, 0.75, 0.875],
    "broadcast": [1.0, 1.0, 1.0, 1.0, 1.0],
    "broadcast_object_list": [1.0, 1.0, 1.0, 1.0, 1.0],
    "barrier": [0.0, 0.0, 0.0, 0.0, 0.0],
}


@pytest.mark.parametrize("op", sorted(NCCL_TESTS))
def test_bus_factor_matches_nccl_tests(op):
    assert [bus_factor(op, n) for n in (1, 2, 3, 4, 8)] == pytest.approx(NCCL_TESTS[op])


def test_bus_factor_rejects_unknown_op_and_bad_group_size():
    with pytest.raises(KeyError, match="known ops"):
        bus_factor("allreduce", 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="group_size"):
            bus_factor("all_reduce", bad)


def test_parse_sizes():
    assert parse_size("64") == parse_size("64B") == 64
    assert parse_size("1k") == 1024 and parse_size("16M") == 16 * 2**20 and parse_size("1G") == 2**30
    assert parse_sizes("1K:64M", 2) == tuple(1024 * 2**i for i in range(17))
    assert parse_sizes("1K:64M", 4) == (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26)
    assert parse_sizes("10:100", 3) == (10, 30, 90)
    assert parse_sizes("4,1K, 2M") == (4, 1024, 2 * 2**20)
    assert parse_sizes("4M") == (4 * 2**20,)
    assert parse_sizes("8:8", 2) == (8,)
    for bad in ("0", "1X", "-4", "", "1.5K", "1K:"):
        with pytest.raises(ValueError, match="size"):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="goes down"):
        parse_sizes("4M:1K")
    with pytest.raises(ValueError, match="factor"):
        parse_sizes("1K:4K", 1)


def test_parse_ops():
    assert parse_ops("all") == OPS
    assert parse_ops("broadcast, all_reduce") == ("all_reduce", "broadcast")
    with pytest.raises(ValueError, match="all_reduce"):
        parse_ops("allreduce")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "reduce"], "unknown op"),
        (["--sizes", "4M:1K"], "goes down"),
        (["--dtype", "float8"], "unknown dtype"),
        (["--backend", "mpi"], "No communicator registered"),
        (["--nproc", "2", "--group-size", "3", "--mode", "DP"], "group-size 3"),
        (["--nproc", "2", "--group-size", "1"], "mode other than GLOBAL"),
        (["--nproc", "0"], "at least 1"),
        (["--iters", "0"], "iters"),
    ],
)
def test_bad_arguments_exit_2_before_any_rank_starts(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "spawn", lambda *a: pytest.fail("spawned ranks for bad arguments"))
    assert cli.main(argv) == cli.EXIT_ERROR
    assert message in capsys.readouterr().err


def test_missing_cuda_and_matplotlib_are_clear_errors(capsys, monkeypatch):
    monkeypatch.setattr(cli, "spawn", lambda *a: pytest.fail("spawned ranks for bad arguments"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["--backend", "nccl"]) == cli.EXIT_ERROR
    assert "needs CUDA" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert cli.main(["--plot", "out.png"]) == cli.EXIT_ERROR
    assert "pip install 'rlightning-comm[plot]'" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        report.write_plot("out.png", [], "t")


def test_console_command_dispatch(capsys):
    assert top_main(["--help"]) == 0 and "bench" in capsys.readouterr().out
    assert top_main([]) == 2
    assert top_main(["benhc"]) == 2 and "unknown command 'benhc'" in capsys.readouterr().err
    assert top_main(["bench", "--ops", "nope"]) == 2 and "unknown op" in capsys.readouterr().err


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "rlightning_comm.bench", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def _check_rows(rows, group_size):
    for r in rows:
        assert r["wrong"] == 0 and r["raw_wrong"] == 0, r
        assert r["group_size"] == group_size
        itemsize = 1 if r["op"] == "broadcast_object_list" else 4
        assert r["size"] == r["elements"] * itemsize
        assert r["time_us"] > 0 and r["raw_time_us"] > 0
        assert r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        assert r["algbw_gbps"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(
            r["algbw_gbps"] * NCCL_TESTS[r["op"]][[1, 2, 3, 4, 8].index(group_size)]
        )
        assert r["overhead_pct"] == pytest.approx((r["time_us"] / r["raw_time_us"] - 1) * 100)


def test_bench_smoke_every_op_json_and_table(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(
        ["--nproc", "2", "--sizes", "8:512", "--factor", "8", "--iters", "2", "--warmup", "1", "--json", str(out)],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in OPS if op != "barrier" for s in (8, 64, 512)] + [
        ("barrier", 0)
    ]
    _check_rows(rows, group_size=2)
    assert doc["wrong"] == 0 and doc["meta"]["world_size"] == 2 and doc["meta"]["backend"] == "gloo"
    # One printed line per row, as nccl-tests prints them, and the verdict.
    lines = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert [(int(f[0]), f[2]) for f in lines] == [(r["size"], r["dtype"]) for r in rows]
    assert "# wrong results: 0 OK" in proc.stdout


def test_launcher_env_runs_this_process_as_one_rank(monkeypatch, capsys):
    from rlightning_comm.bench import runner

    calls = []
    monkeypatch.setattr(runner, "run_rank", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(cli, "spawn", lambda *a: pytest.fail("spawned ranks under a launcher"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["--nproc", "5", "--sizes", "64"]) == 0
    assert [(rank, world, url) for rank, world, url, _ in calls] == [(0, 3, "env://")]
    assert "--nproc 5 ignored" in capsys.readouterr().out


def _wrong_task(rank, size, url, path):
    from rlightning_comm.bench.cli import _guarded
    from rlightning_comm.bench.runner import run_rank

    cfg = BenchConfig(
        sizes=(64,), ops=("all_reduce", "gather"), iters=2, warmup=1, json_path=path, inject_wrong="gather"
    )
    return _guarded(run_rank, rank, size, url, cfg)  # what a rank process exits with


def test_wrong_results_give_exit_status_1(world2, tmp_path):
    path = str(tmp_path / "wrong.json")
    assert world2.run(_wrong_task, path) == [cli.EXIT_WRONG, cli.EXIT_WRONG]  # every rank knows the world's count
    doc = json.loads(Path(path).read_text())
    rows = {r["op"]: r for r in doc["rows"]}
    assert rows["gather"]["wrong"] == 3  # one damaged element per library call on the root: warmup 1 + iters 2
    assert rows["gather"]["raw_wrong"] == 0 and rows["all_reduce"]["wrong"] == 0 and doc["wrong"] == 3


def test_exit_status_of_the_spawned_ranks():
    assert cli.exit_status([0, 0]) == 0
    assert cli.exit_status([0, 1]) == cli.exit_status([1, 1]) == 1
    assert cli.exit_status([1, 2]) == cli.exit_status([0, -9]) == cli.exit_status([0, None]) == cli.exit_status([]) == 2


def _dtype_task(rank, size, url, dtype):
    from rlightning_comm.bench.runner import run_rank

    return run_rank(rank, size, url, BenchConfig(sizes=(64,), ops=OPS, dtype=dtype, iters=1, warmup=1))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_every_op_is_checked_right_in_other_dtypes(world2, dtype):
    assert world2.run(_dtype_task, dtype) == [0, 0]


def _subgroup_task(rank, size, url, path):
    from rlightning_comm.bench.runner import run_rank

    cfg = BenchConfig(sizes=(64,), ops=OPS, mode="PAIRS", group_size=1, iters=1, warmup=0, json_path=path)
    return run_rank(rank, size, url, cfg)


def test_bench_on_groups_uses_the_group_size_for_busbw(world2, tmp_path):
    path = str(tmp_path / "groups.json")
    assert world2.run(_subgroup_task, path) == [0, 0]
    rows = json.loads(Path(path).read_text())["rows"]
    assert [r["op"] for r in rows] == list(OPS)
    _check_rows(rows, group_size=1)  # groups of 1 in a world of 2: all_reduce's busbw is 0, broadcast's is its algbw


def test_plot_draws_busbw_per_op(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    rows = [
        {"op": op, "size": s, "busbw_gbps": s / 1e6, "raw_busbw_gbps": s / 2e6}
        for op in ("all_reduce", "broadcast")
        for s in (64, 1024, 16384)
    ]
    path = tmp_path / "bench.png"
    report.write_plot(str(path), rows, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _no_numpy_task(rank, size, url, path):
    from rlightning_comm.bench import runner

    # As on a fresh install: torch's own object collectives cannot receive without numpy.
    real = runner.torch_objects_available
    runner.torch_objects_available = lambda: False
    try:
        return runner.run_rank(
            rank,
            size,
            url,
            BenchConfig(sizes=(64,), ops=("all_reduce", "broadcast_object_list"), iters=1, warmup=0, json_path=path),
        )
    finally:
        runner.torch_objects_available = real  # the world's processes are reused


def test_without_numpy_broadcast_object_list_is_skipped_with_a_reason(world2, tmp_path):
    path = str(tmp_path / "bench.json")
    assert world2.run(_no_numpy_task, path) == [0, 0]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["all_reduce"]


def _repeat_task(rank, size, url, path):
    from rlightning_comm.bench.runner import run_rank

    return run_rank(
        rank,
        size,
        url,
        BenchConfig(sizes=(64,), ops=("all_reduce", "barrier"), iters=2, warmup=0, repeat=3, json_path=path),
    )


def test_repeat_reports_the_median_overhead_and_its_spread(world2, tmp_path, capsys):
    path = str(tmp_path / "repeat.json")
    assert world2.run(_repeat_task, path) == [0, 0]
    doc = json.loads(Path(path).read_text())
    assert doc["meta"]["repeat"] == 3
    for r in doc["rows"]:
        runs = r["overhead_runs_pct"]
        assert len(runs) == 3 and runs == sorted(runs) and r["overhead_pct"] == runs[1] and r["repeat"] == 3
        assert report.format_row(r).split()[-1] == f"{runs[0]:+.1f}..{runs[-1]:+.1f}"
    assert [r["op"] for r in doc["rows"]] == ["all_reduce", "barrier"]
