"""examples/two_worlds.py: two worlds of plain processes joined by a connected mode; an engine killed and replaced."""

from __future__ import annotations

import re

from example_commands import documented
from test_ray_example import run_example


def test_a_hung_engine_is_killed_replaced_and_the_syncs_stay_bit_identical() -> None:
    out = run_example(documented("two_worlds.py", False, "--steps", "3"))
    killed = re.search(r"engine 2 \(pid (\d+)\) hung after step 0: killed", out)
    assert killed, out
    for who in ("trainer", "engine 1"):
        assert f"{who}: PeerLostError naming member 2 of generation 0" in out, out
    replaced = re.search(r"engine 2 \(pid (\d+)\) connected: generation 1", out)
    assert replaced and replaced.group(1) != killed.group(1), out
    assert "trainer: re-formed (generation 1)" in out, out
    for step in range(3):
        assert re.search(rf"step {step}: engines bit-identical to the trainer \(\w+\)", out), out
    assert "DIFFER" not in out and "every process exited cleanly" in out, out
