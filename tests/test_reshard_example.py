"""examples/reshard_sync.py as its docstring shows it: FSDP2 trainer world to tensor-parallel engine world over a
connected mode, the engine's forward equal to the trainer's after every step's reshard_state_dict."""

from __future__ import annotations

import re
import subprocess

from example_commands import documented, environment


def test_reshard_sync_example_keeps_the_engine_equal_to_the_trainer():
    run = subprocess.run(
        documented("reshard_sync.py", False, "--timeout", "150"),
        capture_output=True,
        text=True,
        timeout=200,
        env=environment(),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    engine = [line for line in lines if line.startswith("step ") and " engine " in line]
    assert len(engine) == 2 * 3 and all("engine forward == trainer forward" in line for line in engine), run.stdout
    # Every step, the trainers send exactly the bytes the engines receive; the plan is made once, then kept.
    for step in range(3):
        sent = sum(
            int(n) for line in lines if line.startswith(f"step {step} trainer") for n in re.findall(r": (\d+)", line)
        )
        received = sum(
            int(n) for line in lines if line.startswith(f"step {step} engine") for n in re.findall(r": (\d+)", line)
        )
        assert sent == received > 0, (step, run.stdout)
        assert all(
            line.endswith("plan made" if step == 0 else "plan kept")
            for line in lines
            if line.startswith(f"step {step} ")
        )
    assert lines[-1] == "OK: 3 steps, every engine forward equal to the trainer's", run.stdout
