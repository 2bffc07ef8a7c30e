"""A member that skips a weight-sync call is named by every member that came, within the group's timeout and a few
seconds, on both calls; the members that came raise the same ``CommTimeoutError``, before any byte moves."""

from __future__ import annotations

import time

import pytest
import torch
from world import init_world

MODE = "ABSENT"
TIMEOUT = 3.0


def _skipped(rank: int, size: int, url: str, call: str) -> dict:
    from rlightning_comm import CommTimeoutError, broadcast_state_dict, reshard_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE, timeout=TIMEOUT)
    state = {"w": torch.full((64,), float(rank))}
    if rank == 2:  # skips the call
        return {"skipped": True}
    start = time.monotonic()
    try:
        if call == "broadcast":
            broadcast_state_dict(state, MODE, src=0)
        elif rank == 0:
            reshard_state_dict(held=state, comm_mode=MODE)
        else:
            reshard_state_dict(wanted=state, comm_mode=MODE)
        out = {"error": None}
    except CommTimeoutError as err:
        out = {"error": "CommTimeoutError", "msg": str(err)}
    except Exception as err:  # noqa: BLE001 - every member's outcome goes back to the parent
        out = {"error": type(err).__name__, "msg": str(err)}
    out.update(elapsed=time.monotonic() - start, untouched=bool((state["w"] == rank).all()))
    return out


@pytest.mark.parametrize("call", ["broadcast", "reshard"])
def test_a_member_that_skips_the_call_is_named_by_every_member_that_came(world4, call) -> None:
    results = world4.run(_skipped, call, timeout=60)
    assert results[2] == {"skipped": True}
    for rank in (0, 1, 3):
        out = results[rank]
        assert out["error"] == "CommTimeoutError", (rank, out)
        assert (
            "on mode 'ABSENT' timed out after 3 s (the group's timeout): the members at ranks [2] did not join"
            in out["msg"]
        ), (
            rank,
            out["msg"],
        )
        assert "nothing was transferred" in out["msg"], (rank, out["msg"])
        assert out["elapsed"] < TIMEOUT + 4.0, (rank, out["elapsed"])
        assert out["untouched"], rank
