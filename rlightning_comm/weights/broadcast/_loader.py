"""The data phase of :func:`broadcast_state_dict` on a destination that passed a ``load`` callable.

The destination has no tensors of the source's layout (an inference engine with fused or resharded weights): it learns
names, dtypes and shapes from the source's manifest, receives the plan's units into two buffers in rotation, and calls
``load(named_tensors)`` once per delivery (:func:`._weight_plan.deliveries`: whole layers of at most one bucket, or a
layer larger than a bucket alone) with views of the buffer, valid only during the call. While ``load`` runs on one
buffer the next delivery is received into the other. The source sends exactly what it sends to any
destination: the two kinds of destination mix freely.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from rlightning_comm.weights.broadcast._plan import Delivery, Plan
from rlightning_comm.weights.broadcast._transport import Transfer
from rlightning_comm.weights.core._staging import dtype_of


class LoadPipeline(Transfer):
    """Runs a :class:`Plan` on a destination into two rotating buffers, handing each delivery to ``load``.

    Args:
        comm, plan, src, slots, sends: as for :class:`Transfer` (this rank is a destination).
        load: Called once per delivery with a list of ``(name, tensor)``.
        deliveries: The plan's deliveries (:func:`._plan.deliveries`).
        route: In a chain, this leaf's route (the source, no successors): it receives the units cut as the chain's.
    """

    def __init__(
        self,
        comm: Any,
        plan: Plan,
        load: Callable[[list[tuple[str, torch.Tensor]]], Any],
        src: int,
        slots: list[torch.Tensor | None],
        sends: bool,
        deliveries: tuple[Delivery, ...],
        route: tuple[int | None, list[int]] | None = None,
    ) -> None:
        super().__init__(comm, plan, src, False, slots, sends, route)
        self._load = load
        self._deliveries = deliveries
        self._floors = [max((d.nbytes for d in deliveries[k::2]), default=0) for k in (0, 1)]
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0  # the next delivery to receive
        self._given = 0  # deliveries received and done with
        self._loaded = 0  # load calls that returned
        self._error: tuple[Exception, int] | None = (
            None  # what load raised, on which bucket; the rest is received and dropped
        )

    def _left(self) -> str:
        total = len(self._deliveries)
        return (
            f"load had been given {self._loaded} of {total} buckets (the tensors of those were loaded, the others "
            "were not)"
        )

    def _receive(self) -> bool:
        """Post every unit of the next delivery into its free buffer; ``False`` when both are taken or none is left."""
        k = self._next
        if k == len(self._deliveries) or k - self._given >= 2:
            return False
        delivery, slot = self._deliveries[k], k % 2
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < delivery.nbytes:
            self._slots[slot] = None  # free the old one first
            buffer = self._slots[slot] = torch.empty(
                max(delivery.nbytes, self._floors[slot]), dtype=torch.uint8, device=self._device
            )
        self._buffers[slot] = buffer
        units = self._plan.units
        for index, at in zip(delivery.units, delivery.offsets):
            self._launch(buffer[at : at + units[index].nbytes], slot, index, None)
        self._next += 1
        return True

    def _start(self) -> None:
        while self._receive():
            pass
        self._tell_source()

    def _arrive(self, entry: tuple[list[Any], int, int, Any]) -> None:
        self._wait(entry[0])
        self._received(entry[2])

    def _finish(self) -> None:
        self._start()
        manifest = self._plan.manifest
        while self._given < len(self._deliveries):
            delivery = self._deliveries[self._given]
            for _ in delivery.units:
                self._arrive(self._pending.popleft())
            buffer = self._buffers[self._given % 2]
            if self._error is None:
                named = []
                for index, at in delivery.tensors:
                    name, dtype, shape, _ = manifest[index]
                    dtype = dtype_of(dtype)
                    nbytes = dtype.itemsize * math.prod(shape)
                    named.append((name, buffer[at : at + nbytes].view(dtype).view(shape)))
                try:
                    self._load(named)
                    self._loaded += 1
                except Exception as err:  # noqa: BLE001 - raised once the transfer is complete, so the group stays in step
                    self._error = (err, self._given + 1)
                del named
            self._given += 1
            self._receive()
        self._drain(self._arrive)
        if self._error is not None:
            (err, bucket), self._error = self._error, None
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(
                    f"broadcast_state_dict: load raised on bucket {bucket} of {len(self._deliveries)}; the transfer "
                    "completed "
                    "(the later buckets were received and dropped), so the group is still in step"
                )
            raise err
