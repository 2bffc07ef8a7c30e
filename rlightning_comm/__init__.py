"""rlightning_comm: communicators bound per named group, thin collective facades, sequence-parallel autograd ops."""

from rlightning_comm import collective
from rlightning_comm.communicators import Communicator, GlooCommunicator, NcclCommunicator, register_communicator
from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError, ModeNotBoundError, ObjectRefusedError
from rlightning_comm.failures import WorkHandle
from rlightning_comm.modes import CommMode, ParallelMode

__all__ = [
    "CommContext",
    "CommError",
    "CommMismatchError",
    "CommMode",
    "CommTimeoutError",
    "Communicator",
    "GlooCommunicator",
    "ModeNotBoundError",
    "NcclCommunicator",
    "ObjectRefusedError",
    "ParallelMode",
    "WorkHandle",
    "collective",
    "register_communicator",
]
