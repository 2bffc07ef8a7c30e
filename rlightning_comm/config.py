"""Validated configuration: every value is checked before torch.distributed is touched."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlightning_comm.errors import CommError


class DefaultBackend(str):
    """``init_distributed_env``'s default backend, ``"nccl"``, told apart from a backend the caller named: inside a
    function :func:`~rlightning_comm.launch.run` launched it stands for the launcher's."""


class DefaultTimeout(float):
    """``init_distributed_env``'s default timeout, 1800 s, told apart from a timeout the caller passed: inside a
    launched function it stands for the launcher's."""


DEFAULT_BACKEND = DefaultBackend("nccl")
DEFAULT_TIMEOUT = DefaultTimeout(1800)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _as_seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else value


class DistributedConfig(_Frozen):
    """Arguments of :meth:`CommContext.init_distributed_env`, after environment lookup."""

    world_size: int = Field(ge=1)
    """Number of processes in the job."""
    rank: int = Field(ge=0)
    """Global rank of this process, ``0 <= rank < world_size``."""
    backend: str
    """Name of a registered communicator (``"gloo"``, ``"nccl"`` or a custom one)."""
    dist_url: str = Field(min_length=1)
    """torch.distributed init method: ``env://``, ``tcp://host:port`` or ``file:///path``."""
    timeout: float = Field(gt=0)
    """Default timeout of every collective, in seconds."""
    bounded_wait: bool = Field(default=False, strict=True)
    """NCCL calls wait on the host within their group's timeout and raise the library's errors (see
    :meth:`CommContext.init_distributed_env`); no effect on gloo, whose calls always do."""

    _normalise_timeout = field_validator("timeout", mode="before")(_as_seconds)

    @model_validator(mode="after")
    def _rank_in_world(self) -> DistributedConfig:
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank must satisfy 0 <= rank < world_size; got rank={self.rank}, world_size={self.world_size}"
            )
        return self

    def refuse_relaunch(
        self,
        world_size: int | None,
        rank: int | None,
        backend: str,
        dist_url: str,
        timeout: float | timedelta,
        bounded_wait: bool | None,
    ) -> str | None:
        """Why an ``init_distributed_env`` call inside a launched function does not ask for this, the launcher's world;
        ``None`` if it does.

        Left-out ``world_size`` / ``rank`` / ``bounded_wait``, the default backend and timeout, and ``env://`` stand for
        the launcher's: a call that asks for nothing in particular gets the world the launcher set up. Bad values raise
        ``ValueError`` as they would at first initialisation.
        """
        asked = DistributedConfig(
            world_size=self.world_size if world_size is None else world_size,
            rank=self.rank if rank is None else rank,
            backend=self.backend if isinstance(backend, DefaultBackend) else backend,
            dist_url=self.dist_url if dist_url == "env://" else dist_url,
            timeout=self.timeout if isinstance(timeout, DefaultTimeout) else timeout,
            bounded_wait=self.bounded_wait if bounded_wait is None else bounded_wait,
        )
        if asked == self:
            return None
        differ = ", ".join(f"{k}={v!r}" for k, v in asked.model_dump().items() if v != getattr(self, k))
        return (
            f"rlightning_comm.launch.run already initialised this process's world with world_size={self.world_size}, "
            f"rank={self.rank}, "
            f"backend={self.backend!r}, timeout={self.timeout:g} s, bounded_wait={self.bounded_wait}; "
            f"init_distributed_env asked for {differ}. "
            "Inside a launched function the world is ready: drop the call, or pass the backend, timeout and "
            "bounded_wait to run()"
        )


class GroupConfig(_Frozen):
    """The groups declared for one mode, in normalised form (what :meth:`CommContext.init_group` builds up)."""

    partition: tuple[tuple[int, ...], ...]
    """The mode's groups declared so far, in declaration order: one tuple of global ranks each.

    Each group keeps the order its ranks were declared in: group rank ``i`` is
    the ``i``-th of them (``new_group(..., sort_ranks=False)``).
    """
    world_size: int = Field(ge=1)
    """Size of the world the ranks must lie in."""
    backend: str
    """Name of a registered communicator."""
    timeout: float = Field(gt=0)
    """Timeout of the group's collectives, in seconds."""

    _normalise_timeout = field_validator("timeout", mode="before")(_as_seconds)

    @field_validator("partition", mode="before")
    @classmethod
    def _normalise_ranks(cls, ranks: object) -> object:
        """Accept one list of ranks or a list of lists and return a tuple of tuples, order kept."""
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"ranks must be a non-empty list of global ranks or a list of such lists; got {ranks!r}")
        nested = [isinstance(r, (list, tuple)) for r in ranks]
        if all(nested):
            return tuple(tuple(part) for part in ranks)
        if any(nested):
            raise ValueError(f"ranks mixes ranks and lists of ranks; got {ranks!r}")
        return (tuple(ranks),)

    @model_validator(mode="after")
    def _ranks_valid(self) -> GroupConfig:
        seen: set[int] = set()
        for part in self.partition:
            if not part:
                raise ValueError(
                    f"ranks: every group needs at least one rank; got an empty group in {self.as_ranks()!r}"
                )
            for r in part:
                if not 0 <= r < self.world_size:
                    raise ValueError(
                        f"ranks: rank {r} is out of range for world size {self.world_size}; expected 0 <= rank < "
                        f"{self.world_size}"
                    )
                if r in seen:
                    raise ValueError(
                        f"ranks: rank {r} appears more than once in {self.as_ranks()!r}; groups must be disjoint and "
                        "ranks unique"
                    )
                seen.add(r)
        return self

    def as_ranks(self) -> list[int] | list[list[int]]:
        """The ranks in the shape the user passed them (a partition of one is a flat list)."""
        if len(self.partition) == 1:
            return list(self.partition[0])
        return [list(part) for part in self.partition]

    def extend(self, other: GroupConfig, mode: str) -> tuple[GroupConfig, tuple[tuple[int, ...], ...]]:
        """This declaration with ``other``'s groups added, and which of them are new.

        A group of ``other`` equal to a declared one (same ranks, same order) is already there; one that shares no rank
        with a declared group is new.

        Args:
            other: A further declaration for the same mode.
            mode: The mode's name (for messages).

        Returns:
            The extended declaration, and the groups of ``other`` not declared before.

        Raises:
            CommError: ``other`` has another backend, timeout or world size, or declares a rank that is in a different
                group already.
        """
        if (other.backend, other.timeout, other.world_size) != (self.backend, self.timeout, self.world_size):
            raise CommError(
                f"mode {mode!r} is already bound to ranks {self.as_ranks()} (backend {self.backend!r}, timeout "
                f"{self.timeout}s); "
                f"every group of a mode uses one backend and timeout, got backend {other.backend!r}, timeout "
                f"{other.timeout}s. "
                "Call destroy() before binding the mode again"
            )
        owner = {r: part for part in self.partition for r in part}
        new = []
        for part in other.partition:
            if part in self.partition:
                continue
            clash = next((r for r in part if r in owner), None)
            if clash is not None:
                raise CommError(
                    f"mode {mode!r}: rank {clash} is declared in two different groups, {list(owner[clash])} (declared "
                    f"before) and {list(part)}; "
                    "a rank belongs to at most one group of a mode (the same ranks in another order are another "
                    "group). Call destroy() to redeclare the mode"
                )
            new.append(part)
        return self.model_copy(update={"partition": self.partition + tuple(new)}), tuple(new)


_PARALLEL_DIMS = {"tp": "tensor_parallel_size", "sp": "sequence_parallel_size", "dp": "data_parallel_size"}


class ParallelConfig(_Frozen):
    """A declared parallel layout: how many ranks each kind of parallelism spans, and how ranks are numbered.

    The world is a grid ``tensor_parallel_size x sequence_parallel_size x data_parallel_size``; :attr:`order` says which
    axis varies fastest as the global rank grows (the first one, as in Megatron's rank generator). Validated at
    construction (sizes, order) and against the world size by :meth:`sizes`, before any group exists.
    """

    tensor_parallel_size: int = Field(default=1, ge=1, strict=True)
    """Ranks per tensor-parallel group."""
    sequence_parallel_size: int = Field(default=1, ge=1, strict=True)
    """Ranks per sequence-parallel group."""
    data_parallel_size: int | None = Field(default=None, ge=1, strict=True)
    """Ranks per data-parallel group; ``None`` derives it as world size / (tensor x sequence parallel size)."""
    order: str = Field(default="tp-sp-dp", strict=True)
    """The axes ``tp``, ``sp``, ``dp`` joined by ``-``, fastest-varying first: with ``"tp-sp-dp"`` ranks
    ``0, 1, ...`` first fill a tensor-parallel group."""
    bind_train_data_parallel: bool = Field(default=False, strict=True)
    """Also bind ``TRAIN_DATA_PARALLEL``: the ranks that share a tensor-parallel position, i.e. the data x
    sequence parallel ranks over which gradients of replicated parameters are averaged (Megatron's
    data-parallel-with-context-parallel group). Equal to ``DATA_PARALLEL`` when ``sequence_parallel_size`` is 1."""

    @field_validator("order")
    @classmethod
    def _known_order(cls, order: str) -> str:
        axes = order.split("-")
        if sorted(axes) != sorted(_PARALLEL_DIMS):
            raise ValueError(
                "order must name each of 'tp', 'sp', 'dp' once, joined by '-' (for example 'tp-sp-dp' or 'tp-dp-sp'); "
                f"got {order!r}"
            )
        return order

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes of :attr:`order`, fastest-varying first."""
        return tuple(self.order.split("-"))

    def sizes(self, world_size: int) -> dict[str, int]:
        """The size of every axis in a world of ``world_size`` ranks, data parallel derived if omitted.

        Args:
            world_size: Number of ranks in the world.

        Returns:
            ``{"tp": ..., "sp": ..., "dp": ...}``, whose product is ``world_size``.

        Raises:
            ValueError: the sizes do not tile the world.
        """
        tp, sp, dp = self.tensor_parallel_size, self.sequence_parallel_size, self.data_parallel_size
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int; got {world_size!r}")
        declared = f"tensor_parallel_size={tp}, sequence_parallel_size={sp}, data_parallel_size={dp}"
        if dp is None:
            if world_size % (tp * sp):
                raise ValueError(
                    f"world size {world_size} is not divisible by tensor_parallel_size x sequence_parallel_size = {tp} "
                    f"x {sp} = {tp * sp} "
                    f"({declared}); pick sizes whose product divides the world size"
                )
            dp = world_size // (tp * sp)
        elif tp * sp * dp != world_size:
            raise ValueError(
                f"tensor x sequence x data parallel sizes {tp} x {sp} x {dp} = {tp * sp * dp} must equal the world "
                f"size {world_size} ({declared})"
            )
        return {"tp": tp, "sp": sp, "dp": dp}
