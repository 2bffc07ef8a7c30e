"""The GPU check's ops: every library op as a cell function ``op(case) -> checks``, and the table the matrix runs.

Each op builds its inputs from the case (every rank's are known to every rank), calls the library (the facades, a
communicator method where no facade exists, the sequence-parallel ops, weight transfer), and returns what to compare
against the oracle. Roots are global ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from rlightning_comm import CommContext, broadcast_state_dict, collective
from rlightning_comm import sequence_parallel as sp

from ._case import GRAD_DTYPES, SP_MODE, Case, Check, combine
from ._cells import NotApplicable


def _all_reduce(op: Any) -> Callable[[Case], list[Check]]:
    def run(c: Case) -> list[Check]:
        seed = (lambda j: 0) if op == ReduceOp.AVG else (lambda j: j)  # AVG of identical values: exact for every dtype
        t = c.put(c.value(seed(c.glob), 12))
        c.done(collective.all_reduce(t, c.mode, op=op, async_op=c.async_))
        return [("tensor", t, combine([c.value(seed(j), 12) for j in c.ranks], op))]

    return run


def _all_gather(c: Case) -> list[Check]:
    want = torch.cat([c.value(j, 4) for j in c.ranks])
    out = c.poison(want)
    c.done(collective.all_gather(out, c.put(c.value(c.glob, 4)), c.mode, async_op=c.async_))
    return [("output", out, want)]


def _reduce_scatter(c: Case) -> list[Check]:
    full = combine([c.value(j, 4 * c.n) for j in c.ranks])
    want = full[4 * c.me : 4 * c.me + 4]
    out = c.poison(want)
    c.done(collective.reduce_scatter(out, c.put(c.value(c.glob, 4 * c.n)), c.mode, async_op=c.async_))
    return [("output", out, want)]


def _all_to_all_single(uneven: bool) -> Callable[[Case], list[Check]]:
    def run(c: Case) -> list[Check]:
        size = (lambda j, i: i + j + 1) if uneven else (lambda j, i: 2)  # elements group rank j sends to group rank i
        inputs = {j: c.value(c.ranks[j], sum(size(j, i) for i in range(c.n))) for j in range(c.n)}

        def piece(j: int, i: int) -> torch.Tensor:
            at = sum(size(j, k) for k in range(i))
            return inputs[j][at : at + size(j, i)]

        want = torch.cat([piece(j, c.me) for j in range(c.n)])
        out = c.poison(want)
        splits = ([size(j, c.me) for j in range(c.n)], [size(c.me, i) for i in range(c.n)]) if uneven else (None, None)
        c.done(c.comm.all_to_all_single(out, c.put(inputs[c.me]), splits[0], splits[1], async_op=c.async_))
        return [("output", out, want)]

    return run


def _broadcast(c: Case) -> list[Check]:
    t = c.put(c.value(c.glob, 6))
    c.done(collective.broadcast(t, c.mode, src=c.root, async_op=c.async_))
    return [("tensor", t, c.value(c.root, 6))]


def _reduce(c: Case) -> list[Check]:
    t = c.put(c.value(c.glob, 6))
    c.done(collective.reduce(t, c.mode, dst=c.root, async_op=c.async_))
    return [("root's tensor", t, combine([c.value(j, 6) for j in c.ranks]))] if c.glob == c.root else []


def _gather(c: Case) -> list[Check]:
    wants = [c.value(j, 3) for j in c.ranks]
    outs = [c.poison(w) for w in wants] if c.glob == c.root else None
    c.done(collective.gather(c.put(c.value(c.glob, 3)), c.mode, gather_list=outs, dst=c.root, async_op=c.async_))
    return [(f"gather_list[{j}]", o, w) for j, (o, w) in enumerate(zip(outs or [], wants))]


def _scatter(c: Case) -> list[Check]:
    parts = [c.value(100 + j, 3) for j in range(c.n)]
    out = c.poison(parts[c.me])
    lst = [c.put(p) for p in parts] if c.glob == c.root else None
    c.done(collective.scatter(out, c.mode, scatter_list=lst, src=c.root, async_op=c.async_))
    return [("output", out, parts[c.me])]


def _peers(c: Case) -> list[int]:
    if c.n == 1:
        raise NotApplicable("a point-to-point call needs a peer: world size 1")
    return [j for j in c.ranks if j != c.root]


def _send(c: Case) -> list[Check]:
    """The root sends to every other member, in group order; each receives."""
    peers = _peers(c)
    if c.glob == c.root:
        for peer in peers:
            c.done(collective.send(c.put(c.value(c.root, 5)), c.mode, peer, async_op=c.async_))
        return []
    buf = c.poison(c.value(c.root, 5))
    c.done(collective.recv(buf, c.mode, c.root, async_op=c.async_))
    return [("received", buf, c.value(c.root, 5))]


def _recv(c: Case) -> list[Check]:
    """The root receives from every other member, in group order; each sends."""
    peers = _peers(c)
    if c.glob != c.root:
        c.done(collective.send(c.put(c.value(c.glob, 5)), c.mode, c.root, async_op=c.async_))
        return []
    checks = []
    for peer in peers:
        buf = c.poison(c.value(peer, 5))
        c.done(collective.recv(buf, c.mode, peer, async_op=c.async_))
        checks.append((f"from {peer}", buf, c.value(peer, 5)))
    return checks


def _barrier(c: Case) -> list[Check]:
    collective.barrier(c.mode)
    return []


def _all_reduce_dict(c: Case) -> list[Check]:
    got = collective.all_reduce_dict({"count": c.glob + 1, "t": c.put(c.value(c.glob, 5))}, c.mode, dtype=c.dtype)
    count = (
        True if c.dtype is torch.bool else sum(j + 1 for j in c.ranks)
    )  # the numbers are reduced in the dtype asked for
    return [
        ("t", got["t"], combine([c.value(j, 5) for j in c.ranks])),
        ("count", got["count"] == count, f"count: got {got['count']!r}, want {count}"),
    ]


def _object_checks(label: str, got: Any, source: int, c: Case) -> list[Check]:
    if not (isinstance(got, dict) and got.get("from") == source and isinstance(got.get("t"), torch.Tensor)):
        return [(label, False, f"{label}: got {got!r}")]
    return [
        (label, got["t"], c.value(source, 3)),
        (f"{label} device", got["t"].device == c.device, f"{label}: tensor on {got['t'].device}"),
    ]


def _broadcast_object_list(c: Case) -> list[Check]:
    objs: list[Any] = [{"from": c.root, "t": c.put(c.value(c.root, 3))}, "text"] if c.glob == c.root else [None, None]
    collective.broadcast_object_list(objs, c.mode, src=c.root)
    return [*_object_checks("object", objs[0], c.root, c), ("text", objs[1] == "text", f"got {objs[1]!r}")]


def _all_gather_object(c: Case) -> list[Check]:
    out: list[Any] = [None] * c.n
    collective.all_gather_object(out, {"from": c.glob, "t": c.put(c.value(c.glob, 3))}, c.mode)
    return [check for j, got in zip(c.ranks, out) for check in _object_checks(f"from {j}", got, j, c)]


def _state(c: Case, seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every kind a transfer handles: in place (bucket 4 KiB), bucketed, on the host, a transposed view."""
    return {
        "big": c.put(c.value(seed, 3000)),
        "small": c.put(c.value(seed + 1, 7)),
        "host": c.value(seed + 2, 9),
        "view": c.put(c.value(seed + 3, 24).reshape(4, 6)).t(),
    }


BETWEEN = "BETWEEN"
"""A gloo group over the whole world: what may run while an async transfer is in flight on any backend (docs: on
NCCL no other NCCL group before ``wait()``; with broadcasts, not this mode)."""


def _between(c: Case) -> None:
    """A collective on a gloo group while an async transfer is in flight (the group made on first use, by every
    rank)."""
    ctx = CommContext()
    if BETWEEN not in ctx.bound_modes():
        ctx.init_group(list(range(dist.get_world_size())), BETWEEN, use_cpu=True)
    collective.all_reduce(torch.ones(2), BETWEEN)


def _broadcast_state_dict(c: Case) -> list[Check]:
    state = _state(c, c.root if c.glob == c.root else 50 + c.glob)
    want = {name: t.detach().cpu().clone() for name, t in _state(c, c.root).items()}
    devices = {name: t.device for name, t in state.items()}
    handle = broadcast_state_dict(state, c.mode, src=c.root, bucket_bytes=4096, async_op=c.async_)
    if c.async_:
        _between(c)
    c.done(handle)
    moved = [name for name, t in state.items() if t.device != devices[name]]
    return [*((name, state[name], want[name]) for name in want), ("devices kept", not moved, f"moved: {moved}")]


def _broadcast_state_dict_load(c: Case) -> list[Check]:
    """Destinations pass a ``load`` callable (vLLM's ``load_weights`` shape): every name once, contiguous, on the
    communicator's device."""
    want = {name: t.detach().cpu().clone() for name, t in _state(c, c.root).items()}
    got: dict[str, torch.Tensor] = {}
    seen: list[str] = []
    places: set[str] = set()

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            seen.append(name)
            places.add(f"{t.device} {'contiguous' if t.is_contiguous() else 'strided'}")
            got[name] = t.detach().cpu().clone()  # the tensors are views of a buffer, valid during the call only

    source = c.glob == c.root
    handle = broadcast_state_dict(
        _state(c, c.root) if source else load, c.mode, src=c.root, bucket_bytes=4096, async_op=c.async_
    )
    if c.async_:
        _between(c)
    c.done(handle)
    if source:
        return []
    where = {f"{c.comm.device} contiguous"}
    return [
        *((name, got.get(name), want[name]) for name in want),
        ("every name once", sorted(seen) == sorted(want), f"load was given {seen}"),
        ("on the device, contiguous", places <= where, f"load's tensors: {sorted(places)}, want {sorted(where)}"),
    ]


def _sp_full(c: Case) -> torch.Tensor:
    return c.value(7, 2 * 3 * c.n * 2 * c.n * 2).reshape(
        2, 3 * c.n, 2 * c.n, 2
    )  # [batch, seq, heads, head_dim], the same on every rank


def _local(c: Case, full: torch.Tensor) -> torch.Tensor:
    return full[:, 3 * c.me : 3 * c.me + 3].contiguous()


def _differentiable(c: Case, x: torch.Tensor) -> torch.Tensor:
    return x.requires_grad_(True) if c.dtype in GRAD_DTYPES else x


def _sp(name: str) -> Callable[[Case], list[Check]]:
    """A sequence-parallel op on the SEQUENCE_PARALLEL group (forward against the oracle; backward where
    differentiable)."""

    def run(c: Case) -> list[Check]:
        full = _sp_full(c)
        if name == "all_to_all":
            x, want = _local(c, full), full[:, :, 2 * c.me : 2 * c.me + 2]
            fn = lambda t: sp.all_to_all(t, 1, 2, SP_MODE)
        elif name == "scatter_to_sequence_parallel_region":
            x, want = full, _local(c, full)
            fn = lambda t: sp.scatter_to_sequence_parallel_region(t, False)
        elif name == "reduce_scatter_to_sequence_parallel_region":
            x, want = (
                c.value(c.glob, full.numel()).reshape(full.shape),
                _local(c, combine([c.value(j, full.numel()).reshape(full.shape) for j in c.ranks])),
            )
            fn = sp.reduce_scatter_to_sequence_parallel_region
        else:
            x, want = _local(c, full), full
            fn = (
                (lambda t: sp.gather_from_sequence_parallel_region(t, False))
                if name.startswith("gather")
                else sp.all_gather_from_sequence_parallel_region
            )
        x = _differentiable(c, c.put(x))
        y = fn(x)
        checks: list[Check] = [("forward", y, want)]
        if x.requires_grad:
            y.backward(torch.ones_like(y))
            grad = x.grad
            checks.append(
                (
                    "grad",
                    grad is not None and grad.shape == x.shape and grad.device == x.device,
                    f"grad: {None if grad is None else (grad.shape, grad.device)}",
                )
            )
            if name == "all_to_all":  # the inverse all-to-all of ones is ones
                checks.append(("grad values", grad, torch.ones(x.shape, dtype=c.dtype)))
        return checks

    return run


def _ulysses(c: Case) -> list[Check]:
    if c.dtype not in GRAD_DTYPES:
        raise NotApplicable(f"attention needs a floating dtype it computes in; got {c.dtype}")
    full = c.put(_sp_full(c)) / 4
    want = _local(
        c, sp.sdpa_bshd(full, full, full).cpu()
    )  # single-process attention on the whole sequence, same device and dtype
    local = _local(c, full)
    got = sp.ulysses_attention(local, local, local).detach().cpu()
    tol = 1e-5 if c.dtype is torch.float32 else 2e-2
    close = got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    return [
        (
            "attention",
            close,
            f"max |diff| {float((got.float() - want.float()).abs().max()) if got.shape == want.shape else got.shape}",
        )
    ]


# name -> (function, varies with dtype, takes async_op, the stats op it counts (None: not checked))
OPS: dict[str, tuple[Callable[[Case], list[Check]], bool, bool, str | None]] = {
    "all_reduce": (_all_reduce(ReduceOp.SUM), True, True, "all_reduce"),
    "all_reduce[MAX]": (_all_reduce(ReduceOp.MAX), True, True, "all_reduce"),
    "all_reduce[AVG]": (_all_reduce(ReduceOp.AVG), True, True, "all_reduce"),
    "all_gather": (_all_gather, True, True, "all_gather"),
    "reduce_scatter": (_reduce_scatter, True, True, "reduce_scatter"),
    "all_to_all_single": (_all_to_all_single(False), True, True, "all_to_all_single"),
    "all_to_all_single[uneven]": (_all_to_all_single(True), True, True, "all_to_all_single"),
    "broadcast": (_broadcast, True, True, "broadcast"),
    "reduce": (_reduce, True, True, "reduce"),
    "gather": (_gather, True, True, "gather"),
    "scatter": (_scatter, True, True, "scatter"),
    "send": (_send, True, True, None),
    "recv": (_recv, True, True, None),
    "barrier": (_barrier, False, False, "barrier"),
    "all_reduce_dict": (_all_reduce_dict, True, False, "all_reduce_dict"),
    "broadcast_object_list": (_broadcast_object_list, True, False, "broadcast_object_list"),
    "all_gather_object": (_all_gather_object, True, False, "all_gather_object"),
    "broadcast_state_dict": (_broadcast_state_dict, True, True, None),
    "broadcast_state_dict[load]": (_broadcast_state_dict_load, True, True, None),
    **{f"sp.{name}": (_sp(name), True, False, None) for name in (
        "all_to_all",
        "scatter_to_sequence_parallel_region",
        "gather_from_sequence_parallel_region",
        "all_gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    )},
    "sp.ulysses_attention": (_ulysses, True, False, None),
}  # fmt: skip
