"""The bit work of ``delta=True``, for both calls: comparing, encoding, writing, and the snapshots a source keeps.

Which words of a tensor changed since its snapshot (:mod:`._changes`), how a change is laid out in bytes and read
back (:mod:`._encoding`), writing changes into tensors and snapshots (:mod:`._writes`), and the snapshot of what a
source last sent, with its version (:mod:`._snapshots`). Each call's delta phase (who offers what, who decides, how the
bytes move) is the call's own: :mod:`..broadcast._delta`, :mod:`..reshard._delta` and :mod:`..reshard._delta_mover`.

Uses :mod:`..core` only.
"""
