"""Weight sync: moving a trainer's weights into inference engines over a mode of the context.

:func:`broadcast_state_dict` sends full tensors from one source member to every other member, in place or through a
``load`` callable; :class:`StateDictTransfer` is its asynchronous handle and
:class:`WeightSyncReport` what it returns on every member. The private modules are its parts: the
inputs' checks, the plan agreed by every member, the handshake, the pipeline of buckets, the loader and the transport.
"""

from rlightning_comm.weights._broadcast import StateDictTransfer, broadcast_state_dict
from rlightning_comm.weights._report import WeightSyncReport

__all__ = ["StateDictTransfer", "WeightSyncReport", "broadcast_state_dict"]
