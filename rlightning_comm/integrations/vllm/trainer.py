"""The trainer side of the ``"rlightning"`` backend in vLLM's own trainer-side API (``WeightTransferTrainerFactory``):
a trainer written against vLLM's HTTP or Ray weight-sync clients syncs through this package by naming this init info.

::

    # excerpt: on every trainer rank (torch.distributed initialised over the trainer ranks, or a single rank)
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from rlightning_comm.integrations.vllm.trainer import RLightningTrainerInitInfo

    init = RLightningTrainerInitInfo(rank=rank, trainers=3, world_size=5)  # was NCCLTrainerInitInfo(...)
    client = HTTPVLLMWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
    engine.send_weights()  # every step: version 1, 2, ...

Importing this module registers the trainer engine (vLLM's trainer processes load no plugins).

Imports vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from rlightning_comm.context import CommContext
from rlightning_comm.integrations.vllm._plugin import BACKEND
from rlightning_comm.integrations.vllm.extension import DEFAULT_MODE
from rlightning_comm.weights import reshard_state_dict

__all__ = ["RLightningTrainerInitInfo", "RLightningTrainerWeightTransferEngine"]


@dataclass
class RLightningTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``"rlightning"`` backend (``rank``: this trainer rank; rank 0 drives the engine).

    Args:
        world_size: Members of the connected mode: every trainer rank and every worker of the engine.
        trainers: Trainer ranks (members 0 to ``trainers - 1``); the engine's workers follow.
        host: Where trainer rank 0 listens (``"host:port"``; port 0: one the OS picks).
        mode: The connected mode's name.
        timeout: Seconds of every transfer's wait.
        background: The engine receives each version while it generates (see the backend's ``init_info``).
        options: Keywords of ``reshard_state_dict`` every member passes (``verify``, ``atomic``, ``delta``).
    """

    backend: ClassVar[str] = BACKEND

    world_size: int
    trainers: int = 1
    host: str = "127.0.0.1:0"
    mode: str = DEFAULT_MODE
    timeout: float = 1800.0
    background: bool = False
    options: dict[str, Any] = field(default_factory=dict)


class RLightningTrainerWeightTransferEngine(TrainerWeightTransferEngine[RLightningTrainerInitInfo]):
    """Every trainer rank is a member of the mode and sends the blocks it holds (FSDP2 ``DTensor`` shards, whole
    tensors) straight to the workers that keep them; rank 0 also drives the engine through the client."""

    init_info_cls = RLightningTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, info: RLightningTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self.version = 0

    @classmethod
    def trainer_init(
        cls,
        init_info: RLightningTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> RLightningTrainerWeightTransferEngine:
        """Rank 0 listens and hands the address to the other trainer ranks (over torch.distributed's default group)
        and to the engine (``client.init_weight_transfer_engine``); every rank joins the mode.

        Raises:
            ValueError: no ``source``, or a ``trainers`` above 1 without torch.distributed initialised.
        """
        if source is None:
            raise ValueError("the rlightning trainer engine needs a WeightSource (ModuleSource(model))")
        info = init_info
        if info.trainers > 1 and not dist.is_initialized():
            raise ValueError(f"trainers={info.trainers} needs torch.distributed initialised over the trainer ranks")
        ctx = CommContext()
        box = [ctx.listen(info.host) if info.is_sender else None]
        if info.trainers > 1:
            dist.broadcast_object_list(box, src=0)
        address = box[0]
        engine = cls(client=client, source=source, info=info)
        join = dict(rank=info.rank, world_size=info.world_size, address=address, timeout=info.timeout)
        if not info.is_sender:
            ctx.connect(info.mode, **join)
            return engine
        worker_info = {
            "address": address,
            "rank": info.trainers,
            "world_size": info.world_size,
            "mode": info.mode,
            "timeout": info.timeout,
            "background": dict(info.options) if info.background else False,
        }
        errors: list[BaseException] = []
        thread = threading.Thread(target=_call, args=(client.init_weight_transfer_engine, worker_info, errors))
        thread.start()  # the workers join the mode inside this call, while every trainer rank does here
        try:
            ctx.connect(info.mode, **join)
        finally:
            thread.join(info.timeout)
        if errors:
            raise errors[0]
        return engine

    def send_weights(self, version: int | None = None) -> None:
        """One sync of ``version`` (the next one by default) on every trainer rank: ``reshard_state_dict`` of the
        source's parameters, while rank 0 drives ``start_weight_update``, ``update_weights`` and
        ``finish_weight_update``. Raises what either side raised (a refusal raises on every member)."""
        self.version = self.version + 1 if version is None else version
        held = _held(self.source)
        if not self.is_sender:
            reshard_state_dict(held=held, comm_mode=self.info.mode, version=self.version, **self.info.options)
            return
        errors: list[BaseException] = []
        self.client.start_weight_update()
        update = {"version": self.version, **({} if self.info.background else self.info.options)}
        thread = threading.Thread(target=_call, args=(self.client.update_weights, update, errors))
        thread.start()
        try:
            reshard_state_dict(held=held, comm_mode=self.info.mode, version=self.version, **self.info.options)
        finally:
            thread.join(self.info.timeout)
        if errors:
            raise errors[0]
        self.client.finish_weight_update(weight_version=str(self.version))

    def shutdown(self) -> None:
        """Leave the mode (destroys this process's context)."""
        CommContext().destroy()


def _held(source: WeightSource | None) -> dict[str, Any]:
    """The blocks this rank holds: a module's own parameters (FSDP2 shards are sent as they are, never gathered), else
    what the source yields."""
    module = getattr(source, "_module", None)  # vLLM's ModuleSource keeps the module here
    if isinstance(source, ModuleSource) and module is not None:
        return {n: p.detach() for n, p in module.named_parameters()}
    return {n: t for n, t in source or () if t is not None}


def _call(fn: Any, arg: Any, errors: list[BaseException]) -> None:
    try:
        fn(arg)
    except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
        errors.append(err)


def register() -> None:
    """Register the trainer engine with vLLM's ``WeightTransferTrainerFactory`` (calling it again does nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, RLightningTrainerWeightTransferEngine)


register()
