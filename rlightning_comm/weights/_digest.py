"""Per-tensor digests of a weight sync, computed as the bytes pass, never in a second pass over the model.

A tensor's digest is the SHA-256 of its bytes in row-major order (the
bytes of its logical values, as they travel). The hash is fed in order, one
piece at a time, as each piece is packed on the source or arrives on a
destination: a stream hash does not depend on where the stream is cut, so
the digest does not depend on the bucketing, nor on which member sent which
piece as long as the pieces of one tensor (or one slice) are fed in order.
SHA-256 runs at about 1 GB/s on one core with the SHA extensions. ``hashlib``
releases the GIL while it hashes, so the hashing runs on a thread of its own
(one per sync, in order), overlapped with the transfer where a core is free:
a caller waits for it (:meth:`Digests.settle`) before the bytes it reads are
overwritten.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

EMPTY = hashlib.sha256(b"").hexdigest()


def _buffer(data: torch.Tensor) -> Any:
    """``data``'s bytes as a buffer ``hashlib`` reads without a copy (a host copy first for a device tensor)."""
    flat = data.detach().reshape(-1)
    if not flat.is_cpu:
        flat = flat.cpu()
    if not flat.is_contiguous() or flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg().contiguous()
    return flat.view(torch.uint8).numpy()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a whole tensor (its logical values' bytes in row-major order): what a sync reports for it."""
    t = tensor.detach()
    if t.numel() == 0:
        return EMPTY
    return hashlib.sha256(_buffer(t.contiguous())).hexdigest()


class Digests:
    """Stream hashes, one per tensor (or slice) index, fed in order with :meth:`update`.

    Args:
        names: The name of each index, in the transfer's order.
        aliases: ``(index, index of the tensor it is)``: an alias reports its target's digest (it is never fed).
    """

    def __init__(self, names: Sequence[str], aliases: Sequence[tuple[int, int]] = ()) -> None:
        self._names = tuple(names)
        self._aliases = tuple(aliases)
        self._hashes: dict[int, Any] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    def update(self, index: int, data: torch.Tensor) -> None:
        """Feed the next bytes of tensor ``index`` (a tensor of any dtype; its bytes in row-major order), hashed on the
        digests' thread: ``data`` must hold them until :meth:`settle`."""
        if data.numel() == 0:
            return
        h = self._hashes.get(index)
        if h is None:
            h = self._hashes[index] = hashlib.sha256()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="rlightning_comm-digests")
        self._last = self._worker.submit(h.update, _buffer(data))  # one thread: the updates run in order

    def settle(self) -> None:
        """Wait until every byte fed so far is hashed (their memory may then be reused)."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """Stop the digests' thread (after the hashing queued so far)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def result(self) -> dict[str, str]:
        """Every name's digest (a tensor that was never fed has no bytes: the digest of nothing)."""
        self.settle()
        self.close()
        out = [self._hashes[i].hexdigest() if i in self._hashes else EMPTY for i in range(len(self._names))]
        for index, target in self._aliases:
            out[index] = out[target]
        return dict(zip(self._names, out))


def fingerprint(digests: dict[str, str]) -> list[int]:
    """Two signed 64-bit words that stand for every digest at once (exchanged in place of the full list)."""
    raw = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True)]


def differing(reference: dict[str, str], mine: dict[str, str]) -> list[str]:
    """The names whose digest in ``mine`` is not ``reference``'s, sorted."""
    return sorted(name for name, d in reference.items() if mine.get(name) != d)
