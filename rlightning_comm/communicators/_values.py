"""The collectives of Python values: ``broadcast_object_list`` and ``all_gather_object`` (pickles), ``all_reduce_dict``
(a dict of numbers and tensors)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ReduceOp

from rlightning_comm._compat import COALESCING
from rlightning_comm.communicators import _objects
from rlightning_comm.communicators._objects import broadcast_objects
from rlightning_comm.communicators._packing import pack

_SUM = ReduceOp.SUM


class ValueCollectives:
    """Mixin of :class:`Communicator`: the collectives whose payloads are Python values, built on the tensor ones."""

    _group: Any
    _mode: str
    _global_rank: int
    _world_size: int
    _ranks: tuple[int, ...]
    _rank: int
    _sync: Any
    device: torch.device
    # Provided by the other mixins: _check_<op>, _coalesced, _exclusive, _run, all_reduce.

    def broadcast_object_list(
        self, object_list: list[Any], src: int = 0, *, safe: bool | None = None, max_bytes: int | None = None
    ) -> None:
        """Broadcast the picklable objects of ``object_list`` from global rank ``src``, in place.

        Every rank passes a list of the same length; receivers' entries are replaced (all of them, or none when a
        payload is refused). The bytes on the wire are those of ``torch.distributed.broadcast_object_list`` whatever the
        options, so the options are each receiver's own choice.

        By default receiving unpickles what ``src`` sent, which can run arbitrary code: only use it within a trusted
        job. With ``safe=True`` a receiver accepts only plain data (None, bool, int, float, str, bytes, and lists,
        tuples and dicts of those, and tensors) and refuses anything else without running any of it.

        Args:
            object_list: On ``src`` the objects to send; elsewhere a list of the same length that receives them.
            src: Global rank that sends.
            safe: Accept only plain data; ``None`` means the context-wide default
                (:meth:`CommContext.set_object_defaults`, off unless set).
            max_bytes: Refuse a payload larger than this many serialised bytes; ``None`` means the context-wide default
                (no limit unless set).

        Raises:
            TypeError: ``object_list`` is not a list, or ``safe`` not a bool.
            ValueError: ``src`` is not a rank of the group, or ``max_bytes`` is not a positive int.
            ObjectRefusedError: (receivers) the payload is not plain data in safe mode or exceeds ``max_bytes``;
                ``object_list`` is left unchanged and the group stays usable.
        """
        group = self._group
        if group is None:
            return
        self._check_broadcast_object_list(object_list, src, safe=safe, max_bytes=max_bytes)
        if (
            group in COALESCING
        ):  # its host reads need the data, which a coalesced call only delivers when the manager exits
            raise self._coalesced("broadcast_object_list")
        safe, max_bytes = _objects.resolve_options(safe, max_bytes, self._mode)
        opts = self._sync.broadcast[operator.index(src)]

        def broadcast(tensor: torch.Tensor) -> None:
            self._run("broadcast_object_list", lambda: group.broadcast([tensor], opts))

        with self._exclusive("broadcast_object_list"):
            payloads = broadcast_objects(object_list, self._global_rank == src, broadcast, self.device)
        if payloads is not None:
            object_list[:] = _objects.decode(payloads, src, safe, max_bytes, self._mode)
        return

    def all_gather_object(
        self, object_list: list[Any], obj: Any, *, safe: bool | None = None, max_bytes: int | None = None
    ) -> None:
        """Gather every rank's picklable ``obj`` into ``object_list``, in group-rank order, on every rank.

        Like ``torch.distributed.all_gather_object`` (``object_list`` has one entry per rank and is filled in place;
        entry ``i`` is group rank ``i``'s object, this rank's own as a copy), with the receivers' options of
        :meth:`broadcast_object_list`: by default it unpickles what peers send, which can run arbitrary code; with
        ``safe=True`` it accepts only plain data from them, and ``max_bytes`` bounds each peer's serialised object. A
        refusal leaves ``object_list`` unchanged and the group usable (every payload was received in full).

        Args:
            object_list: A list of ``world_size`` entries, replaced in place.
            obj: This rank's object.
            safe: Accept only plain data from peers; ``None`` means the context-wide default.
            max_bytes: Refuse a peer's object over this many serialised bytes; ``None`` means the default.

        Raises:
            TypeError: ``object_list`` is not a list, ``safe`` not a bool, or ``obj`` cannot be pickled (before anything
                is sent).
            ValueError: ``object_list`` does not have one entry per rank, or ``max_bytes`` is not a positive int.
            ObjectRefusedError: a peer's object is not plain data in safe mode or exceeds ``max_bytes``.
        """
        group = self._group
        if group is None:
            return
        self._check_all_gather_object(object_list, obj, safe=safe, max_bytes=max_bytes)
        if group in COALESCING:
            raise self._coalesced("all_gather_object")
        safe, max_bytes = _objects.resolve_options(safe, max_bytes, self._mode)
        try:
            payload = _objects.dumps(obj)
        except Exception as err:  # pickle raises many kinds (PicklingError, TypeError, AttributeError)
            raise TypeError(
                f"all_gather_object on mode {self._mode!r}: obj cannot be pickled ({err}); nothing was sent"
            ) from err
        opts = self._sync.all_gather

        def gather(output: torch.Tensor, input_: torch.Tensor) -> None:
            self._run("all_gather_object", lambda: group.all_gather_single(output, input_, opts))

        with self._exclusive("all_gather_object"):
            payloads = _objects.all_gather_payloads(payload, self._world_size, self.device, gather)
        object_list[:] = _objects.decode_gathered(payloads, self._ranks, self._rank, safe, max_bytes, self._mode)

    def all_reduce_dict(
        self, dictionary: Mapping[Any, Any], op: Any = _SUM, dtype: torch.dtype = torch.float32
    ) -> dict[Any, Any] | None:
        """Reduce every value of ``dictionary`` across the group with one collective.

        Values may be real numbers (Python or numpy) or dense real tensors of any shape. They are paired across ranks by
        key, in one total order (``None``, numbers, str, bytes, tuples of those; see
        :mod:`~rlightning_comm.communicators._packing`), whatever order each rank inserted them in, packed into one
        buffer, reduced once and unpacked. Every rank must pass the same keys, with a number or a tensor of the same
        shape under each.

        Args:
            dictionary: Not modified.
            op: A supported ``ReduceOp``.
            dtype: The dtype tensors are returned in. With a floating dtype, a dict holding numbers is reduced in
                float64, so integer counts come back exact within ``2**53``; with an integer dtype everything is reduced
                in it.

        Returns:
            A new dict with the same keys: numbers come back as Python floats (ints for an integer ``dtype``), tensors
            as ``dtype`` tensors of their shape on their device. ``None`` on a non-member.

        Raises:
            TypeError: not a mapping, a key outside the total order, a value that is neither a real number nor a dense
                real tensor, or a ``dtype`` that is not a torch dtype.
            ValueError: a complex ``dtype``, or a reduce op the dtype lacks.
        """
        if self._group is None:
            return None
        self._check_all_reduce_dict(dictionary, op, dtype)
        if self._group in COALESCING:
            raise self._coalesced("all_reduce_dict")
        flat, unpack = pack(dictionary, dtype, self.device, self._mode, checked=True)
        if flat is None:
            return {}
        self.all_reduce(flat, op=op)
        return unpack(flat)
