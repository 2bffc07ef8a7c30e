"""The data phase of :func:`broadcast_state_dict` for tensors loaded in place: the pipeline that runs a plan.

The plan (:mod:`._weight_plan`) is a pure function of the source's manifest and bucket size, so every rank issues the
same transfers in the same order (:mod:`._weight_transport` says how each moves). A unit of one piece is moved in place
(no copy) wherever the piece is contiguous on the communicator's device and holds its values as they read (no lazy
conjugate or negation: those are staged, read and written through their logical values). Two bucket buffers per rank
rotate: packing (or unpacking) one bucket overlaps the transfer of the other, and in-place transfers run meanwhile.

Staging on a device (NCCL) with tensors on the host goes through a pinned host buffer per staging buffer: one
host-to-device copy per bucket on the source, one device-to-host copy per bucket on a destination (then the host pieces
are copied out on the host), instead of one synchronous copy per piece.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlightning_comm.weights.broadcast._plan import Plan, Unit
from rlightning_comm.weights.broadcast._transport import Transfer
from rlightning_comm.weights.core._checks import plain, same_view
from rlightning_comm.weights.core._staging import copy_pieces, dtype_of


def _view(tensor: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
    return tensor[where] if where else tensor


class Pipeline(Transfer):
    """Runs a :class:`Plan` on one rank, reading (source) or writing (destination) ``tensors`` in place.

    Args:
        comm, plan, src, is_source, slots, sends: as for :class:`Transfer`.
        tensors: This rank's tensors, in the plan's order.
        mirrors: Two pinned host buffers kept across calls, for host tensors when the staging buffers live on a device.
    """

    def __init__(
        self,
        comm: Any,
        plan: Plan,
        tensors: list[torch.Tensor],
        src: int,
        is_source: bool,
        slots: list[torch.Tensor | None],
        sends: bool,
        mirrors: list[Any] | None = None,
        route: tuple[int | None, list[int]] | None = None,
    ) -> None:
        super().__init__(comm, plan, src, is_source, slots, sends, route)
        self._tensors: list[torch.Tensor] | None = tensors
        self._mirrors = mirrors if mirrors is not None else [None, None]
        self._next_slot = 0
        self._next_unit = 0
        self._arrived = 0  # units received and written here
        self._written = False  # whether any byte of this destination's tensors may have changed
        self.digests: Any = None  # a Digests fed with every piece's bytes as they pass (verify=True)
        self.staging = False  # the tensors are an atomic sync's staging, not the live weights
        # Inference tensors (a model built under torch.inference_mode) take in-place writes only inside it.
        self._writes = (
            torch.inference_mode if not is_source and any(t.is_inference() for t in tensors) else contextlib.nullcontext
        )

    def _left(self) -> str:
        units = len(self._plan.units)
        if self.staging:
            return (
                f"this destination received into staging ({self._arrived} of {units} units had arrived); its live "
                "tensors were not written"
            )
        if not self._written:
            return f"this destination's tensors were not written ({self._arrived} of {units} units had arrived)"
        if not self._arrived:
            return (
                f"this destination's tensors may be partly written: receives were posted straight into them, and none "
                f"of the {units} units had completed; they may hold a mix of old and new weights until a transfer "
                "succeeds"
            )
        return (
            f"this destination's tensors were partly written ({self._arrived} of {units} units had arrived): "
            "they hold a mix of old and new weights until a transfer succeeds"
        )

    def _in_place(self, unit: Unit) -> torch.Tensor | None:
        """The piece's own memory when it can be moved without a copy here (plain, on the communicator's device).

        A send moves bytes whatever the dtype, so over gloo the piece goes as it is; a broadcast gets its bytes
        (``uint8``), which any backend takes.
        """
        if not unit.direct:
            return None
        piece = unit.pieces[0]
        view = _view(self._tensors[piece.index], piece.where)
        if not plain(view):
            return None
        if self._sends:
            return view if view.is_cpu else None
        if view.device != self._device:
            return None
        return view.reshape(-1).view(torch.uint8)

    def _mirror(self, slot: int, nbytes: int) -> torch.Tensor:
        """Pinned host buffer ``slot``'s first ``nbytes`` bytes, once the device has read what was put there last."""
        kept = self._mirrors[slot]
        if kept is None or kept[0].numel() < nbytes:
            self._mirrors[slot] = None
            kept = self._mirrors[slot] = (
                torch.empty(max(nbytes, self._plan.slot_bytes), dtype=torch.uint8, pin_memory=True),
                None,
            )
        if kept[1] is not None:
            kept[1].synchronize()
        return kept[0][:nbytes]

    def _stage(self, staged: torch.Tensor, unit: Unit, slot: int, pack: bool) -> None:
        """Copy every piece of ``unit`` into ``staged`` (``pack``) or out of it."""
        tensors = self._tensors
        views = [(piece, _view(tensors[piece.index], piece.where)) for piece in unit.pieces]
        if staged.is_cpu:
            copy_pieces(staged, views, pack)
            return
        on_host = [pv for pv in views if pv[1].is_cpu]
        if on_host:
            views = [pv for pv in views if not pv[1].is_cpu]
            mirror = self._mirror(slot, staged.numel())
            if pack:  # the host pieces into the pinned buffer, then one copy to the device (then the device pieces)
                copy_pieces(mirror, on_host, True)
                staged.copy_(mirror, non_blocking=True)
                event = torch.Event(device=staged.device)
                event.record()
                self._mirrors[slot] = (self._mirrors[slot][0], event)
        copy_pieces(staged, views, pack)
        if on_host and not pack:  # one copy to the pinned buffer, wait for it, then the host pieces out of it
            mirror.copy_(staged, non_blocking=True)
            event = torch.Event(device=staged.device)
            event.record()
            event.synchronize()
            copy_pieces(mirror, on_host, False)

    def _slot(self, nbytes: int, block: bool) -> torch.Tensor | None:
        """A free staging buffer's first ``nbytes`` bytes; waits for the older unit that holds it unless not
        ``block``."""
        slot = self._next_slot
        while any(entry[1] == slot for entry in self._pending):
            if not block:
                return None
            self._complete(self._pending.popleft())
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < nbytes:
            self._slots[slot] = None  # free the old one first
            buffer = self._slots[slot] = torch.empty(
                max(nbytes, self._plan.slot_bytes), dtype=torch.uint8, device=self._device
            )
        self._next_slot = 1 - slot
        return buffer[:nbytes]

    def _complete(self, entry: tuple[list[Any], int, int, torch.Tensor | None]) -> None:
        works, slot, unit, staged = entry
        forward = None
        if self._relay and self._peers and not self._is_source:  # a relay: each chunk sent on as it arrives
            data = staged if staged is not None else self._in_place(self._plan.units[unit])
            forward = self._forward(works, data, unit)
        else:
            self._wait(works)  # on the source over gloo, a bucket's receipts come first: see _transport
        self._received(unit)
        if not self._is_source:
            self._feed(self._plan.units[unit], staged)
        if staged is not None and not self._is_source:
            self._written = True
            with self._writes():
                self._stage(staged, self._plan.units[unit], slot, pack=False)
        if forward is not None:
            if staged is None:
                self._forwards.append(forward)
            else:
                self._wait(forward, sent=True)  # the buffer is free once the successors have its bytes
        if staged is not None and self.digests is not None:
            self.digests.settle()  # the buffer is free once its digest parts are computed
        self._arrived += 1

    def _feed(self, unit: Unit, staged: torch.Tensor | None) -> None:
        """Feed the digests (``verify=True``) with the unit's bytes as they travel: the bucket's, or the piece's own."""
        digests = self.digests
        if digests is None:
            return
        manifest = self._plan.manifest
        for piece in unit.pieces:
            if staged is not None:
                data = staged[piece.at : piece.at + piece.nbytes]
            else:
                data = _view(self._tensors[piece.index], piece.where)
            digests.update_piece(piece.index, data, piece.where, dtype_of(manifest[piece.index][1]))

    def _step(self, block: bool) -> bool:
        """Launch the next unit; ``False`` when it needs a busy buffer and ``block`` is off, or when none is left."""
        index = self._next_unit
        if index == len(self._plan.units):
            return False
        unit = self._plan.units[index]
        data = self._in_place(unit)
        staged = None
        slot = -1
        if data is None:
            slot = self._next_slot
            staged = self._slot(unit.nbytes, block)
            if staged is None:
                return False
            if self._is_source:
                self._stage(staged, unit, slot, pack=True)
            data = staged
        elif not self._is_source:
            self._written = True  # received straight into the tensor: written as the bytes arrive
        if self._is_source:
            self._feed(unit, staged)
        self._launch(data, slot, index, staged)
        self._next_unit += 1
        return True

    def _start(self) -> None:
        """Launch every unit that needs no wait: all in-place pieces up to the third bucket, and the first two
        buckets."""
        while self._step(block=False):
            pass
        self._tell_source()

    def _finish(self) -> None:
        """Launch the rest, wait for everything, unpack on a destination and fill the aliases."""
        if self._from is not None:
            self._start()  # a destination tells its predecessor before it waits for anything
        self._wait_source_posted()  # every successor's receives are posted: gloo writes each send from this thread
        self._start()
        while self._step(block=True):
            pass
        self._drain(self._complete)
        if not self._is_source:
            tensors = self._tensors
            with self._writes():
                for index, alias in self._plan.aliases:
                    mine, theirs = tensors[index], tensors[alias]
                    if not same_view(mine, theirs):
                        self._written = True
                        mine.copy_(theirs)
        self._tensors = None  # drop the references
