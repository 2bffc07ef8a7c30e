"""examples/ray_engine_sync.py on a local Ray instance (skipped without the ``ray`` extra): an engine killed and
replaced mid-run."""

from __future__ import annotations

import re

import pytest
from example_commands import documented
from test_ray_example import run_example


def test_engine_killed_mid_run_is_restarted_and_the_next_sync_is_bit_identical() -> None:
    pytest.importorskip("ray", reason="the Ray example needs the ray extra: pip install '.[ray]'")
    out = run_example(documented("ray_engine_sync.py", False, "--steps", "4", "--kill-step", "2"))
    lost = re.search(
        r"step 2: engine 1 \(pid (\d+)\) killed during the sync; PeerLostError on the trainer (\d+) ms and on engine 0 "
        r"(\d+) ms after the kill",
        out,
    )
    assert lost and "naming member 2 of generation 0" in out, out
    assert max(int(lost.group(2)), int(lost.group(3))) < 10_000, out  # the mode's timeout is 30 s
    restarted = re.search(r"Ray restarted engine 1 as pid (\d+)", out)
    assert restarted and restarted.group(1) != lost.group(1), out
    assert "re-formed (generation 1)" in out, out
    syncs = [line for line in out.splitlines() if re.match(r"step \d: trainer loss", line)]
    assert len(syncs) == 4 and all("engines bit-identical to the trainer" in line for line in syncs), out
    assert "the trainer world never restarted" in out, out
