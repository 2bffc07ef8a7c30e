"""What every bench case is: buffers, the library call, the raw torch.distributed call, the check (see
:mod:`.cases`)."""

from __future__ import annotations

from typing import Any

import torch

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

    def __init__(
        self, comm: Communicator, mode: str, size: int, dtype: torch.dtype, device: torch.device, dict_keys: int
    ) -> None:
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
