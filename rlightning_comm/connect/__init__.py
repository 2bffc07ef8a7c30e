"""Connected modes: a group of processes from different worlds (or from none) that meet at an address, re-formed by
generation.

See :meth:`CommContext.connect`. :mod:`._forming` is where the members meet and agree on a generation, :mod:`._judging`
checks them before any group exists, :mod:`._groups` builds the group outside torch's world, :mod:`._liveness` watches
the members, :mod:`._generation` is one generation on this process, and :mod:`._connection` holds them together per
process.
"""

from rlightning_comm.connect._connection import Connections

__all__ = ["Connections"]
