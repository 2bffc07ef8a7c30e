"""The GPU check's cells' configuration and oracles: each rank's inputs, what a reduction of them gives, a byte
comparison.

The inputs of every rank are a pure function of its global rank, so each rank computes on the CPU, in a wide dtype, what
every result must be, and compares
bytes: small integers (0..4) are exact in every dtype, and so are their sums
over 4 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ReduceOp

from rlightning_comm import CommContext

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
SP_MODE = "SEQUENCE_PARALLEL"
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the sequence-parallel cells also run backward in."""


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
        """Rank ``seed``'s input on the CPU: small integers (0..4), exact in every dtype, and their sums over 4 ranks
        too."""
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


Check = tuple[str, Any, Any]
"""What a cell checks: ``(label, tensor, oracle)``, or ``(label, passed, detail)``."""
