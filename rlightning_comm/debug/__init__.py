"""Debug mode: before each collective the ranks of the group compare what they are about to do.

Switched on per context (``CommContext().set_debug(True)``) or with ``RLIGHTNING_COMM_DEBUG=1``. The checks live in
:mod:`rlightning_comm.debug._checks` (collectives) and :mod:`rlightning_comm.debug._p2p` (point to point); this package
exports what the context calls.
"""

from rlightning_comm.debug._checks import OPS, disable, enable, is_enabled, new_generation

__all__ = ["OPS", "disable", "enable", "is_enabled", "new_generation"]
