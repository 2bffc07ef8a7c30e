"""rlightning_comm: communicators bound per named group, thin collective facades, sequence-parallel autograd ops."""

from rlightning_comm import collective, sequence_parallel
from rlightning_comm.communicators import Communicator, GlooCommunicator, NcclCommunicator, register_communicator
from rlightning_comm.config import ParallelConfig
from rlightning_comm.context import CommContext, initialize_distributed_env
from rlightning_comm.errors import (
    CommError,
    CommMismatchError,
    CommTimeoutError,
    ModeNotBoundError,
    ObjectRefusedError,
    PeerLostError,
)
from rlightning_comm.failures import WorkHandle
from rlightning_comm.launch import run
from rlightning_comm.layout import ModeLayout, describe_layout, format_layout
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.sequence_parallel import (
    UlyssesAttention,
    all_gather_from_sequence_parallel_region,
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    sequence_split_sizes,
    ulysses_attention,
)
from rlightning_comm.weights import (
    StateDictTransfer,
    TensorSlice,
    WeightSyncReport,
    broadcast_state_dict,
    reshard_state_dict,
)

__all__ = [
    "CommContext",
    "CommError",
    "CommMismatchError",
    "CommMode",
    "CommTimeoutError",
    "Communicator",
    "GlooCommunicator",
    "ModeLayout",
    "ModeNotBoundError",
    "NcclCommunicator",
    "ObjectRefusedError",
    "ParallelConfig",
    "ParallelMode",
    "PeerLostError",
    "StateDictTransfer",
    "TensorSlice",
    "UlyssesAttention",
    "WeightSyncReport",
    "WorkHandle",
    "all_gather_from_sequence_parallel_region",
    "all_to_all",
    "broadcast_state_dict",
    "collective",
    "describe_layout",
    "format_layout",
    "gather_from_sequence_parallel_region",
    "initialize_distributed_env",
    "reduce_scatter_to_sequence_parallel_region",
    "register_communicator",
    "reshard_state_dict",
    "run",
    "scatter_to_sequence_parallel_region",
    "sequence_parallel",
    "sequence_split_sizes",
    "ulysses_attention",
]
