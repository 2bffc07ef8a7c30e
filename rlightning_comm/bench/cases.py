"""One benchmark case per op and size: buffers, the library call, the raw torch.distributed call, the check.

Data are small random integers (0..10) in the bench's dtype, seeded by (group rank, phase, length), so every rank can
compute what every other rank sends and every expected result is exact in every dtype. Two phases with different data
alternate, and outputs are poisoned before each call, so a stale or missing result is a wrong result, not a pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlightning_comm import collective
from rlightning_comm._compat import all_gather_single as _all_gather_flat
from rlightning_comm._compat import reduce_scatter_single as _reduce_scatter_flat
from rlightning_comm.bench._case import _POISON, Case, _context, _mismatch
from rlightning_comm.bench.value_cases import AllReduceDict, BroadcastObjectList, torch_objects_available

__all__ = ["CASES", "Case", "torch_objects_available"]


class AllReduce(Case):
    def setup(self, size: int, dict_keys: int) -> None:
        count = size // self.itemsize
        self.elements, self.nbytes = count, count * self.itemsize
        self.inputs = [self.data(count, self.grank, p) for p in (0, 1)]
        self.expected = [sum(self.data(count, r, p) for r in range(self.n)) for p in (0, 1)]
        self.buf = torch.empty(count, dtype=self.dtype, device=self.device)

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.buf.copy_(self.inputs[phase])

    def facade(self) -> None:
        collective.all_reduce(self.buf, self.mode)

    def raw(self) -> None:
        dist.all_reduce(self.buf, group=self.group)

    def wrong(self) -> int:
        return _mismatch(self.buf, self.expected[self.phase])

    def corrupt(self) -> None:
        self.buf[0] += 1


class AllGather(Case):
    def setup(self, size: int, dict_keys: int) -> None:
        c = size // (self.n * self.itemsize)
        self.elements, self.nbytes = c * self.n, c * self.n * self.itemsize
        self.inputs = [self.data(c, self.grank, p) for p in (0, 1)]
        self.expected = [torch.cat([self.data(c, r, p) for r in range(self.n)]) for p in (0, 1)]
        self.out = torch.empty(c * self.n, dtype=self.dtype, device=self.device)

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.out.fill_(_POISON)

    def facade(self) -> None:
        collective.all_gather(self.out, self.inputs[self.phase], self.mode)

    def raw(self) -> None:
        _all_gather_flat(self.out, self.inputs[self.phase], group=self.group)

    def wrong(self) -> int:
        return _mismatch(self.out, self.expected[self.phase])

    def corrupt(self) -> None:
        self.out[0] += 1


class Broadcast(AllReduce):
    def setup(self, size: int, dict_keys: int) -> None:
        count = size // self.itemsize
        self.elements, self.nbytes = count, count * self.itemsize
        self.expected = [self.data(count, 0, p) for p in (0, 1)]  # the root is group rank 0
        self.buf = torch.empty(count, dtype=self.dtype, device=self.device)

    def prepare(self, phase: int) -> None:
        self.phase = phase
        if self.grank == 0:
            self.buf.copy_(self.expected[phase])
        else:
            self.buf.fill_(_POISON)

    def facade(self) -> None:
        collective.broadcast(self.buf, self.mode, src=self.root)

    def raw(self) -> None:
        dist.broadcast(self.buf, src=self.root, group=self.group)


class Gather(Case):
    def setup(self, size: int, dict_keys: int) -> None:
        c = size // (self.n * self.itemsize)
        self.elements, self.nbytes = c * self.n, c * self.n * self.itemsize
        self.inputs = [self.data(c, self.grank, p) for p in (0, 1)]
        is_root = self.grank == 0
        self.expected = [[self.data(c, r, p) for r in range(self.n)] for p in (0, 1)] if is_root else None
        self.outs = [torch.empty(c, dtype=self.dtype, device=self.device) for _ in range(self.n)] if is_root else None

    def prepare(self, phase: int) -> None:
        self.phase = phase
        for t in self.outs or ():
            t.fill_(_POISON)

    def facade(self) -> None:
        collective.gather(self.inputs[self.phase], self.mode, self.outs, dst=self.root)

    def raw(self) -> None:
        dist.gather(self.inputs[self.phase], self.outs, dst=self.root, group=self.group)

    def wrong(self) -> int:
        if self.outs is None:
            return 0
        return sum(_mismatch(got, exp) for got, exp in zip(self.outs, self.expected[self.phase]))

    def corrupt(self) -> None:
        if self.outs is not None:
            self.outs[-1][0] += 1


class Scatter(Case):
    def setup(self, size: int, dict_keys: int) -> None:
        c = size // (self.n * self.itemsize)
        self.elements, self.nbytes = c * self.n, c * self.n * self.itemsize
        self.lists = [[self.data(c, r, p) for r in range(self.n)] for p in (0, 1)] if self.grank == 0 else None
        self.expected = [self.data(c, self.grank, p) for p in (0, 1)]
        self.out = torch.empty(c, dtype=self.dtype, device=self.device)

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.out.fill_(_POISON)

    def _list(self) -> list[torch.Tensor] | None:
        return self.lists[self.phase] if self.lists is not None else None

    def facade(self) -> None:
        collective.scatter(self.out, self.mode, self._list(), src=self.root)

    def raw(self) -> None:
        dist.scatter(self.out, self._list(), src=self.root, group=self.group)

    def wrong(self) -> int:
        return _mismatch(self.out, self.expected[self.phase])

    def corrupt(self) -> None:
        self.out[0] += 1


class AllToAll(AllGather):
    def setup(self, size: int, dict_keys: int) -> None:
        c = size // (self.n * self.itemsize)  # per-peer chunk
        n, me = self.n, self.grank
        self.elements, self.nbytes = c * n, c * n * self.itemsize
        self.inputs = [self.data(c * n, me, p) for p in (0, 1)]
        self.expected = [torch.cat([self.data(c * n, r, p)[me * c : (me + 1) * c] for r in range(n)]) for p in (0, 1)]
        self.out = torch.empty(c * n, dtype=self.dtype, device=self.device)

    def facade(self) -> None:
        # No module-level facade for all_to_all_single: resolve the mode the way the facades do.
        _context.get_communicator(self.mode).all_to_all_single(self.out, self.inputs[self.phase])

    def raw(self) -> None:
        dist.all_to_all_single(self.out, self.inputs[self.phase], group=self.group)


class ReduceScatter(AllReduce):
    def setup(self, size: int, dict_keys: int) -> None:
        c = size // (self.n * self.itemsize)  # per-rank output
        self.elements, self.nbytes = c * self.n, c * self.n * self.itemsize
        self.inputs = [self.data(c * self.n, self.grank, p) for p in (0, 1)]
        me = self.grank
        self.expected = [sum(self.data(c * self.n, r, p) for r in range(self.n))[me * c : (me + 1) * c] for p in (0, 1)]
        self.buf = torch.empty(c, dtype=self.dtype, device=self.device)

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.buf.fill_(_POISON)

    def facade(self) -> None:
        # No module-level facade for reduce_scatter: resolve the mode the way the facades do.
        _context.get_communicator(self.mode).reduce_scatter(self.buf, self.inputs[self.phase])

    def raw(self) -> None:
        _reduce_scatter_flat(self.buf, self.inputs[self.phase], group=self.group)


class Barrier(Case):
    """No payload: one row per sweep, whatever the sizes."""

    payload = False

    def setup(self, size: int, dict_keys: int) -> None:
        self.elements, self.nbytes = 0, 0

    def prepare(self, phase: int) -> None:
        self.phase = phase

    def facade(self) -> None:
        collective.barrier(self.mode)

    def raw(self) -> None:
        dist.barrier(group=self.group)

    def wrong(self) -> int:
        return 0

    def corrupt(self) -> None:
        return None


CASES: dict[str, type[Case]] = {
    "all_reduce": AllReduce,
    "all_gather": AllGather,
    "broadcast": Broadcast,
    "gather": Gather,
    "scatter": Scatter,
    "reduce_scatter": ReduceScatter,
    "all_to_all": AllToAll,
    "all_reduce_dict": AllReduceDict,
    "broadcast_object_list": BroadcastObjectList,
    "barrier": Barrier,
}
"""Op name -> case class."""
