"""Bandwidth conventions shared by the bench command and the communication stats.

Sizes and bus bandwidth follow nccl-tests (``doc/PERFORMANCE.md`` and the ``*GetBw`` functions of its ``src/*.cu``): the
*size* ``S`` of a collective is the total buffer it produces or consumes, the same on every rank (the whole tensor for
all_reduce and broadcast, the concatenated output for all_gather and gather, the full send buffer for scatter and
all_to_all); ``algbw = S / t`` and ``busbw = algbw * factor(n)`` with ``n`` the size of the group that ran the
collective (never the world size, unless the group is the world).
"""

from __future__ import annotations

from collections.abc import Callable

_GB = 1e9


def _all_reduce(n: int) -> float:
    return 2.0 * (n - 1) / n


def _ring(n: int) -> float:
    return (n - 1) / n


def _root(n: int) -> float:
    return 1.0


def _zero(n: int) -> float:
    return 0.0


_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": _all_reduce,
    "all_reduce_dict": _all_reduce,  # one all_reduce of the packed values
    "all_gather": _ring,
    "reduce_scatter": _ring,
    "all_to_all": _ring,
    "all_to_all_single": _ring,
    # nccl-tests gather.cu / scatter.cu use (n-1)/n: the root's own chunk never crosses the bus.
    "gather": _ring,
    "scatter": _ring,
    "broadcast": _root,
    "broadcast_object_list": _root,
    "reduce": _root,
    "send": _root,
    "recv": _root,
    "all_gather_object": _ring,
    "barrier": _zero,
}

FACTOR_FORMULAS: dict[str, str] = {
    "all_reduce": "2(n-1)/n",
    "all_reduce_dict": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "all_to_all_single": "(n-1)/n",
    "gather": "(n-1)/n",
    "scatter": "(n-1)/n",
    "broadcast": "1",
    "broadcast_object_list": "1",
    "reduce": "1",
    "send": "1",
    "recv": "1",
    "all_gather_object": "(n-1)/n",
    "barrier": "0",
}
"""The bus factor of each op as a formula of the group size ``n``, for headers and docs."""


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests bus-bandwidth factor of ``op`` on a group of ``group_size`` ranks.

    As in nccl-tests, the factor is a pure function of ``n``: broadcast's is 1 even on a single rank, the others' are 0
    there.

    Raises:
        KeyError: ``op`` has no known factor; the message lists the known ops.
        ValueError: ``group_size`` is not a positive int.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int; got {group_size!r}")
    try:
        factor = _FACTORS[op]
    except KeyError:
        raise KeyError(f"no bus factor for op {op!r}; known ops: {sorted(_FACTORS)}") from None
    return factor(group_size)


def gbps(nbytes: float, seconds: float) -> float:
    """``nbytes / seconds`` in GB/s (10**9 bytes per second, as nccl-tests); 0.0 when no time elapsed."""
    return nbytes / seconds / _GB if seconds > 0 else 0.0
