"""The GPU check's op matrix: every library op x dtype x sync/async x plain/stats/debug mode, each against an oracle.

Written for any group (world size 1 on NCCL, 2 NCCL ranks, 4 gloo ranks with
CUDA tensors, gloo on the CPU as a self-test), any root and any device: the
inputs of every rank are a pure function of its global rank, so each rank
computes on the CPU, in a wide dtype, what every result must be, and compares
bytes. Roots are global ranks; a non-zero one is what multi-rank runs use.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _gpu_cells import NotApplicable, Recorder
from torch.distributed import ReduceOp

from rlightning_comm import CommContext, broadcast_state_dict, collective
from rlightning_comm import sequence_parallel as sp

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
CALLS = ("sync", "async")
MODES = ("plain", "stats", "debug")
SP_MODE = "SEQUENCE_PARALLEL"
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Case:
    """One cell's configuration on this rank: the mode's group, the device, the dtype, the root, sync or async."""

    def __init__(self, mode: str, device: torch.device, dtype: torch.dtype, root: int, call: str) -> None:
        self.mode = mode
        self.comm = CommContext().get_communicator(mode)
        self.ranks = list(self.comm.ranks)
        self.n = len(self.ranks)
        self.me = self.comm.rank  # group rank
        self.glob = self.ranks[self.me]
        self.device = device
        self.dtype = dtype
        self.root = root
        self.async_ = call == "async"

    def value(self, seed: int, numel: int) -> torch.Tensor:
        """Rank ``seed``'s input on the CPU: small integers (0..4), exact in every dtype, and their sums over 4 ranks too."""
        a = (torch.arange(numel) * 3 + seed) % 5
        if self.dtype is torch.bool:
            return a % 2 == 1
        if self.dtype.is_complex:
            return torch.complex(a.double(), ((a + 2) % 5).double()).to(self.dtype)
        return a.to(self.dtype)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def poison(self, want: torch.Tensor) -> torch.Tensor:
        """An output buffer on the device that differs from ``want`` everywhere, so a missing write shows."""
        bad = ~want if want.dtype is torch.bool else (widen(want) + 1).to(want.dtype)
        return self.put(bad)

    def done(self, handle: Any) -> None:
        """Wait for an async call's handle (which must exist); a sync call returns ``None``."""
        if self.async_:
            if handle is None:
                raise AssertionError("an async_op=True call returned no handle")
            handle.wait()


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype where sums of small integers are exact: complex128, float64 or int64 (bool as 0/1)."""
    if t.is_complex():
        return t.to(torch.complex128)
    if t.dtype is torch.bool or not t.is_floating_point():
        return t.to(torch.int64)
    return t.to(torch.float64)


def combine(values: Sequence[torch.Tensor], op: Any = ReduceOp.SUM) -> torch.Tensor:
    """The oracle of a reduction of ``values`` (CPU, any dtype): SUM (bool: any), MAX, or AVG of identical values."""
    wide = torch.stack([widen(v) for v in values])
    if op == ReduceOp.MAX:
        out = wide.amax(0)
    elif op == ReduceOp.AVG:
        out = wide.sum(0) / len(values)
    else:
        out = wide.sum(0)
    return (out != 0) if values[0].dtype is torch.bool else out.to(values[0].dtype)


def _show(t: torch.Tensor) -> list[Any]:
    flat = t.detach().reshape(-1)[:6].cpu()
    if flat.dtype is torch.bool:
        return [f"byte {b}" for b in flat.view(torch.uint8).tolist()]  # a bool tensor can hold bytes other than 0 and 1
    return flat.to(torch.complex128 if flat.is_complex() else torch.float64).tolist()


def compare(label: str, got: Any, want: torch.Tensor) -> str | None:
    """What differs between ``got`` and ``want`` (dtype, shape, bytes), or ``None`` when they are identical."""
    if not isinstance(got, torch.Tensor):
        return f"{label}: got {type(got).__name__}, not a tensor"
    host = got.detach().cpu()
    if host.dtype != want.dtype or tuple(host.shape) != tuple(want.shape):
        return f"{label}: got {host.dtype} {list(host.shape)}, want {want.dtype} {list(want.shape)}"
    if host.numel() and not torch.equal(host.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
        return f"{label}: got {_show(host)}, want {_show(want)}"
    return None


# ------------------------------------------------------------------ the ops
# Each takes a Case and returns what to check: (label, tensor, oracle) or (label, passed, detail).
Check = tuple[str, Any, Any]


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
    count = sum(j + 1 for j in c.ranks)
    return [("t", got["t"], combine([c.value(j, 5) for j in c.ranks])), ("count", got["count"] == count, f"count: got {got['count']!r}, want {count}")]


def _object_checks(label: str, got: Any, source: int, c: Case) -> list[Check]:
    if not (isinstance(got, dict) and got.get("from") == source and isinstance(got.get("t"), torch.Tensor)):
        return [(label, False, f"{label}: got {got!r}")]
    return [(label, got["t"], c.value(source, 3)), (f"{label} device", got["t"].device == c.device, f"{label}: tensor on {got['t'].device}")]


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


def _broadcast_state_dict(c: Case) -> list[Check]:
    state = _state(c, c.root if c.glob == c.root else 50 + c.glob)
    want = {name: t.detach().cpu().clone() for name, t in _state(c, c.root).items()}
    devices = {name: t.device for name, t in state.items()}
    handle = broadcast_state_dict(state, c.mode, src=c.root, bucket_bytes=4096, async_op=c.async_)
    if c.async_:
        collective.all_reduce(c.put(torch.ones(2)), c.mode)  # another collective while the transfer is in flight
    c.done(handle)
    moved = [name for name, t in state.items() if t.device != devices[name]]
    return [*((name, state[name], want[name]) for name in want), ("devices kept", not moved, f"moved: {moved}")]


def _sp_full(c: Case) -> torch.Tensor:
    return c.value(7, 2 * 3 * c.n * 2 * c.n * 2).reshape(2, 3 * c.n, 2 * c.n, 2)  # [batch, seq, heads, head_dim], the same on every rank


def _local(c: Case, full: torch.Tensor) -> torch.Tensor:
    return full[:, 3 * c.me : 3 * c.me + 3].contiguous()


def _differentiable(c: Case, x: torch.Tensor) -> torch.Tensor:
    return x.requires_grad_(True) if c.dtype in _GRAD_DTYPES else x


def _sp(name: str) -> Callable[[Case], list[Check]]:
    """A sequence-parallel op on the SEQUENCE_PARALLEL group (forward against the oracle; backward where differentiable)."""

    def run(c: Case) -> list[Check]:
        full = _sp_full(c)
        if name == "all_to_all":
            x, want = _local(c, full), full[:, :, 2 * c.me : 2 * c.me + 2]
            fn = lambda t: sp.all_to_all(t, 1, 2, SP_MODE)
        elif name == "scatter_to_sequence_parallel_region":
            x, want = full, _local(c, full)
            fn = lambda t: sp.scatter_to_sequence_parallel_region(t, False)
        elif name == "reduce_scatter_to_sequence_parallel_region":
            x, want = c.value(c.glob, full.numel()).reshape(full.shape), _local(c, combine([c.value(j, full.numel()).reshape(full.shape) for j in c.ranks]))
            fn = sp.reduce_scatter_to_sequence_parallel_region
        else:
            x, want = _local(c, full), full
            fn = (lambda t: sp.gather_from_sequence_parallel_region(t, False)) if name.startswith("gather") else sp.all_gather_from_sequence_parallel_region
        x = _differentiable(c, c.put(x))
        y = fn(x)
        checks: list[Check] = [("forward", y, want)]
        if x.requires_grad:
            y.backward(torch.ones_like(y))
            grad = x.grad
            checks.append(
                ("grad", grad is not None and grad.shape == x.shape and grad.device == x.device, f"grad: {None if grad is None else (grad.shape, grad.device)}")
            )
            if name == "all_to_all":  # the inverse all-to-all of ones is ones
                checks.append(("grad values", grad, torch.ones(x.shape, dtype=c.dtype)))
        return checks

    return run


def _ulysses(c: Case) -> list[Check]:
    if c.dtype not in _GRAD_DTYPES:
        raise NotApplicable(f"attention needs a floating dtype it computes in; got {c.dtype}")
    full = c.put(_sp_full(c)) / 4
    want = _local(c, sp.sdpa_bshd(full, full, full).cpu())  # single-process attention on the whole sequence, same device and dtype
    local = _local(c, full)
    got = sp.ulysses_attention(local, local, local).detach().cpu()
    tol = 1e-5 if c.dtype is torch.float32 else 2e-2
    close = got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    return [("attention", close, f"max |diff| {float((got.float() - want.float()).abs().max()) if got.shape == want.shape else got.shape}")]


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
    **{f"sp.{name}": (_sp(name), True, False, None) for name in (
        "all_to_all",
        "scatter_to_sequence_parallel_region",
        "gather_from_sequence_parallel_region",
        "all_gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    )},
    "sp.ulysses_attention": (_ulysses, True, False, None),
}  # fmt: skip


def _verdict(checks: list[Check]) -> tuple[str, str] | None:
    problems = []
    for label, got, want in checks:
        if isinstance(got, bool):
            if not got:
                problems.append(str(want))
        else:
            problem = compare(label, got, want)
            if problem:
                problems.append(problem)
    return ("wrong", "; ".join(problems)[:1500]) if problems else None


def _counted(mode: str, op: str) -> tuple[str, str] | None:
    """Whether stats counted ``op``: an async call's completion may be seen a moment after ``wait()`` (a watcher thread polls works without a future)."""
    for _ in range(40):
        entry = CommContext().stats().get(mode, {}).get(op) or {}
        if entry.get("count", 0) >= 1:
            return None
        time.sleep(0.05)
    return "wrong", f"stats did not count {op} on {mode} within 2 s: {entry}"


def run_cell(c: Case, fn: Callable[[Case], list[Check]], in_mode: str, counted: str | None) -> tuple[str, str] | None:
    """One call of ``fn`` in plain, stats or debug mode; the verdict on its results (and stats' count)."""
    ctx = CommContext()
    if in_mode == "stats":
        ctx.reset_stats()
        ctx.enable_stats()
    elif in_mode == "debug":
        ctx.set_debug(True)
    try:
        verdict = _verdict(fn(c))
        if verdict is None and in_mode == "stats" and counted:
            verdict = _counted(c.mode, counted)
        return verdict
    finally:
        if in_mode == "stats":
            ctx.disable_stats()
            ctx.reset_stats()
        elif in_mode == "debug":
            ctx.set_debug(False)


def run_matrix(
    rec: Recorder,
    mode: str,
    device: torch.device,
    root: int,
    *,
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    calls: Sequence[str] = CALLS,
    modes: Sequence[str] = MODES,
    prefix: str = "",
) -> None:
    """Every cell of ``ops`` x ``dtypes`` x ``calls`` x ``modes`` on ``mode``'s group (SEQUENCE_PARALLEL bound to the same ranks first).

    A cell's name is ``prefix + "op|dtype|call|mode"`` (dtype ``-`` for an op
    without one).
    """
    ctx = CommContext()
    if SP_MODE not in ctx.bound_modes():
        ctx.init_group(list(ctx.get_communicator(mode).ranks), SP_MODE, backend=ctx.get_group_config(mode).backend)
    for op in ops or OPS:
        fn, typed, has_async, counted = OPS[op]
        for dtype_name in (dtypes or DTYPES) if typed else ("-",):
            for call in calls if has_async else ("sync",):
                for in_mode in modes:
                    case = functools.partial(
                        Case, mode, device, DTYPES.get(dtype_name, torch.float32), root, call
                    )  # built inside the cell: its errors are the cell's
                    fields = {"op": op, "dtype": dtype_name, "call": call, "mode": in_mode}
                    rec.run(f"{prefix}{op}|{dtype_name}|{call}|{in_mode}", functools.partial(_cell, case, fn, in_mode, counted), **fields)


def _cell(case: Callable[[], Case], fn: Callable[[Case], list[Check]], in_mode: str, counted: str | None) -> tuple[str, str] | None:
    return run_cell(case(), fn, in_mode, counted)
