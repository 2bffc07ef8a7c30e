"""Object broadcast with torch's wire format, without numpy; a safe mode and a size limit for receivers.

torch.distributed.broadcast_object_list needs numpy on the receiving side. This sends the same two broadcasts (an int64
tensor of pickle sizes, then one uint8 tensor of the concatenated pickles), so peers that call torch's version
interoperate, and receives the bytes straight into a ``bytearray``.

A receiver takes part in both broadcasts whatever it then decides about the bytes, so the sender needs no option and the
group stays in step after a refusal. Safe mode unpickles with :class:`_PlainUnpickler`, which resolves no global except
the few that rebuild a plain tensor (and those through checked, side-effect-free replacements), so nothing a payload
names is ever called; the result is then checked to be plain data.

torch 2.13 pickles a tensor of some dtypes (float8, uint16/32/64, complex32, the bits types) but cannot unpickle it;
:func:`dumps` sends such a tensor as its bytes and a call that rebuilds it, so it arrives instead of failing on the
receivers only.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from rlightning_comm import _compat
from rlightning_comm.errors import ObjectRefusedError


def broadcast_objects(
    object_list: list[Any], is_src: bool, broadcast: Callable[[torch.Tensor], None], device: torch.device
) -> list[memoryview] | None:
    """Broadcast the pickles of ``object_list`` from the source, through ``broadcast`` (the communicator's own launch).

    Args:
        object_list: The objects on the source; a list of the same length elsewhere.
        is_src: Whether this rank sends.
        broadcast: Broadcasts a tensor in place from the source and returns when it has arrived (so the host reads below
            never wait on a collective the communicator did not bound).
        device: Where the payload is staged.

    Returns:
        On a receiver, the ``len(object_list)`` payloads, not unpickled; ``None`` on the source or for an empty list (no
        collective then).
    """
    if not object_list:
        return None
    if is_src:
        payloads = [dumps(obj) for obj in object_list]
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long, device=device)
    else:
        sizes = torch.empty(len(object_list), dtype=torch.long, device=device)
    broadcast(sizes)
    if is_src:
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(device)
    else:
        # Receive into a bytearray (through a tensor view of it on CPU, so no copy at all): bytes(storage) iterates
        # element by element (8 s for 4 MiB), and a parallel copy into fresh pages is slow on a busy host.
        lengths = sizes.tolist()  # one device-to-host copy
        buffer = bytearray(sum(lengths))
        host = (
            torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        )  # frombuffer refuses b""
        data = host if device.type == "cpu" else torch.empty(len(buffer), dtype=torch.uint8, device=device)
    broadcast(data)
    if is_src:
        return None
    if data is not host:
        host.copy_(data)  # one device-to-host copy
    raw = memoryview(buffer)
    received = []
    offset = 0
    for size in lengths:
        received.append(raw[offset : offset + size])
        offset += size
    return received


def all_gather_objects(
    obj: Any,
    group: dist.ProcessGroup,
    device: torch.device,
    gather: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> list[Any]:
    """Every group rank's ``obj``, in group-rank order: torch's ``all_gather_object`` without numpy.

    For the library's own exchanges between trusted ranks: it unpickles what peers send
    (``Communicator.all_gather_object`` decodes the payloads of :func:`all_gather_payloads` with :func:`decode_gathered`
    instead).

    Args:
        obj: This rank's object.
        group: The process group.
        device: Where the payload is staged.
        gather: ``gather(output, input)`` all-gathers flat tensors and returns when they have arrived (a communicator's
            own launch); ``None`` means the group's own ``all_gather_single`` (which works on a group outside torch's
            world too).
    """
    if gather is None:
        opts = AllgatherOptions()

        def gather(
            output: torch.Tensor, input_: torch.Tensor
        ) -> None:  # the group itself: a connected mode's is outside the world
            group.all_gather_single(output, input_, opts).wait()

    return [pickle.loads(p) for p in all_gather_payloads(dumps(obj), group.size(), device, gather)]


def all_gather_payloads(
    payload: bytes, world: int, device: torch.device, gather: Callable[[torch.Tensor, torch.Tensor], None]
) -> list[memoryview]:
    """Every group rank's ``payload`` bytes, in group-rank order: two all-gathers (the sizes, then the bytes padded to
    the longest).

    ``gather(output, input)`` all-gathers flat tensors over the ``world`` ranks and returns once they have arrived.
    """
    sizes = torch.empty(world, dtype=torch.long, device=device)
    gather(sizes, torch.tensor([len(payload)], dtype=torch.long, device=device))
    lengths = sizes.tolist()  # one device-to-host copy for every rank's size
    width = max(lengths)
    padded = bytearray(width)
    padded[: len(payload)] = payload
    mine = torch.frombuffer(padded, dtype=torch.uint8) if width else torch.empty(0, dtype=torch.uint8)
    buffer = bytearray(world * width)
    host = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    if device.type == "cpu":
        gather(host, mine)
    else:
        data = torch.empty(world * width, dtype=torch.uint8, device=device)
        gather(data, mine.to(device))
        host.copy_(data)
    raw = memoryview(buffer)
    return [raw[r * width : r * width + n] for r, n in enumerate(lengths)]


_default_safe = False
_default_max_bytes: int | None = None

_PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict, collections.OrderedDict, torch.Tensor)
_PLAIN_NAMES = "None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor"


def set_defaults(safe: bool, max_bytes: int | None) -> None:
    """Set the process-wide defaults of ``safe`` and ``max_bytes`` (see :meth:`CommContext.set_object_defaults`)."""
    global _default_safe, _default_max_bytes
    _default_safe, _default_max_bytes = _validated(safe, max_bytes)


def get_defaults() -> tuple[bool, int | None]:
    """The process-wide defaults ``(safe, max_bytes)``."""
    return _default_safe, _default_max_bytes


def _validated(safe: Any, max_bytes: Any, mode: str | None = None) -> tuple[bool, int | None]:
    where = "" if mode is None else f" (mode {mode!r})"
    if not isinstance(safe, bool):
        raise TypeError(f"safe must be a bool; got {type(safe).__name__} {safe!r}{where}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None; got {max_bytes!r}{where}")
    return safe, max_bytes


def resolve_options(safe: bool | None, max_bytes: int | None, mode: str) -> tuple[bool, int | None]:
    """Fill ``None`` options from the defaults and validate them."""
    return _validated(
        _default_safe if safe is None else safe, _default_max_bytes if max_bytes is None else max_bytes, mode
    )


def decode(payloads: list[memoryview], src: int, safe: bool, max_bytes: int | None, mode: str) -> list[Any]:
    """Unpickle the payloads ``broadcast_object_list`` received from ``src``, all or none (``max_bytes`` bounds their
    total).

    Raises:
        ObjectRefusedError: over ``max_bytes``, or (safe) not plain data.
    """
    _bound(sum(len(p) for p in payloads), src, max_bytes, mode, "broadcast_object_list")
    return [
        _load(p, f"object {i} from rank {src}", safe, mode, "broadcast_object_list") for i, p in enumerate(payloads)
    ]


def decode_gathered(
    payloads: list[memoryview], ranks: tuple[int, ...], me: int, safe: bool, max_bytes: int | None, mode: str
) -> list[Any]:
    """Unpickle every rank's ``all_gather_object`` payload, all or none; ``max_bytes`` bounds each peer's payload.

    This rank's own object comes back as a copy (unpickled as it was sent), never refused.

    Raises:
        ObjectRefusedError: a peer's payload is over ``max_bytes``, or (safe) not plain data.
    """
    for r, payload in enumerate(payloads):
        if r != me:
            _bound(len(payload), ranks[r], max_bytes, mode, "all_gather_object")
    return [
        pickle.loads(p) if r == me else _load(p, f"the object of rank {ranks[r]}", safe, mode, "all_gather_object")
        for r, p in enumerate(payloads)
    ]


def _bound(size: int, src: int, max_bytes: int | None, mode: str, op: str) -> None:
    if max_bytes is not None and size > max_bytes:
        raise ObjectRefusedError(
            f"{op} on mode {mode!r} refused {size} bytes from rank {src}: over max_bytes={max_bytes}; nothing was "
            "deserialised and the list is unchanged"
        )


def _load(payload: memoryview, what: str, safe: bool, mode: str, op: str) -> Any:
    if not safe:
        return pickle.loads(payload)
    try:
        obj = _PlainUnpickler(io.BytesIO(payload)).load()
        _check_plain(obj)
    except Exception as err:  # noqa: BLE001 - whatever the payload makes the unpickler raise is a refusal
        raise ObjectRefusedError(
            f"{op} on mode {mode!r} (safe) refused {what}: {err}. Safe mode accepts only {_PLAIN_NAMES}; nothing in it "
            "was run and the list is unchanged"
        ) from None
    return obj


def _load_storage(data: bytes) -> Any:
    # torch pickles a storage as a call to torch.storage._load_from_bytes, which runs torch.load(weights_only=False) on
    # bytes the sender chose.
    try:
        storage = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds; each is a refusal
        reason = next(
            (line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line),
            str(err).splitlines()[0] if str(err) else repr(err),
        )
        raise pickle.UnpicklingError(f"a tensor's storage bytes are not a plain storage ({reason})") from None
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor's storage decoded to {type(storage).__name__}, not a storage")
    return storage


def _rebuild_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> torch.Tensor:
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor was rebuilt from {type(storage).__name__}, not a storage")
    if hooks:
        raise pickle.UnpicklingError("a tensor carried backward hooks")
    if metadata:
        raise pickle.UnpicklingError("a tensor carried metadata")
    # set_() checks that size, stride and offset stay inside the storage.
    return _compat.rebuild_tensor(storage, offset, size, stride).requires_grad_(bool(requires_grad))


_BYTES_DTYPES = {
    name: dtype
    for name in (
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
        "uint16", "uint32", "uint64", "complex32", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}  # fmt: skip
"""The dtypes whose tensors torch pickles but cannot unpickle (its storage loader has no typed storage for them)."""
_BYTES_DTYPE_NAMES = {dtype: name for name, dtype in _BYTES_DTYPES.items()}


class _Pickler(pickle.Pickler):
    """``pickle.Pickler`` that sends a plain tensor of a dtype in :data:`_BYTES_DTYPES` as its bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor and (name := _BYTES_DTYPE_NAMES.get(obj.dtype)) is not None
        ):  # subclasses keep theirs
            data = obj.detach().reshape(-1).contiguous().view(torch.uint8)
            return _rebuild_from_bytes, (data, name, tuple(obj.shape), obj.requires_grad)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)``, with every tensor of a dtype torch cannot unpickle sent as its bytes (see the module's
    note)."""
    buf = io.BytesIO()
    _Pickler(buf, pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _rebuild_from_bytes(data: Any, dtype_name: Any, shape: Any, requires_grad: Any) -> torch.Tensor:
    # Part of the wire format (pickles name it by this module's path): safe mode resolves it too, so it checks its
    # input.
    dtype = _BYTES_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise pickle.UnpicklingError(f"a tensor's bytes name dtype {dtype_name!r}, not one sent as bytes")
    if not (isinstance(data, torch.Tensor) and data.dtype is torch.uint8 and data.dim() == 1):
        raise pickle.UnpicklingError("a tensor's bytes are not a 1-d uint8 tensor")
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise pickle.UnpicklingError(f"a tensor's shape {shape!r} is not a tuple of sizes")
    try:
        return data.view(dtype).reshape(shape).requires_grad_(bool(requires_grad))
    except RuntimeError as err:
        raise pickle.UnpicklingError(
            f"a tensor's {data.numel()} bytes do not make a {dtype_name} tensor of shape {list(shape)} ({err})"
        ) from None


_REBUILD_TENSOR, _LOAD_STORAGE = _compat.TENSOR_PICKLE_GLOBALS
_GLOBALS = {
    (__name__, "_rebuild_from_bytes"): _rebuild_from_bytes,
    _REBUILD_TENSOR: _rebuild_tensor,
    _LOAD_STORAGE: _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
}


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that resolves no global but the checked ones that rebuild a plain tensor."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which safe mode does not resolve") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id")


def _check_plain(obj: Any) -> None:
    """Raise ``UnpicklingError`` unless ``obj`` is plain data all the way down (iterative: payloads may nest deeply)."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind not in _PLAIN_TYPES:
            raise pickle.UnpicklingError(f"it holds a {kind.__module__}.{kind.__qualname__}")
        if kind in (list, tuple, dict, collections.OrderedDict) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
