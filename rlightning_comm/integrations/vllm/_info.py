"""The backend's ``init_info`` and ``update_info``, typed and checked (see :mod:`.backend`).

Imports vLLM: only :mod:`.backend` imports this module.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from rlightning_comm.integrations.vllm.extension import DEFAULT_MODE
from rlightning_comm.weights import reshard_state_dict

# update_info's keys besides "version": the options of reshard_state_dict that a destination passes (verify, atomic, and
# any later one). bucket_bytes is the trainer's rank 0's, so a worker has none to give; async_op is the worker's own
# business (vLLM's update_weights returns once the weights are in).
OPTIONS = tuple(
    sorted(
        n
        for n, p in inspect.signature(reshard_state_dict).parameters.items()
        if p.kind is p.KEYWORD_ONLY and n not in ("held", "wanted", "comm_mode", "bucket_bytes", "version", "async_op")
    )
)


@dataclass
class RLightningInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``llm.init_weight_transfer_engine``: where and as whom each worker joins the connected mode.

    Args:
        address: What the trainer's rank 0 ``listen()`` returned (``"host:port/secret"``).
        rank: The member of the engine's first worker; the worker of tensor-parallel rank ``r`` is ``rank + r``.
        world_size: Members of the mode: every trainer rank and every worker of every engine in it.
        mode: The connected mode's name (``"WEIGHT_SYNC"`` by default).
        timeout: Seconds of every transfer's wait (the mode's collectives' timeout).
        connect_timeout: Seconds to wait for the members to arrive (``None``: ``timeout``).
        background: Receive each version while the engine generates (in-flight updates): ``True``, or a dict of the
            options of ``reshard_state_dict`` the workers pass (``atomic``, ``verify``, ``delta``; :data:`OPTIONS`).
            Each worker then receives the trainer's next publish into buffers of its own in the background, and
            ``update_weights({"version": V})`` only applies V (waiting for what has not arrived). ``False``: each
            ``update_weights`` receives its version.
    """

    address: str
    rank: int
    world_size: int
    mode: str = DEFAULT_MODE
    timeout: float = 1800.0
    connect_timeout: float | None = None
    background: bool | dict[str, Any] = False


@dataclass
class RLightningUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``llm.update_weights``: ``{"version": V}`` plus options of ``reshard_state_dict``.

    Args:
        version: The version of the weights the trainer sends (``None`` for an unversioned sync).
        options: ``verify``, ``atomic`` and any other keyword of ``reshard_state_dict`` a destination passes
            (:data:`OPTIONS`), as given.
        problem: What is wrong with ``update_info`` (refused on every member of the mode), or ``None``.
    """

    version: Any = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    problem: tuple[type[Exception], str] | None = None


def parse_init(init_dict: Any, workers: int) -> RLightningInitInfo:
    known = [f.name for f in dataclasses.fields(RLightningInitInfo)]
    if not isinstance(init_dict, dict):
        raise ValueError(f"init_info must be a dict with keys {known}; got {type(init_dict).__name__}")
    missing = [k for k in ("address", "rank", "world_size") if k not in init_dict]
    unknown = sorted(set(init_dict) - set(known))
    if missing or unknown:
        raise ValueError(f"init_info: missing keys {missing}, unknown keys {unknown}; the keys are {known}")
    info = RLightningInitInfo(**init_dict)
    for key in ("rank", "world_size"):
        value = getattr(info, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"init_info[{key!r}] must be an int; got {type(value).__name__} {value!r}")
    background = info.background
    if not isinstance(background, (bool, dict)) or (isinstance(background, dict) and set(background) - set(OPTIONS)):
        raise ValueError(
            f"init_info['background'] must be a bool or a dict of options of reshard_state_dict {list(OPTIONS)}; got "
            f"{background!r}"
        )
    if not isinstance(info.address, str) or not isinstance(info.mode, str):
        raise ValueError(f"init_info's address and mode must be strings; got {info.address!r}, {info.mode!r}")
    if not 0 <= info.rank <= info.world_size - workers:
        raise ValueError(
            f"init_info: rank {info.rank} with world_size {info.world_size} leaves no room for this engine's {workers} "
            f"workers (members {info.rank} to {info.rank + workers - 1})"
        )
    return info
