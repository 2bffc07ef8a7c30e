"""examples/parallel_layout.py's checks, run on a reused spawned world: they pass, and they catch a corrupted
collective."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "parallel_layout.py"


def _run_example(rank: int, size: int, url: str, corrupt_rank: int | None) -> tuple[int, str]:
    import torch

    from rlightning_comm.communicators.base import Communicator
    from rlightning_comm.weights.broadcast._pipeline import Pipeline

    spec = importlib.util.spec_from_file_location("parallel_layout_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # What the example's own spawner sets: two simulated nodes of two ranks.
    os.environ.update({"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)})
    original, original_move = Communicator.broadcast, Pipeline._move

    class Late:
        """A transfer's handle whose wait() corrupts the tensor after the data arrived."""

        def __init__(self, work, tensor):
            self._work, self._tensor = work, tensor

        def wait(self, *args, **kwargs):
            out = self._work.wait(*args, **kwargs)
            with torch.no_grad():
                self._tensor.add_(1)
            return out

    def off_by_one(self, tensor, src=0, async_op=False):
        out = original(self, tensor, src, async_op)
        if async_op:
            return Late(out, tensor)
        with torch.no_grad():
            tensor.add_(1)
        return out

    def late_move(
        self, data
    ):  # broadcast_state_dict's pipeline, whichever way it moves a unit: corrupt once it arrived
        return [Late(work, data) for work in original_move(self, data)]

    if rank == corrupt_rank:
        Communicator.broadcast, Pipeline._move = off_by_one, late_move
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = example.run(
                example.parse_args(["--tp", "2", "--timeout", "60"]), dist_url=url, world_size=size, rank=rank
            )
    finally:
        Communicator.broadcast, Pipeline._move = original, original_move  # the world's processes outlive this test
    return code, out.getvalue()


def test_example_passes_and_prints_the_layout(world4) -> None:
    results = world4.run(_run_example, None)
    assert [code for code, _ in results] == [0, 0, 0, 0]
    report = results[0][1]
    assert "TENSOR_PARALLEL      [0, 1] [2, 3]" in report
    assert "INTER_NODE           [0, 2] [1, 3]" in report
    assert "bit-identical" in report and "checks: all passed" in report
    assert all(out == "" for _, out in results[1:])


def test_example_fails_on_every_rank_when_one_collective_is_wrong(world4) -> None:
    results = world4.run(_run_example, 3)
    assert [code for code, _ in results] == [1, 1, 1, 1]
    report = results[0][1]
    assert "rank 3 GLOBAL broadcast: got" in report
    assert "MISMATCH" in report
