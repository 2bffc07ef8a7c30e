"""CommContext's checks of a group declaration: what :meth:`~CommContext.init_group` and a declared layout validate
before any group exists.

Kept apart from the registry in :mod:`rlightning_comm.context`; :class:`CommContext` inherits them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.config import DistributedConfig, GroupConfig
from rlightning_comm.context._groups import check_order_supported
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode
from rlightning_comm.topology import Partition

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator
    from rlightning_comm.connect import Connections

_GLOBAL = CommMode.GLOBAL.value


class ContextPlanning:
    """Mixin of :class:`CommContext`: validating declarations, creating nothing."""

    _configs: dict[str, GroupConfig]
    _connections: Connections
    _require_world: Callable[[], DistributedConfig]

    def _plan_group(
        self, ranks: object, name: str, backend: str | None, use_cpu: bool, timeout: float | timedelta | None
    ) -> tuple[type[Communicator], GroupConfig, Partition]:
        """Validate one :meth:`init_group` call: its class, the mode's declaration after it, and the groups it adds.

        Creates nothing; raises what :meth:`init_group` raises before creating a group.
        """
        dist_config = self._require_world()
        if name == _GLOBAL:
            raise ValueError("mode 'GLOBAL' is bound by init_distributed_env; pick another mode for init_group")
        if name in self._connections.modes():
            raise CommError(
                f"mode {name!r} is a connected mode (bound by connect); pick another mode for init_group, or destroy() "
                "first"
            )
        if use_cpu and (backend is None or get_communicator_class(backend).backend != "gloo"):
            # As in the seed, use_cpu forces gloo whatever backend says (a gloo-based custom backend is kept).
            backend = "gloo"
        backend = backend or dist_config.backend
        cls = get_communicator_class(backend)
        cls.bind_device()  # an environment that names no device is refused before any group exists
        config = GroupConfig(
            partition=ranks,
            world_size=dist_config.world_size,
            backend=backend,
            timeout=dist_config.timeout if timeout is None else timeout,
        )
        existing = self._configs.get(name)
        config, new = (config, config.partition) if existing is None else existing.extend(config, name)
        check_order_supported(new, name)
        return cls, config, new

    def _plan_modes(
        self,
        partitions: dict[str, Sequence[Sequence[int]]],
        backend: str | None,
        use_cpu: bool,
        timeout: float | timedelta | None,
    ) -> None:
        """Validate every mode of a declared layout before any group is created, so a conflict leaves nothing
        half-bound."""
        for name, partition in partitions.items():
            self._plan_group([list(p) for p in partition], name, backend, use_cpu, timeout)
