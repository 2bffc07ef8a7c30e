"""The data phase of :func:`reshard_state_dict` on backends other than gloo on host tensors (NCCL): no point-to-point
receipts, each phase one grouped ``batch_isend_irecv``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def run_batched(self: Any) -> None:
    """A :class:`~._mover.Mover`'s data phase on other backends (NCCL): each phase as one grouped ``batch_isend_irecv``,
    on the mode's own group (the mover's own helpers pack, view and account for the pieces)."""
    me, group = self._me, self._comm.group

    def batch(ops: list[tuple[Any, torch.Tensor, int]]) -> None:
        if not ops:
            return
        p2p = [dist.P2POp(op, t, group=group, group_peer=peer) for op, t, peer in ops]
        works = self._launch(lambda: dist.batch_isend_irecv(p2p))
        for work in works:
            work.wait()

    ops = []
    for p in self._s.direct:
        if p.src == me:
            ops.append((dist.isend, self._bytes(self._src_view(p)), p.dst))
            self._sent_whole(p)
        else:
            self._touched.add(p.name)
            ops.append((dist.irecv, self._bytes(self._dst_view(p)), p.src))
    batch(ops)
    for p in self._s.direct:
        if p.dst == me:
            self._received_whole(p)
    self._copies()
    for j, chunk in enumerate(self._s.chunks):
        ops, staged = [], []
        whole = self._slot(j % 2, max((b.at(me) + b.nbytes for b in chunk if b.staged(me)), default=0))
        for bucket in chunk:
            buffer = whole[bucket.at(me) : bucket.at(me) + bucket.nbytes] if bucket.staged(me) else None
            if bucket.src == me:
                if buffer is not None:
                    self._pack(bucket, buffer, pack=True)
                else:
                    self._sent_whole(bucket.pieces[0])
                ops.append(
                    (
                        dist.isend,
                        buffer if buffer is not None else self._bytes(self._src_view(bucket.pieces[0])),
                        bucket.dst,
                    )
                )
            elif buffer is not None:
                ops.append((dist.irecv, buffer, bucket.src))
                staged.append((bucket, buffer))
            else:
                self._touched.add(bucket.pieces[0].name)
                ops.append((dist.irecv, self._bytes(self._dst_view(bucket.pieces[0])), bucket.src))
                staged.append((bucket, None))
        batch(ops)
        for bucket, buffer in staged:
            if buffer is None:
                self._received_whole(bucket.pieces[0])
            else:
                self._pack(bucket, buffer, pack=False)
