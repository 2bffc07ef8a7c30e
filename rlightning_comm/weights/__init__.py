"""Weight sync: moving a trainer's weights into inference engines over a mode of the context.

:func:`broadcast_state_dict` sends full tensors from one source member to every other member, in place or through a
``load`` callable; :class:`StateDictTransfer` is the handle of either call with ``async_op=True``.
:func:`reshard_state_dict` moves blocks of tensors from the members that hold them straight into the blocks others want
(:class:`TensorSlice`; the layouts of common engines in :mod:`.layouts`), with no gather. Both return a
:class:`WeightSyncReport`; :func:`tensor_digest` computes a report's digest of a tensor at hand. With ``delta=True``
both send only the elements that changed since the last sync; :func:`forget_delta` frees what a member keeps for it.
:mod:`.engines` is the seam for engine adapters that load the received bytes themselves.

The sub-packages are the rooms of the implementation, lowest first: ``core`` (what both calls share), ``commit``
(versions, digests, the all-or-nothing commit, reports) and ``delta`` (the bit work of delta syncs), then one room per
call, ``broadcast`` and ``reshard``. A room imports only rooms below it.
"""

from rlightning_comm.weights import layouts
from rlightning_comm.weights.broadcast._call import broadcast_state_dict
from rlightning_comm.weights.commit._digest import tensor_digest
from rlightning_comm.weights.commit._report import WeightSyncReport
from rlightning_comm.weights.core._publish import StateDictTransfer
from rlightning_comm.weights.delta._snapshots import forget_delta
from rlightning_comm.weights.reshard._call import reshard_state_dict
from rlightning_comm.weights.reshard._slices import TensorSlice

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
