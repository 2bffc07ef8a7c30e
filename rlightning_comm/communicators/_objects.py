"""Object broadcast with torch's wire format, without numpy.

torch.distributed.broadcast_object_list needs numpy on the receiving side.
This sends the same two broadcasts (an int64 tensor of pickle sizes, then
one uint8 tensor of the concatenated pickles), so peers that call torch's
version interoperate, and decodes the bytes through the tensor's storage.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist


def broadcast_objects(object_list: list[Any], src: int, group: dist.ProcessGroup, device: torch.device, loads: Callable[[bytes], Any] = pickle.loads) -> None:
    """Broadcast ``object_list`` from global rank ``src``; receivers' entries are replaced by ``loads`` of each payload."""
    if not object_list:
        return
    is_src = dist.get_rank() == src
    if is_src:
        payloads = [pickle.dumps(obj) for obj in object_list]
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long, device=device)
    else:
        sizes = torch.empty(len(object_list), dtype=torch.long, device=device)
    dist.broadcast(sizes, src=src, group=group)
    if is_src:
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(device)
    else:
        # Receive into a bytearray (through a tensor view of it on CPU, so no copy at all): bytes(storage)
        # would iterate element by element, and a parallel copy into fresh pages is slow on a busy host.
        received = bytearray(int(sizes.sum().item()))
        host = torch.frombuffer(received, dtype=torch.uint8)
        data = host if device.type == "cpu" else torch.empty(len(received), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    if is_src:
        return
    if data is not host:
        host.copy_(data)  # one device-to-host copy
    raw = memoryview(received)
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = loads(raw[offset : offset + size])
        offset += size
