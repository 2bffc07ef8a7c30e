"""Bad input fails fast and locally: a clear error before any collective starts; strided views never touch memory around
them."""

from __future__ import annotations

from counting import backend_calls
from world import init_world


def _attempt(fn, *expected):
    try:
        fn()
    except expected as err:
        return next(e.__name__ for e in expected if isinstance(err, e)), str(err)
    except Exception as err:  # noqa: BLE001 - reported as a wrong error type
        return f"unexpected {type(err).__name__}", str(err)
    return "no error", ""


def _bad_input_cases(rank, torch, comm):
    """(name, call, expected substring) for inputs every rank passes alike, plus root-only ones for the root."""
    from torch.distributed import ReduceOp

    f = torch.ones(4)
    i = torch.ones(4, dtype=torch.int64)
    cases = [
        (
            "max on complex",
            lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64), op=ReduceOp.MAX),
            "not defined on complex",
        ),
        ("bitwise on float", lambda: comm.all_reduce(f, op=ReduceOp.BAND), "needs an integer or bool tensor"),
        ("avg on int (gloo)", lambda: comm.all_reduce(i, op=ReduceOp.AVG), "AVG needs a floating-point tensor"),
        ("op as a string", lambda: comm.all_reduce(f, op="sum"), "is not supported by GlooCommunicator"),
        ("premul_sum", lambda: comm.all_reduce(f, op=ReduceOp.PREMUL_SUM), "is not supported by GlooCommunicator"),
        ("not a tensor", lambda: comm.all_reduce([1.0, 2.0]), "must be a torch.Tensor; got list"),
        ("meta device", lambda: comm.all_reduce(torch.ones(2, device="meta")), "is on meta"),
        (
            "all_gather dtype",
            lambda: comm.all_gather(torch.empty(8, dtype=torch.float64), f),
            "output_tensor must have shape",
        ),
        ("all_gather shape", lambda: comm.all_gather(torch.empty(7), f), "output_tensor must have shape"),
        (
            "reduce_scatter dtype",
            lambda: comm.reduce_scatter(torch.empty(2), torch.ones(4, dtype=torch.float64)),
            "input_ must hold",
        ),
        ("reduce_scatter length", lambda: comm.reduce_scatter(torch.empty(3), f), "input_ must hold"),
        ("src out of range", lambda: comm.broadcast(f, src=2), "src=2 is not a global rank"),
        ("src negative", lambda: comm.broadcast(f, src=-1), "src=-1 is not a global rank"),
        ("src bool", lambda: comm.broadcast(f, src=True), "src=True is not a global rank"),
        ("dst as str", lambda: comm.gather(f, None, dst="0"), "dst='0' is not a global rank"),
        (
            "splits length",
            lambda: comm.all_to_all_single(torch.empty(4), f, [4], [2, 2]),
            "output_split_sizes must have 2 entries",
        ),
        (
            "splits negative",
            lambda: comm.all_to_all_single(torch.empty(4), f, [5, -1], [2, 2]),
            "output_split_sizes must have 2 entries",
        ),
        (
            "splits float",
            lambda: comm.all_to_all_single(torch.empty(4), f, [2.0, 2.0], [2, 2]),
            "output_split_sizes must have 2 entries",
        ),
        (
            "uneven split",
            lambda: comm.all_to_all_single(torch.empty(3), torch.ones(3)),
            "must be divisible by the group size 2",
        ),
        ("dict not a mapping", lambda: comm.all_reduce_dict([("a", 1.0)]), "dictionary must be a Mapping"),
        ("dict value", lambda: comm.all_reduce_dict({"a": "1.0"}), "must be a number or a tensor; got str"),
    ]
    if rank == 0:  # arguments only the root reads: a peer could not have caught these, so only the root calls
        cases += [
            (
                "gather_list length",
                lambda: comm.gather(f, [torch.empty(4)], dst=0),
                "gather_list must hold one tensor per rank: expected 2; got 1",
            ),
            (
                "gather_list dtype",
                lambda: comm.gather(f, [torch.empty(4), i], dst=0),
                "gather_list[1] must match the tensor argument",
            ),
            (
                "scatter_list type",
                lambda: comm.scatter(f, (f for _ in range(2)), src=0),
                "scatter_list must be a list of 2 tensors",
            ),
            (
                "scatter_list shape",
                lambda: comm.scatter(f, [f, torch.ones(5)], src=0),
                "scatter_list[1] must match the tensor argument",
            ),
        ]
    return cases


def _bad_input_task(rank, size, url):
    import torch

    from rlightning_comm import CommContext

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0], "SOLO")
    comm = ctx.get_communicator("GLOBAL")
    with backend_calls() as counts:
        collectives = {
            name: (_attempt(call, TypeError, ValueError), expected)
            for name, call, expected in _bad_input_cases(rank, torch, comm)
        }
        results = _context_cases(rank, torch, ctx)
    calls = dict(counts)
    # Nothing above reached the backend, and nothing left the group out of step.
    t = torch.ones(2)
    CommContext().get_communicator("GLOBAL").all_reduce(t)
    return {"collectives": collectives, "context": results, "calls": calls, "after": t.tolist()}


def _context_cases(rank, torch, ctx):
    from rlightning_comm import CommError, ModeNotBoundError

    results = {}
    results["unbound mode"] = (
        _attempt(lambda: ctx.get_communicator("NOPE"), ModeNotBoundError),
        "No communicator bound for mode 'NOPE'; bound modes: ['GLOBAL', 'SOLO']",
    )
    results["init_group rank range"] = (
        _attempt(lambda: ctx.init_group([0, 5], "BAD"), ValueError),
        "rank 5 is out of range for world size 2",
    )
    results["init_group duplicate"] = (
        _attempt(lambda: ctx.init_group([1, 1], "BAD"), ValueError),
        "appears more than once",
    )
    if rank == 1:
        solo = ctx.get_communicator("SOLO")
        results["non-member rank"] = (
            _attempt(lambda: ctx.get_local_rank("SOLO"), CommError),
            "global rank 1 is not a member of mode 'SOLO'",
        )
        results["non-member collective"] = (("no error", repr(solo.all_reduce(torch.ones(1)))), "None")
    return results


def test_bad_input_fails_locally_before_any_collective(world2):
    for rank, out in enumerate(world2.run(_bad_input_task, timeout=60)):
        assert out["calls"] == {}, f"rank {rank} reached the backend: {out['calls']}"
        assert out["after"] == [2.0, 2.0]
        assert len(out["collectives"]) == (25 if rank == 0 else 21)
        for name, ((kind, msg), expected) in out["collectives"].items():
            assert kind in ("TypeError", "ValueError"), (rank, name, kind, msg)
            assert expected in msg and "mode 'GLOBAL'" in msg, (rank, name, msg)
        expected_kinds = {
            "unbound mode": "ModeNotBoundError",
            "non-member rank": "CommError",
            "non-member collective": "no error",
        }
        assert len(out["context"]) == (5 if rank == 1 else 3)
        for name, ((kind, msg), expected) in out["context"].items():
            assert kind == expected_kinds.get(name, "ValueError") and expected in msg, (rank, name, kind, msg)


def _strided_cases(rank, torch, comm):
    """(name, call, bases): every op with a strided view in each tensor argument; ``bases`` are what the views live
    in."""
    b1 = torch.full((8,), -7.0)
    b2 = torch.full((4, 3), -7.0)
    b3 = torch.full((16,), -7.0)
    col = b2[:, 1]  # shape (4,), stride (3,)
    view = b1[::2]  # shape (4,), stride (2,)
    out8 = b3[::2]  # shape (8,), stride (2,)
    ok4, ok8 = torch.ones(4), torch.empty(8)
    cases = [
        ("all_reduce", lambda: comm.all_reduce(view)),
        ("all_reduce column", lambda: comm.all_reduce(col)),
        ("broadcast", lambda: comm.broadcast(view, src=0)),
        ("broadcast column", lambda: comm.broadcast(col, src=1)),
        ("all_gather output", lambda: comm.all_gather(out8, ok4)),
        ("all_gather input", lambda: comm.all_gather(ok8, view)),
        ("gather input", lambda: comm.gather(view, [torch.empty(4), torch.empty(4)] if rank == 0 else None, dst=0)),
        ("scatter output", lambda: comm.scatter(view, [ok4, ok4] if rank == 1 else None, src=1)),
        ("reduce_scatter output", lambda: comm.reduce_scatter(view, ok8)),
        ("reduce_scatter input", lambda: comm.reduce_scatter(ok4, out8)),
        ("all_to_all_single output", lambda: comm.all_to_all_single(view, ok4)),
        ("all_to_all_single input", lambda: comm.all_to_all_single(ok4, col)),
        ("all_reduce async", lambda: comm.all_reduce(view, async_op=True)),
    ]
    if rank == 0:  # list entries only the root reads
        cases += [
            ("gather_list entry", lambda: comm.gather(ok4, [torch.empty(4), view], dst=0)),
            ("scatter_list entry", lambda: comm.scatter(torch.empty(4), [col, ok4], src=0)),
        ]
    return cases, (b1, b2, b3)


def _strided_task(rank, size, url):
    import torch
    import torch.distributed as dist

    ctx = init_world(rank, size, url, timeout=30)
    comm = ctx.get_communicator("GLOBAL")
    cases, bases = _strided_cases(rank, torch, comm)
    before = [b.clone() for b in bases]
    results = {name: _attempt(call, ValueError) for name, call in cases}
    untouched = all(torch.equal(a, b) for a, b in zip(before, bases))
    # all_reduce_dict copies its values: a strided view is fine there, and stays untouched.
    base = torch.arange(8.0) + rank
    view = base[::2]
    kept = base.clone()
    got = comm.all_reduce_dict({"v": view, "n": 1.0})
    oracle = view.contiguous()
    dist.all_reduce(oracle)
    return {
        "results": results,
        "untouched": untouched,
        "dict_ok": torch.equal(got["v"], oracle) and got["n"] == 2.0,
        "dict_base_kept": torch.equal(base, kept),
    }


def test_strided_views_are_refused_by_every_op_and_memory_around_them_is_untouched(world2):
    for rank, out in enumerate(world2.run(_strided_task, timeout=60)):
        assert out["untouched"], f"rank {rank}: memory around a view changed"
        assert len(out["results"]) == (15 if rank == 0 else 13)
        for name, (kind, msg) in out["results"].items():
            assert kind == "ValueError" and "must be contiguous" in msg and "mode 'GLOBAL'" in msg, (
                rank,
                name,
                kind,
                msg,
            )
        assert out["dict_ok"] and out["dict_base_kept"], out


def _argument_kind_task(rank, size, url):
    import torch

    ctx = init_world(rank, size, url, timeout=30)
    comm = ctx.get_communicator("GLOBAL")
    f = torch.ones(4)
    cases = {
        # (call, expected type, expected text): every rank passes the same bad argument.
        "all_to_all rows": (
            lambda: comm.all_to_all_single(torch.empty(4, 2), torch.ones(4, 3)),
            ValueError,
            "expected torch.float32 on cpu, 3 per row",
        ),
        "all_to_all dtype": (
            lambda: comm.all_to_all_single(torch.empty(4, dtype=torch.float64), f),
            ValueError,
            "got torch.float64 on cpu",
        ),
        "src float": (
            lambda: comm.broadcast(f, src=1.0),
            TypeError,
            "src=1.0 is not a global rank of mode 'GLOBAL': expected an int, one of [0, 1]; got float",
        ),
        "dst bool": (lambda: comm.gather(f, None, dst=False), TypeError, "got bool"),
        "scatter src str": (lambda: comm.scatter(f, None, src="1"), TypeError, "got str"),
        "split sizes an int": (
            lambda: comm.all_to_all_single(torch.empty(4), f, 4),
            TypeError,
            "output_split_sizes must be a list of 2 ints (or None for an even split); got int 4",
        ),
        "0-d with split sizes": (
            lambda: comm.all_to_all_single(torch.tensor(1.0), torch.tensor(1.0), [1, 0], [1, 0]),
            ValueError,
            "output needs at least one dimension; got a 0-d tensor",
        ),
        "sparse coo": (
            lambda: comm.all_reduce(torch.ones(4).to_sparse()),
            ValueError,
            "tensor is a sparse tensor (layout torch.sparse_coo)",
        ),
        "sparse csr": (
            lambda: comm.broadcast(torch.eye(2).to_sparse_csr(), src=0),
            ValueError,
            "tensor is a sparse tensor (layout torch.sparse_csr)",
        ),
    }
    with backend_calls() as counts:
        got = {name: _attempt(call, kind) for name, (call, kind, _) in cases.items()}
    t = torch.ones(2)
    comm.all_reduce(t)  # nothing above reached the backend: the group is in step
    return {
        "got": got,
        "want": {name: (kind.__name__, text) for name, (_, kind, text) in cases.items()},
        "calls": dict(counts),
        "after": t.tolist(),
    }


def test_rank_split_row_and_sparse_arguments_get_what_expected_got_errors(world2):
    for out in world2.run(_argument_kind_task, timeout=60):
        assert out["calls"] == {} and out["after"] == [2.0, 2.0], out
        for name, (kind, text) in out["want"].items():
            got_kind, msg = out["got"][name]
            assert got_kind == kind and text in msg, (name, got_kind, msg)
