"""The collectives' fast path accepts exactly what the full checks accept, on edge inputs.

Each tensor collective tests the common case in one C-level expression and sends everything else to its full
``_check_<op>``. For every case below, the method must do what the full check alone says: raise the same error type and
message, with nothing sent; or run, with the result raw torch.distributed gives on copies of the same inputs. Both ranks
run the same cases in the same order. A bad root-only list is left out: only the root can see it, so without debug mode
its peers would enter the collective (tests/test_bad_input.py has those).
"""

from __future__ import annotations

import warnings

from counting import backend_calls
from world import init_world


def _cases(torch, rank):
    """(name, op, args): args are rebuilt per call, so every side gets fresh tensors."""
    f = torch.float32

    def full(*shape, dtype=f):
        n = 1
        for s in shape:
            n *= s
        return (
            (torch.arange(n, dtype=torch.float64) + 10 * rank + 1).to(dtype).reshape(shape)
            if n
            else torch.empty(shape, dtype=dtype)
        )

    one_strided = lambda: torch.empty(8).as_strided((1,), (5,)).fill_(rank + 1.0)  # contiguous to torch

    def nested(layout):
        with warnings.catch_warnings():  # the strided layout's "prototype" warning
            warnings.simplefilter("ignore")
            return torch.nested.nested_tensor([full(2), full(3)], layout=layout)

    return [
        ("all_reduce 1-d", "all_reduce", lambda: (full(4),)),
        ("all_reduce 0-d", "all_reduce", lambda: (full(),)),
        ("all_reduce empty", "all_reduce", lambda: (full(0),)),
        ("all_reduce one element, stride 5", "all_reduce", lambda: (one_strided(),)),
        ("all_reduce 2-d", "all_reduce", lambda: (full(2, 3),)),
        ("all_reduce complex", "all_reduce", lambda: (full(3, dtype=torch.complex64),)),
        ("all_reduce int64", "all_reduce", lambda: (full(3, dtype=torch.int64),)),
        ("all_reduce transposed", "all_reduce", lambda: (full(2, 3).t(),)),
        ("all_reduce expanded", "all_reduce", lambda: (full(1).expand(3),)),
        ("all_reduce channels_last", "all_reduce", lambda: (full(1, 2, 2, 3).to(memory_format=torch.channels_last),)),
        ("all_reduce meta", "all_reduce", lambda: (torch.empty(2, device="meta"),)),
        ("all_reduce coo", "all_reduce", lambda: (full(2, 2).to_sparse(),)),
        ("all_reduce csr", "all_reduce", lambda: (full(2, 2).to_sparse_csr(),)),
        ("all_reduce MAX", "all_reduce", lambda: (full(3), torch.distributed.ReduceOp.MAX)),
        ("all_reduce a list", "all_reduce", lambda: ([1.0],)),
        ("all_reduce neg view", "all_reduce", lambda: (torch._neg_view(full(3)),)),
        ("all_reduce conj view", "all_reduce", lambda: (full(3, dtype=torch.complex64).conj(),)),
        ("all_reduce nested", "all_reduce", lambda: (nested(torch.strided),)),
        ("all_reduce jagged", "all_reduce", lambda: (nested(torch.jagged),)),
        (
            "all_reduce MAX instance",
            "all_reduce",
            lambda: (full(3), torch.distributed.ReduceOp(torch.distributed.ReduceOp.MAX)),
        ),
        ("all_reduce PREMUL_SUM", "all_reduce", lambda: (full(3), torch.distributed._make_nccl_premul_sum(2.0))),
        ("all_gather neg input", "all_gather", lambda: (torch.empty(8), torch._neg_view(full(4)))),
        ("all_gather neg output", "all_gather", lambda: (torch._neg_view(torch.zeros(8)), full(4))),
        ("broadcast neg view", "broadcast", lambda: (torch._neg_view(full(3)), 0)),
        ("broadcast conj view", "broadcast", lambda: (full(3, dtype=torch.complex64).conj(), 0)),
        (
            "reduce_scatter MAX instance",
            "reduce_scatter",
            lambda: (torch.empty(2), full(4), torch.distributed.ReduceOp(torch.distributed.ReduceOp.MAX)),
        ),
        ("all_to_all neg input", "all_to_all_single", lambda: (torch.empty(4), torch._neg_view(full(4)))),
        (
            "gather neg tensor",
            "gather",
            lambda: (torch._neg_view(full(3)), [torch.empty(3), torch.empty(3)] if rank == 0 else None, 0),
        ),
        (
            "scatter conj tensor",
            "scatter",
            lambda: (
                torch.zeros(3, dtype=torch.complex64).conj(),
                [full(3, dtype=torch.complex64)] * 2 if rank == 1 else None,
                1,
            ),
        ),
        ("all_gather flat", "all_gather", lambda: (torch.empty(8), full(4))),
        ("all_gather empty", "all_gather", lambda: (torch.empty(0), full(0))),
        ("all_gather 0-d input", "all_gather", lambda: (torch.empty(2), full())),
        ("all_gather 2-d concatenated", "all_gather", lambda: (torch.empty(4, 3), full(2, 3))),
        ("all_gather 2-d stacked", "all_gather", lambda: (torch.empty(2, 2, 3), full(2, 3))),
        ("all_gather flat output, 2-d input", "all_gather", lambda: (torch.empty(12), full(2, 3))),
        ("all_gather wrong length", "all_gather", lambda: (torch.empty(7), full(4))),
        ("all_gather dtype", "all_gather", lambda: (torch.empty(8, dtype=torch.float64), full(4))),
        (
            "all_gather complex",
            "all_gather",
            lambda: (torch.empty(4, dtype=torch.complex64), full(2, dtype=torch.complex64)),
        ),
        ("all_gather strided input", "all_gather", lambda: (torch.empty(4), full(4)[::2])),
        ("all_gather output a view with a gap", "all_gather", lambda: (torch.empty(16)[::2], full(4))),
        ("reduce_scatter flat", "reduce_scatter", lambda: (torch.empty(2), full(4))),
        ("reduce_scatter 2-d", "reduce_scatter", lambda: (torch.empty(1, 3), full(2, 3))),
        ("reduce_scatter wrong length", "reduce_scatter", lambda: (torch.empty(3), full(4))),
        ("reduce_scatter dtype", "reduce_scatter", lambda: (torch.empty(2, dtype=torch.float64), full(4))),
        ("reduce_scatter MAX", "reduce_scatter", lambda: (torch.empty(2), full(4), torch.distributed.ReduceOp.MAX)),
        ("reduce_scatter transposed input", "reduce_scatter", lambda: (torch.empty(3), full(3, 2).t())),
        (
            "reduce_scatter complex",
            "reduce_scatter",
            lambda: (torch.empty(2, dtype=torch.complex64), full(4, dtype=torch.complex64)),
        ),
        (
            "reduce_scatter complex MAX",
            "reduce_scatter",
            lambda: (
                torch.empty(2, dtype=torch.complex64),
                full(4, dtype=torch.complex64),
                torch.distributed.ReduceOp.MAX,
            ),
        ),
        (
            "all_reduce bool AVG",
            "all_reduce",
            lambda: (torch.ones(3, dtype=torch.bool), torch.distributed.ReduceOp.AVG),
        ),
        ("all_to_all flat", "all_to_all_single", lambda: (torch.empty(4), full(4))),
        ("all_to_all 2-d rows", "all_to_all_single", lambda: (torch.empty(2, 3), full(2, 3))),
        ("all_to_all odd length", "all_to_all_single", lambda: (torch.empty(3), full(3))),
        (
            "all_to_all splits",
            "all_to_all_single",
            lambda: (torch.empty(4), full(4), *([[1, 3], [1, 3]] if rank == 0 else [[3, 1], [3, 1]])),
        ),
        ("all_to_all dtype", "all_to_all_single", lambda: (torch.empty(4, dtype=torch.int64), full(4))),
        (
            "all_to_all complex",
            "all_to_all_single",
            lambda: (torch.empty(2, dtype=torch.complex64), full(2, dtype=torch.complex64)),
        ),
        ("broadcast int src", "broadcast", lambda: (full(3), 1)),
        ("broadcast numpy src", "broadcast", lambda: (full(3), __import__("numpy").int64(1))),
        ("broadcast tensor src", "broadcast", lambda: (full(3), torch.tensor(1))),
        ("broadcast bool src", "broadcast", lambda: (full(3), True)),
        ("broadcast src outside", "broadcast", lambda: (full(3), 5)),
        ("broadcast complex", "broadcast", lambda: (full(2, dtype=torch.complex128), 0)),
        ("broadcast strided", "broadcast", lambda: (full(6)[::2], 0)),
        ("gather", "gather", lambda: (full(3), [torch.empty(3), torch.empty(3)] if rank == 0 else None, 0)),
        (
            "gather numpy dst",
            "gather",
            lambda: (full(3), [torch.empty(3), torch.empty(3)] if rank == 0 else None, __import__("numpy").int64(0)),
        ),
        (
            "gather tensor dst",
            "gather",
            lambda: (full(3), [torch.empty(3), torch.empty(3)] if rank == 0 else None, torch.tensor(0)),
        ),
        ("scatter", "scatter", lambda: (torch.empty(3), [full(3), full(3) + 1] if rank == 1 else None, 1)),
        ("scatter tuple list", "scatter", lambda: (torch.empty(3), (full(3), full(3) + 1) if rank == 1 else None, 1)),
    ]


def _raw(dist, op, args, group):
    """The same call through torch.distributed (the oracle), or None where torch has no same-shaped form."""
    import torch

    from rlightning_comm._compat import all_gather_single, reduce_scatter_single

    if op == "all_reduce":
        return dist.all_reduce(*args[:1], *(args[1:2] or ()), group=group)
    if (
        op == "all_gather"
    ):  # torch's gloo takes neither a 0-d input nor the stacked output: the same bytes as flat views
        out, inp = args
        return (
            all_gather_single(out.view(-1), inp.view(-1), group=group)
            if out.dim() != inp.dim()
            else all_gather_single(out, inp, group=group)
        )
    if op == "reduce_scatter":
        out, inp = (
            (torch.view_as_real(t).view(-1) for t in args[:2]) if args[1].is_complex() else args[:2]
        )  # complex: the real pairs' bytes
        return reduce_scatter_single(out, inp, *(args[2:3] or ()), group=group)
    if op == "all_to_all_single":
        return dist.all_to_all_single(*args, group=group)
    if op == "broadcast":
        return dist.broadcast(args[0], int(args[1]), group=group)
    listed = None if args[1] is None else list(args[1])  # torch takes a list only
    if op == "gather":
        return dist.gather(args[0], listed, int(args[2]), group=group)
    return dist.scatter(args[0], listed, int(args[2]), group=group)


def _task(rank, size, url):
    import torch
    import torch.distributed as dist

    ctx = init_world(rank, size, url)
    comm = ctx.get_communicator("GLOBAL")
    out = []
    for name, op, make in _cases(torch, rank):
        checked = None
        try:
            getattr(comm, f"_check_{op}")(*make())
        except Exception as err:  # noqa: BLE001 - what the full check says is the expectation
            checked = (type(err).__name__, str(err))
        args = make()
        with backend_calls() as sent:
            try:
                getattr(comm, op)(*args)
                got = None
            except Exception as err:  # noqa: BLE001 - compared with the full check's verdict
                got = (type(err).__name__, str(err))
        entry = {"name": name, "checked": checked, "got": got, "sent": dict(sent)}
        if checked is None and got is None:
            raw_args = make()
            _raw(dist, op, raw_args, comm.group)
            # What each op writes: its first argument, or the root's gather list.
            ours, theirs = (args[1], raw_args[1]) if op == "gather" and rank == 0 else (args[0], raw_args[0])
            if isinstance(ours, list):
                same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
            else:
                same = torch.equal(ours, theirs)
            entry["same_as_raw"] = same
        out.append(entry)
    return out


def test_fast_path_accepts_exactly_what_the_full_checks_accept(world2) -> None:
    results = world2.run(_task)
    problems = []
    for rank, entries in enumerate(results):
        for e in entries:
            if e["checked"] != e["got"]:
                problems.append(f"rank {rank} {e['name']}: full check says {e['checked']}, the method did {e['got']}")
            elif e["got"] is not None and e["sent"]:
                problems.append(f"rank {rank} {e['name']}: refused but sent {e['sent']}")
            elif e["got"] is None and not e.get("same_as_raw", False):
                problems.append(f"rank {rank} {e['name']}: result differs from raw torch.distributed")
    refused = {e["name"] for e in results[0] if e["checked"] is not None}
    accepted = {e["name"] for e in results[0] if e["checked"] is None}
    assert not problems, "\n".join(problems)
    # The table covers both sides of the fast path's boundary.
    assert {"all_reduce transposed", "all_gather wrong length", "broadcast bool src", "all_reduce csr"} <= refused
    assert {
        "all_reduce one element, stride 5",
        "all_gather 2-d stacked",
        "broadcast numpy src",
        "all_to_all splits",
    } <= accepted
    # Views whose memory is not their values, nested tensors and PREMUL_SUM are refused; ReduceOp instances are ops like
    # any.
    assert {
        "all_reduce neg view",
        "all_reduce conj view",
        "all_reduce nested",
        "all_reduce jagged",
        "all_reduce PREMUL_SUM",
        "gather neg tensor",
    } <= refused
    assert {"all_reduce MAX instance", "reduce_scatter MAX instance"} <= accepted
