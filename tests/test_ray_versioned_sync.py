"""examples/ray_versioned_sync.py on a local Ray instance (skipped without the ``ray`` extra).

Versioned atomic syncs with relay, an engine killed mid-sync, the survivors on the previous version by digest, the
newcomer seeded from a peer.
"""

from __future__ import annotations

import re

import pytest
from example_commands import documented
from test_ray_example import run_example


def test_an_engine_killed_mid_sync_leaves_the_others_on_the_previous_version_and_a_peer_seeds_its_restart() -> None:
    pytest.importorskip("ray", reason="the Ray example needs the ray extra: pip install '.[ray]'")
    out = run_example(documented("ray_versioned_sync.py", False, "--steps", "3", "--kill-step", "1"))
    assert re.search(
        r"step 1: engine 1 \(pid \d+\) killed during the sync of version 2; every member raised: broadcast_state_dict: "
        r"version 2 not committed; live weights are version 1.*both survivors hold version 1, by digest",
        out,
    ), out
    seeded = re.search(
        r"engine 0 seeded it with version 1 in [\d.]+ ms, (\d+) bytes, (\d+) bytes from the trainer", out
    )
    assert seeded and int(seeded.group(1)) > 0 and int(seeded.group(2)) == 0, out
    assert "re-formed (generation 1)" in out, out
    committed = re.findall(r"step (\d): version (\d) committed on every engine .*trainer sent (\d+) bytes", out)
    assert [(s, v) for s, v, _ in committed] == [("0", "1"), ("1", "2"), ("2", "3")], out
    assert len({b for _, _, b in committed}) == 1, out  # one model's bytes each time, whatever the number of engines
    assert out.count("engines bit-identical to the trainer") == 3, out
    assert "every engine holds exactly one committed version" in out, out
