"""The default path of every sequence-parallel op: how many collectives it runs (from the profiler's ``gloo:`` events),
no host sync, debug mode's cross-rank check of the lengths, stats, and backward on another thread."""

from __future__ import annotations

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within, data, init_sp

# op -> (collectives forward, collectives backward) on the default path.
EXPECTED = {
    "all_to_all": (1, 1),
    "scatter r0=True": (1, 1),
    "scatter r0=False": (0, 1),  # forward keeps the local chunk
    "gather r0=True": (1, 1),
    "gather r0=False": (1, 0),  # backward keeps the local chunk
    "all_gather": (1, 1),
    "reduce_scatter": (1, 1),
    "ulysses_attention": (2, 2),  # q, k, v in one all-to-all and the result back; the same backward
}
_SYNC = ("aten::item", "aten::_local_scalar_dense")


def _ops() -> dict:
    import rlightning_comm.sequence_parallel as sp

    return {
        "all_to_all": lambda x: sp.all_to_all(x, 1, 2, SP),
        "scatter r0=True": lambda x: sp.scatter_to_sequence_parallel_region(x),
        "scatter r0=False": lambda x: sp.scatter_to_sequence_parallel_region(x, False),
        "gather r0=True": lambda x: sp.gather_from_sequence_parallel_region(x),
        "gather r0=False": lambda x: sp.gather_from_sequence_parallel_region(x, False),
        "all_gather": lambda x: sp.all_gather_from_sequence_parallel_region(x),
        "reduce_scatter": lambda x: sp.reduce_scatter_to_sequence_parallel_region(x),
        "ulysses_attention": lambda x: sp.ulysses_attention(x, x * 2, x * 3),
    }


def _events(prof) -> tuple[list[str], list[str]]:
    names = [e.name for e in prof.events()]
    return [n for n in names if n.startswith("gloo:")], [n for n in names if n in _SYNC]


def _task_counts(rank: int, size: int, url: str) -> dict:
    from torch.profiler import profile

    init_sp(rank, size, url)
    out = {}
    for name, op in _ops().items():
        (x,) = data(rank, (2, 4, 4, 3))
        x.requires_grad_()
        y = op(x)  # warm-up: nothing cached may hide a collective later
        y.square().sum().backward()
        with profile() as forward:
            y = op(x)
        with profile() as backward:
            y.sum().backward()
        fwd, fwd_sync = _events(forward)
        bwd, bwd_sync = _events(backward)
        out[name] = (len(fwd), len(bwd), fwd + bwd, fwd_sync + bwd_sync)
    return out


def test_one_collective_each_way_and_no_host_sync(world2) -> None:
    for rank, got in enumerate(world2.run(_task_counts, timeout=90)):
        for name, (fwd, bwd) in EXPECTED.items():
            assert got[name][:2] == (fwd, bwd), (
                f"rank {rank}, {name}: expected {fwd} forward and {bwd} backward collectives; got {got[name][2]}"
            )
            assert not got[name][3], f"rank {rank}, {name}: host syncs {got[name][3]}"


def _mismatches(rank: int) -> dict:
    """Calls where rank 1's length breaks the default rule (equal local lengths; the source's shape for rank0_only)."""
    import rlightning_comm.sequence_parallel as sp

    n = 4 if rank == 0 else 3
    (x,) = data(rank, (2, n, 4, 3))
    return {
        "all_to_all": lambda: sp.all_to_all(x, 1, 2, SP),
        "gather r0=True": lambda: sp.gather_from_sequence_parallel_region(x),
        "gather r0=False": lambda: sp.gather_from_sequence_parallel_region(x, False),
        "all_gather": lambda: sp.all_gather_from_sequence_parallel_region(x),
        "ulysses_attention": lambda: sp.ulysses_attention(x, x, x),
        "reduce_scatter": lambda: sp.reduce_scatter_to_sequence_parallel_region(torch.zeros(2, 2 * n, 4)),
        "scatter r0=True": lambda: sp.scatter_to_sequence_parallel_region(torch.zeros(2, 2 * n, 4)),
        # The usual way to get there: an uneven default split of 7, then a gather without seq_lens.
        "gather after uneven scatter": lambda: sp.gather_from_sequence_parallel_region(
            sp.scatter_to_sequence_parallel_region(data(9, (2, 7, 3))[0], False)
        ),
        "gather lengths 2 and 5": lambda: sp.gather_from_sequence_parallel_region(
            data(rank, (2, 2 if rank == 0 else 5, 3))[0]
        ),
        "gather dtypes differ": lambda: sp.gather_from_sequence_parallel_region(
            data(0, (2, 3, 4))[0].to(torch.float64 if rank == 0 else torch.float32)
        ),  # no hint
    }


def _task_debug(rank: int, size: int, url: str) -> dict:
    import torch.distributed as dist

    from rlightning_comm import CommContext, CommMismatchError

    ctx = init_sp(rank, size, url)
    ctx.set_debug(True)
    out = {}
    for name, call in _mismatches(rank).items():
        try:
            call()
            out[name] = "no error"
        except CommMismatchError as err:
            out[name] = str(err)
        # Nothing was sent: the group is still usable and in step, through the same SP group.
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=CommContext().get_group(SP))
        out[name + " after"] = t.tolist()
    return out


def test_debug_mode_names_every_ranks_length_before_sending(world2) -> None:
    results = world2.run(_task_debug, timeout=90)
    # The fingerprint of the wire tensors names each rank's length along the sequence (4 on rank 0, 3 on rank 1), as a
    # row shape [4, ...] vs [3, ...] or as the rows each rank sends and expects.
    named = {
        "all_to_all": (
            "rows of shape [2, 4, 2, 3] on global ranks [0]; float64 rows of shape [2, 3, 2, 3] on global ranks [1]"
        ),
        "gather r0=True": (
            "input_tensor: float64[2, 4, 4, 3] on global ranks [0]; float64[2, 3, 4, 3] on global ranks [1]"
        ),
        "gather r0=False": (
            "input_tensor: float64[2, 4, 4, 3] on global ranks [0]; float64[2, 3, 4, 3] on global ranks [1]"
        ),
        "all_gather": "input_tensor: float64[2, 4, 4, 3] on global ranks [0]; float64[2, 3, 4, 3] on global ranks [1]",
        # x once for q, k, v
        "ulysses_attention": (
            "rows of shape [2, 4, 2, 3] on global ranks [0]; float64 rows of shape [2, 3, 2, 3] on global ranks [1]"
        ),
        "reduce_scatter": "output: float32[2, 4, 4] on global ranks [0]; float32[2, 3, 4] on global ranks [1]",
        "scatter r0=True": "global rank 0 sends 4 rows to global rank 1, which expects 3",
    }
    # A gather-type op without lengths names the argument and the call that gives them, on every rank.
    hints = {
        name: "Hint: seq_lens was not given, so each rank took its own length along dim 1 as every rank's, but the "
        "ranks hold [4, 3] (in group rank order), as the default split of 7 over a group of 2 leaves them: pass "
        "seq_lens=sequence_split_sizes(7, 2) on every rank"
        for name in (
            "gather r0=True",
            "gather r0=False",
            "all_gather",
            "ulysses_attention",
            "gather after uneven scatter",
        )
    }
    hints["all_to_all"] = hints["gather r0=True"].replace("seq_lens", "gather_sizes")
    hints["gather lengths 2 and 5"] = (
        "but the ranks hold [2, 5] (in group rank order): pass seq_lens=[2, 5] on every rank"
    )
    for rank, out in enumerate(results):
        for name in _mismatches(rank):
            assert out[name + " after"] == [3.0, 3.0], f"rank {rank}, {name}: group out of step: {out[name + ' after']}"
            assert (name in hints) == ("Hint: " in out[name]), f"rank {rank}, {name}: {out[name]!r}"
        for name, fragment in (named | hints).items():
            assert fragment in out[name], f"rank {rank}, {name}: {fragment!r} not in {out[name]!r}"
    for name in _mismatches(0):
        assert results[0][name] == results[1][name], name


def _task_stats_and_threads(rank: int, size: int, url: str) -> dict:
    import threading

    import rlightning_comm.sequence_parallel as sp

    ctx = init_sp(rank, size, url)
    chk = Checks()
    ctx.enable_stats()
    (X,) = data(7, (2, 4 * size, 4, 3))
    x = X.tensor_split(size, 1)[rank].clone().requires_grad_()
    y = sp.all_to_all(x, 1, 2, SP)
    # Backward on another thread (as autograd's device threads do): sequential calls from any thread are fine.
    worker = threading.Thread(target=lambda: (y * 2).sum().backward())
    worker.start()
    worker.join(timeout=30)
    chk.true("backward thread finished", not worker.is_alive())
    chk.close("grad from the other thread", x.grad, torch.full_like(x, 2.0))
    g = sp.gather_from_sequence_parallel_region(x.detach(), False)
    chk.close("gather after", g, X)
    stats = ctx.stats()
    ctx.disable_stats()
    a2a = stats.get(SP, {}).get("all_to_all_single", {})
    ag = stats.get(SP, {}).get("all_gather", {})
    chk.true("stats: all_to_all_single twice (forward, backward)", a2a.get("count") == 2)
    chk.true("stats: all_to_all_single bytes", a2a.get("bytes") == 2 * x.numel() * 8)
    chk.true("stats: all_gather once", ag.get("count") == 1)
    return chk.errors


def test_stats_see_the_ops_and_backward_may_run_on_another_thread(world2) -> None:
    assert_all_within(world2.run(_task_stats_and_threads, timeout=60))


@pytest.mark.parametrize(
    ("wire", "hinted"),
    [
        ([[2, 4, 3], [2, 3, 3], [2, 3, 3]], "sequence_split_sizes(10, 3)"),  # torch.tensor_split's lengths of 10 over 3
        ([[2, 4, 3], [2, 5, 3], [2, 4, 3]], "seq_lens=[4, 5, 4] on every rank"),  # other lengths: the list itself
        ([[2, 4, 3], [3, 4, 3], [2, 4, 3]], None),  # the batch differs, not the length (this rank's is 4)
        ([[2, 4, 3], [2, 3, 2], [2, 4, 3]], None),  # two dims differ: not the rule's doing alone
        ([[2, 4, 3], [2, 4], [2, 4, 3]], None),  # different ranks
    ],
)
def test_the_lengths_hint_only_when_the_shapes_differ_in_the_length_alone(wire, hinted) -> None:
    from rlightning_comm.sequence_parallel._sizes import forgotten_lengths_hint

    got = forgotten_lengths_hint(wire, 0, "seq_lens", 1, 4)
    assert (got is None) if hinted is None else (hinted in got), got
