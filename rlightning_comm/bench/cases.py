"""One benchmark case per op and size: buffers, the library call, the raw torch.distributed call, the check.

Data are small random integers (0..10) in the bench's dtype, seeded by
(group rank, phase, length), so every rank can compute what every other rank
sends and every expected result is exact in every dtype. Two phases with
different data alternate, and outputs are poisoned before each call, so a
stale or missing result is a wrong result, not a pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import collective
from rlightning_comm._compat import all_gather_single as _all_gather_flat
from rlightning_comm._compat import reduce_scatter_single as _reduce_scatter_flat
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.context import CommContext

_POISON = 100  # outside the 0..10 the data hold, representable in every dtype
_context = CommContext()


def _data(numel: int, grank: int, phase: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1_000_003 * phase + 7_919 * grank + numel)
    return torch.randint(0, 11, (numel,), generator=gen, dtype=dtype).to(device)


def _mismatch(got: Any, expected: torch.Tensor) -> int:
    """Number of wrong elements of ``got`` (every element if it is not even a tensor of the right shape)."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return expected.numel()
    return 0 if torch.equal(got, expected) else int((got != expected).sum())


class Case:
    """Base: subclasses set ``nbytes``/``elements`` and implement the four calls."""

    elements: int = 0
    nbytes: int = 0
    payload: bool = True
    """Whether the op moves data (a case with a payload but no whole element per rank is skipped)."""

    def __init__(self, comm: Communicator, mode: str, size: int, dtype: torch.dtype, device: torch.device, dict_keys: int) -> None:
        self.comm, self.mode, self.dtype, self.device = comm, mode, dtype, device
        self.n, self.grank, self.root, self.group = comm.world_size, comm.rank, comm.ranks[0], comm.group
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.phase = 0
        self.setup(size, dict_keys)

    def data(self, numel: int, grank: int, phase: int) -> torch.Tensor:
        return _data(numel, grank, phase, self.dtype, self.device)

    def setup(self, size: int, dict_keys: int) -> None:
        raise NotImplementedError

    def prepare(self, phase: int) -> None:
        """Reset inputs and poison outputs for a call with ``phase``'s data."""
        raise NotImplementedError

    def facade(self) -> None:
        """The op through the library's public function."""
        raise NotImplementedError

    def raw(self) -> None:
        """The same op through torch.distributed directly."""
        raise NotImplementedError

    def wrong(self) -> int:
        """Wrong elements in this rank's result of the last call."""
        raise NotImplementedError

    def corrupt(self) -> None:
        """Damage this rank's result (the bench's test hook)."""
        raise NotImplementedError


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


class AllReduceDict(Case):
    """Tensor values only; raw is what a user would write by hand: cat, one all_reduce, split."""

    def setup(self, size: int, dict_keys: int) -> None:
        count = size // self.itemsize
        self.elements, self.nbytes = count, count * self.itemsize
        keys = [f"k{i:06d}" for i in range(min(dict_keys, count))]  # sorted == insertion order
        self.dicts = [dict(zip(keys, self.data(count, self.grank, p).tensor_split(len(keys)))) for p in (0, 1)] if count else []
        self.expected = [dict(zip(keys, sum(self.data(count, r, p) for r in range(self.n)).tensor_split(len(keys)))) for p in (0, 1)] if count else []
        self.result: dict[str, Any] = {}

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.result = {}

    def facade(self) -> None:
        self.result = collective.all_reduce_dict(self.dicts[self.phase], self.mode, dtype=self.dtype)

    def raw(self) -> None:
        values = self.dicts[self.phase]
        flat = torch.cat([v.reshape(-1) for v in values.values()])
        dist.all_reduce(flat, group=self.group)
        self.result = dict(zip(values, flat.split([v.numel() for v in values.values()])))

    def wrong(self) -> int:
        expected = self.expected[self.phase]
        return sum(_mismatch(self.result.get(k), v) for k, v in expected.items())

    def corrupt(self) -> None:
        first = next(iter(self.result))
        self.result[first] = self.result[first] + 1


def _to_bytes(t: torch.Tensor) -> bytes:
    # Without numpy (tensor.numpy() needs it): copy into a bytearray through a tensor view of it.
    buf = bytearray(t.numel())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(t.reshape(-1))
    return bytes(buf)


def torch_objects_available() -> bool:
    """Whether torch's own object collectives can receive here (they need numpy; the library's do not)."""
    try:
        torch.zeros(1).numpy()
    except RuntimeError:
        return False
    return True


class BroadcastObjectList(Case):
    """One ``bytes`` object of ``size`` bytes, from the group's first rank.

    The raw side is ``torch.distributed.broadcast_object_list``, which needs
    numpy to receive: without numpy the sweep skips this op and says why.
    """

    def setup(self, size: int, dict_keys: int) -> None:
        self.elements = self.nbytes = size
        self.dtype_name = "bytes"
        self.payloads = [_to_bytes(_data(size, 0, p, torch.uint8, torch.device("cpu"))) for p in (0, 1)]
        self.objects: list[Any] = [None]

    def prepare(self, phase: int) -> None:
        self.phase = phase
        self.objects = [self.payloads[phase] if self.grank == 0 else None]

    def facade(self) -> None:
        collective.broadcast_object_list(self.objects, self.mode, src=self.root)

    def raw(self) -> None:
        dist.broadcast_object_list(self.objects, src=self.root, group=self.group, device=self.comm.device)

    def wrong(self) -> int:
        got, expected = self.objects[0], self.payloads[self.phase]
        if not isinstance(got, bytes) or len(got) != len(expected):
            return len(expected)
        if got == expected:
            return 0
        return int((torch.frombuffer(bytearray(got), dtype=torch.uint8) != torch.frombuffer(bytearray(expected), dtype=torch.uint8)).sum())

    def corrupt(self) -> None:
        self.objects[0] = b""


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
