"""The GPU check's steps: what each one launches, with what time, and how its runs make its verdict (see the
package's docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ._launch import Launch, run_command
from ._matrix import OPS

STEPS = ("nccl_world1", "cuda_tests", "nccl_ranks", "cuda_branches", "bench")
NEEDS = {
    "nccl_world1": "CUDA torch with NCCL, one GPU",
    "cuda_tests": "CUDA torch, pytest (pytest-xdist optional)",
    "nccl_ranks": "CUDA torch with NCCL, one GPU; NCCL sockets on loopback",
    "cuda_branches": "CUDA torch, one GPU (gloo moves CUDA tensors)",
    "bench": "CUDA torch with NCCL, one GPU",
}
BOUNDED_OPS = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all_single",
    "gather",
    "scatter",
    "reduce",
]
BOUNDED_OPS += [
    "barrier",
    "all_reduce_dict",
    "broadcast_object_list",
    "broadcast_state_dict",
    "broadcast_state_dict[load]",
]
QUICK = {
    "ops": ["all_reduce", "broadcast", "all_gather_object"],
    "dtypes": ["float32", "int64"],
    "modes": ["plain", "debug"],
}
"""Step 1's matrix under ``--quick`` (the check's own test)."""
_REPORT_RESERVE_S = 5.0


class Plan:
    """What this run can use: CUDA or not, the GPU, the deadline, the output folder."""

    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.cuda = cuda
        self.end = time.time() + args.budget_s - _REPORT_RESERVE_S
        self.gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        self.backend = "nccl" if cuda else "gloo"
        self.device = "cuda" if cuda else "cpu"
        self.probe_s = 15.0 if cuda else 2.0  # the timeout of the call a rank skips

    def grant(self, want_s: float, min_s: float) -> float | None:
        """Seconds for a part that wants ``want_s`` and needs ``min_s``; ``None`` when fewer than ``min_s`` are left."""
        left = self.end - time.time()
        return None if left < min_s else min(want_s, left)

    def env(self, size: int, nccl_ranks: bool = False) -> Any:
        """Each rank's environment: its GPU (all on one), ``LOCAL_RANK``, loopback sockets; for NCCL ranks on one GPU a
        host id each."""
        from rlightning_comm.rendezvous import loopback_interface

        lo = loopback_interface() or "lo"

        def env(rank: int) -> dict[str, str]:
            e = {
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(size),
                "GLOO_SOCKET_IFNAME": lo,
                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
            }
            if self.cuda:
                e["CUDA_VISIBLE_DEVICES"] = self.gpu
            if nccl_ranks and self.cuda:
                e.update(
                    NCCL_HOSTID=f"rlc-gpu-check-host-{rank}",
                    NCCL_P2P_DISABLE="1",
                    NCCL_SHM_DISABLE="1",
                    NCCL_IB_DISABLE="1",
                    NCCL_SOCKET_IFNAME=lo,
                )
            return e

        return env

    def launch(
        self, name: str, run: str, size: int, want_s: float, min_s: float, dies: tuple[int, ...] = (), **spec: Any
    ) -> Launch | dict[str, Any]:
        """A started run of the rank program, or the SKIP record of one that no longer fits."""
        granted = self.grant(want_s, min_s)
        if granted is None:
            return {"run": name, "status": "skipped", "reason": "no time left"}
        spec = {
            "run": run,
            "backend": self.backend,
            "device": self.device,
            "timeout": 60,
            "inject_wrong": self.args.inject_wrong,
            **spec,
        }
        env = self.env(size, nccl_ranks=size > 1 and spec["backend"] == "nccl")
        return Launch(name, spec, size, self.out, granted, env, dies=dies).start()


def _finish(launch: Launch | dict[str, Any]) -> dict[str, Any]:
    return launch if isinstance(launch, dict) else launch.wait()


def _verdict(runs: dict[str, dict[str, Any]], note: str = "") -> dict[str, Any]:
    bad = [n for n, r in runs.items() if r["status"] not in ("ok", "skipped") or r.get("failing")]
    status = "FAIL" if bad else ("SKIP" if all(r["status"] == "skipped" for r in runs.values()) else "PASS")
    out: dict[str, Any] = {"status": status, "runs": runs}
    if bad:
        out["failed_runs"] = bad
    if note:
        out["note"] = note
    return out


def _self_test_note(plan: Plan) -> str:
    return (
        ""
        if plan.cuda
        else "no CUDA: the NCCL and CUDA cells did not run; "
        "this ran the step's machinery on gloo with CPU tensors as a self-test"
    )


def step_nccl_world1(plan: Plan) -> dict[str, Any]:
    if plan.args.quick:
        runs = {
            "world1": _finish(plan.launch("world1", "world1", 1, 180, 20, matrix=QUICK)),
            "bounded": {"run": "bounded", "status": "skipped", "reason": "--quick"},
        }
        return _verdict(runs, _self_test_note(plan))
    runs = {"world1": _finish(plan.launch("world1", "world1", 1, 90, 20))}
    matrix = {"ops": BOUNDED_OPS, "dtypes": ["float32", "bfloat16"], "modes": ["plain", "stats"]}
    runs["bounded"] = _finish(plan.launch("bounded", "bounded", 1, 45, 15, bounded=True, matrix=matrix))
    return _verdict(runs, _self_test_note(plan))


def _junit(path: Path) -> dict[str, dict[str, str]]:
    """Per-test outcome from pytest's JUnit XML (absent when pytest was killed)."""
    tests: dict[str, dict[str, str]] = {}
    if not path.exists():
        return tests
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), (child.get("message") or "")[:500]
        tests[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "message": message}
    return tests


def step_cuda_tests(plan: Plan) -> dict[str, Any]:
    if not plan.cuda:
        return {"status": "SKIP", "reason": "no CUDA"}
    if importlib.util.find_spec("pytest") is None:
        return {"status": "SKIP", "reason": "pytest is not installed"}
    granted = plan.grant(200, 40)
    if granted is None:
        return {"status": "SKIP", "reason": "no time left"}
    out = plan.out / "cuda_tests"
    out.mkdir(parents=True, exist_ok=True)
    xml, selected = out / "junit.xml", out / "selected.txt"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-p",
        f"{__package__}._pytest_plugin",
        "-p",
        "no:cacheprovider",
        "-v",
        "-rA",
        f"--junitxml={xml}",
    ]
    if importlib.util.find_spec("xdist") is not None:
        argv += ["-n", "3"]  # a worker that NCCL's watchdog ends is replaced; the other tests still run
    result = run_command(
        "pytest", argv, out, granted, {"GPU_CHECK_SELECTED": str(selected), "CUDA_VISIBLE_DEVICES": plan.gpu}
    )
    tests = _junit(xml)
    ids = selected.read_text().split() if selected.exists() else []
    outcomes = [t["outcome"] for t in tests.values()]
    status = "PASS" if result["exit"] == 0 and not result["killed_at_deadline"] else "FAIL"
    summary = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    return {"status": status, "selected": ids, "summary": summary, "tests": tests, **result}


def _death(run: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Default-mode probe: how rank 0's process ended, seconds after its call, against the failure guide (the
    watchdog ends it)."""
    calls = [n["t0"] for n in run.get("notes", []) if n.get("rank") == 0 and n.get("probe") == "call"]
    rank0 = next((r for r in run.get("ranks", []) if r["rank"] == 0), None)
    if not calls or rank0 is None:
        return {"cell": "process ended", "rank": 0, "status": "error", "detail": "the probe's call was not reached"}
    after = rank0["ended_at"] - calls[0]
    how = f"exit {rank0['exit']} ({rank0['signal'] or 'no signal'})" + (
        ", killed by the check at its deadline" if rank0["killed_at_deadline"] else ""
    )
    ended = rank0["exit"] != 0 and not rank0["killed_at_deadline"]
    status = "ok" if ended and after >= 0.8 * timeout else "differs"
    return {
        "cell": "process ended",
        "rank": 0,
        "status": status,
        "detail": f"{how}, {after:.1f} s after the call (timeout {timeout:g} s)",
        "seconds": round(after, 2),
    }


def step_nccl_ranks(plan: Plan) -> dict[str, Any]:
    runs = {"smoke": _finish(plan.launch("smoke", "smoke", 2, 45, 20, timeout=20))}
    smoke = runs["smoke"]
    if smoke["status"] != "ok" or any(c["status"] != "ok" for c in smoke.get("cells", [])):
        why = smoke.get("reason") or "; ".join(smoke.get("failing", [])) or f"run {smoke['status']}"
        out = _verdict(runs, _self_test_note(plan))
        out.update(
            status="SKIP" if smoke["status"] == "skipped" else "FAIL",
            reason=f"the 2-rank smoke test did not pass ({why}); the rest of the step was not run",
        )
        return out
    # The probes mostly wait out their timeouts: they run while the pairs and the connected mode do.
    probe = {"probe_timeout": plan.probe_s, "hold_s": plan.probe_s + 75 if plan.cuda else plan.probe_s + 8}
    want = plan.probe_s + (80 if plan.cuda else 40)
    started = {
        "skip_bounded": plan.launch("skip_bounded", "skip_call", 2, want, plan.probe_s + 10, bounded=True, **probe)
    }
    if plan.cuda:  # gloo has no default/bounded difference: one probe is enough there
        started["skip_default"] = plan.launch("skip_default", "skip_call", 2, want, plan.probe_s + 10, **probe)
    runs["pairs"] = _finish(plan.launch("pairs", "pairs", 2, 150, 30, timeout=30))
    runs["connect"] = _finish(
        plan.launch("connect", "connect", 2, 60, 25, dies=(1,), timeout=30)
    )  # rank 1 is killed to see what rank 0 gets
    for name, launch in started.items():
        runs[name] = _finish(launch)
    if "skip_default" in runs and runs["skip_default"]["status"] != "skipped":
        death = _death(runs["skip_default"], plan.probe_s)
        runs["skip_default"]["cells"].append(death)
        runs["skip_default"]["status"] = "ok"  # rank 0's death is the expected outcome; the cell judges it
        if death["status"] != "ok":
            runs["skip_default"].setdefault("failing", []).append(
                f"rank 0: {death['cell']}: {death['status']}: {death['detail']}"
            )
    return _verdict(runs, _self_test_note(plan))


def step_cuda_branches(plan: Plan) -> dict[str, Any]:
    everything_but_p2p = [op for op in OPS if op not in ("send", "recv")]
    branches = plan.launch(
        "branches", "branches", 4, 120, 30, backend="gloo", timeout=30, matrix={"ops": everything_but_p2p}
    )
    # gloo's send and recv hand the tensor's address to its TCP transport, which reads host memory: a CUDA tensor may
    # crash the process, so they run apart, where a crash ends only this run.
    p2p = plan.launch(
        "gloo_p2p",
        "matrix",
        2,
        60,
        20,
        backend="gloo",
        timeout=20,
        matrix={"ops": ["send", "recv"], "dtypes": ["float32"], "modes": ["plain"]},
    )
    return _verdict({"branches": _finish(branches), "gloo_p2p": _finish(p2p)}, _self_test_note(plan))


def bench_commands(out: Path, gpu: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The bench runs of the last step: argv after ``python -m rlightning_comm.bench``, and their environment."""
    common = ["--factor", "16", "--iters", "10", "--warmup", "3", "--timeout", "60"]
    return {
        "nccl": (
            ["--backend", "nccl", "--nproc", "1", "--sizes", "1K:64M", *common, "--json", str(out / "bench_nccl.json")],
            {"CUDA_VISIBLE_DEVICES": gpu},
        ),
        "gloo_cuda": (
            [
                "--backend",
                "gloo",
                "--device",
                "cuda",
                "--nproc",
                "4",
                "--sizes",
                "1K:4M",
                *common,
                "--json",
                str(out / "bench_gloo_cuda.json"),
            ],
            {"CUDA_VISIBLE_DEVICES": gpu},  # all 4 ranks on one GPU
        ),
    }


def step_bench(plan: Plan) -> dict[str, Any]:
    if not plan.cuda:
        return {"status": "SKIP", "reason": "no CUDA"}
    runs: dict[str, dict[str, Any]] = {}
    commands = bench_commands(plan.out, plan.gpu)
    for i, (name, (argv, env)) in enumerate(commands.items()):
        left = plan.end - time.time()
        granted = plan.grant(min(150.0, left / (len(commands) - i)), 30)
        if granted is None:
            runs[name] = {"status": "skipped", "reason": "no time left"}
            continue
        result = run_command(
            f"bench_{name}", [sys.executable, "-m", "rlightning_comm.bench", *argv], plan.out, granted, env
        )
        runs[name] = {
            "status": "ok" if result["exit"] == 0 else ("timeout" if result["killed_at_deadline"] else "crashed"),
            **result,
        }
    return _verdict(runs)


RUNNERS = {
    "nccl_world1": step_nccl_world1,
    "cuda_tests": step_cuda_tests,
    "nccl_ranks": step_nccl_ranks,
    "cuda_branches": step_cuda_branches,
    "bench": step_bench,
}
