"""The context: which communicator serves each mode, how groups are created, and connected modes across worlds.

:class:`CommContext` is a process-wide registry from a :class:`~rlightning_comm.modes.CommMode` to its
:class:`~rlightning_comm.communicators.base.Communicator`. It is assembled from parts that each hold one concern:
lookups (which communicator serves a call), layouts (parallel and per-node groups), policies (debug mode, stats, object
collectives), connected modes (groups formed across separate worlds) and group creation.
"""

from rlightning_comm.context._context import CommContext, initialize_distributed_env

__all__ = ["CommContext", "initialize_distributed_env"]
