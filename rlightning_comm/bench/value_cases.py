"""Bench cases of the collectives of Python values: ``all_reduce_dict`` and ``broadcast_object_list``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import collective
from rlightning_comm.bench._case import Case, _data, _mismatch


class AllReduceDict(Case):
    """Tensor values only; raw is what a user would write by hand: cat, one all_reduce, split."""

    def setup(self, size: int, dict_keys: int) -> None:
        count = size // self.itemsize
        self.elements, self.nbytes = count, count * self.itemsize
        keys = [f"k{i:06d}" for i in range(min(dict_keys, count))]  # sorted == insertion order
        self.dicts = (
            [dict(zip(keys, self.data(count, self.grank, p).tensor_split(len(keys)))) for p in (0, 1)] if count else []
        )
        self.expected = (
            [
                dict(zip(keys, sum(self.data(count, r, p) for r in range(self.n)).tensor_split(len(keys))))
                for p in (0, 1)
            ]
            if count
            else []
        )
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

    The raw side is ``torch.distributed.broadcast_object_list``, which needs numpy to receive: without numpy the sweep
    skips this op and says why.
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
        return int(
            (
                torch.frombuffer(bytearray(got), dtype=torch.uint8)
                != torch.frombuffer(bytearray(expected), dtype=torch.uint8)
            ).sum()
        )

    def corrupt(self) -> None:
        self.objects[0] = b""
