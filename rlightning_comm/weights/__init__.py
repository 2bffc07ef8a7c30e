"""Weight sync: moving a trainer's weights into inference engines over a mode of the context.

:func:`broadcast_state_dict` sends full tensors from one source member to every other member, in place or through a
``load`` callable; :class:`StateDictTransfer` is its asynchronous handle. :func:`reshard_state_dict` moves blocks of
tensors from the members that hold them straight into the blocks others want (:class:`TensorSlice`; the layouts of
common engines in :mod:`.layouts`), with no gather. Both return a :class:`WeightSyncReport`; :func:`tensor_digest`
computes a report's digest of a tensor at hand. With ``delta=True`` both send only the elements that changed since the
last sync; :func:`forget_delta` frees what a member keeps for it. The private modules are their parts: the inputs'
checks, the plans agreed by every member, the handshake, the pipeline of buckets, the loader, the transport, and the
deltas' encoding and snapshots.
"""

from rlightning_comm.weights import layouts
from rlightning_comm.weights._broadcast import StateDictTransfer, broadcast_state_dict
from rlightning_comm.weights._digest import tensor_digest
from rlightning_comm.weights._report import WeightSyncReport
from rlightning_comm.weights._reshard import reshard_state_dict
from rlightning_comm.weights._slices import TensorSlice
from rlightning_comm.weights._snapshots import forget_delta

__all__ = [
    "StateDictTransfer",
    "TensorSlice",
    "WeightSyncReport",
    "broadcast_state_dict",
    "forget_delta",
    "layouts",
    "reshard_state_dict",
    "tensor_digest",
]
