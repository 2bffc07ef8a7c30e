"""Communicator backends and their registry."""

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.gloo import GlooCommunicator
from rlightning_comm.communicators.nccl import NcclCommunicator
from rlightning_comm.communicators.registry import (
    get_communicator_class,
    register_communicator,
    registered_communicators,
)

__all__ = [
    "Communicator",
    "GlooCommunicator",
    "NcclCommunicator",
    "get_communicator_class",
    "register_communicator",
    "registered_communicators",
]
