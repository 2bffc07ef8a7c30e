"""The ``"rlightning"`` weight-transfer backend: vLLM's RL weight-sync API, each tensor-parallel worker receiving only
its shard, straight from the trainer ranks that hold it.

The package registers the backend in every vLLM process (:func:`~rlightning_comm.integrations.vllm.register_backend`,
through its ``vllm.general_plugins`` entry point), so the driver only names it and calls vLLM's own API::

    llm = LLM(model=..., tensor_parallel_size=2, weight_transfer_config=WeightTransferConfig(backend="rlightning"))
    llm.init_weight_transfer_engine({"init_info": {"address": address, "rank": 3, "world_size": 5}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})  # while every trainer rank calls reshard_state_dict
    llm.finish_weight_update(weight_version="1")
    llm.reset_prefix_cache()

Each trainer rank calls ``reshard_state_dict(held=<its parameters under the checkpoint's names>, comm_mode=mode,
version=1)``: FSDP2 ``DTensor`` shards, tensor-parallel shards or whole tensors. Each worker of the engine derives from
vLLM's own model which block of each checkpoint tensor it keeps (:mod:`._layout`), receives exactly those bytes into
buffers of its own, and only once every worker of the engine has received all of its blocks hands them to vLLM's
layer-by-layer reload, which loads, fuses and repacks them (:mod:`._views` says how a loader is handed a block; an
LM head tied to the embeddings is packed again afterwards, which vLLM's reload omits: :mod:`._reload`).

Imports vLLM: vLLM imports this module in its workers when an engine uses the backend.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from vllm.distributed import get_tp_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
)
from vllm.logger import init_logger
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from rlightning_comm.context import CommContext
from rlightning_comm.integrations.vllm._info import OPTIONS, RLightningInitInfo, RLightningUpdateInfo, parse_init
from rlightning_comm.integrations.vllm._layout import WorkerLayout, derive
from rlightning_comm.integrations.vllm._reload import reloading
from rlightning_comm.integrations.vllm._staging import Stager
from rlightning_comm.integrations.vllm._workers import fail, outcomes, reporter
from rlightning_comm.weights import reshard_state_dict
from rlightning_comm.weights.engines import record_weight_version, refuse_reshard

__all__ = ["OPTIONS", "RLightningInitInfo", "RLightningUpdateInfo", "RLightningWeightTransferEngine"]

logger = init_logger("vllm.rlightning_comm")


class RLightningWeightTransferEngine(WeightTransferEngine[RLightningInitInfo, RLightningUpdateInfo]):
    """The backend in one vLLM worker (see the module's docstring). vLLM creates it; the driver drives it through
    ``llm.init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` (or
    the same routes of ``vllm serve``). The engine's workers agree on every call's outcome, and a failure reaches the
    driver from one of them (:mod:`._workers`)."""

    init_info_cls = RLightningInitInfo
    update_info_cls = RLightningUpdateInfo
    supports_draft_weight_update = False  # the layout is derived from the model the engine was built for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init: RLightningInitInfo | None = None
        self._layout: WorkerLayout | None = None
        self._kept: tuple[dict, list] | None = None  # delta=True: the receive buffers, kept between updates
        self._stager: Stager | None = None  # background=...: the background receive
        self.last_sync: dict[str, Any] | None = None  # what the last update_weights did (WeightSyncWorker reads it)

    # ------------------------------------------------------------------ joining the mode
    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """``init_info`` checked and typed (see :class:`RLightningInitInfo`).

        Every worker of the engine gets the same ``init_dict`` and finds the same fault, so they need not agree on it.
        Only the engine's last worker raises it, though: vLLM 0.32's executor stops reading replies at the first
        failure (:mod:`._workers`). The others return it, and their :meth:`init_transfer_engine` then does nothing.

        Raises:
            ValueError: ``init_dict`` is not a dict, misses a key or has an unknown one, holds a value of the wrong
                type, or places the engine's workers outside the mode (``rank + tensor_parallel_size > world_size``).
        """
        try:
            return parse_init(init_dict, self.parallel_config.tensor_parallel_size)
        except ValueError as err:
            if reporter():
                raise
            return err

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join (or re-form) the connected mode as member ``rank + tensor-parallel rank``."""
        if isinstance(init_info, ValueError):  # malformed: the engine's last worker raised it (parse_init_info)
            return
        error = None
        try:
            self._check_engine()
        except ValueError as err:
            error = err
        if _failed(self, error, "; the rlightning backend is not connected"):
            return
        member = init_info.rank + get_tp_group().rank_in_group
        self._init = None
        self._stop_staging(init_info.timeout)
        try:
            CommContext().connect(
                init_info.mode,
                rank=member,
                world_size=init_info.world_size,
                address=init_info.address,
                timeout=init_info.timeout,
                connect_timeout=init_info.connect_timeout,
            )
        except Exception as err:  # noqa: BLE001 - every worker learns it
            error = err
        if _failed(self, error, "; the rlightning backend is not connected (call init_weight_transfer_engine again)"):
            return
        self._init = init_info
        assert self._layout is not None
        if init_info.background is not False:
            options = {} if init_info.background is True else dict(init_info.background)
            device = CommContext().get_communicator(init_info.mode).device  # the host for gloo, the GPU for NCCL
            self._stager = Stager(init_info.mode, self._layout, options, device, logger)
            self._stager.arm()
        logger.info(
            "rlightning: member %d of %d of mode %r; this worker keeps %d checkpoint tensors' blocks (%.2f MiB)%s",
            member,
            init_info.world_size,
            init_info.mode,
            len(self._layout.names),
            self._layout.wanted_bytes / 2**20,
            "; receiving in the background" if self._stager is not None else "",
        )

    def _stop_staging(self, timeout: float) -> None:
        """End the background receive of an earlier generation (it failed with its peers, or waits in a publish's
        handshake, which destroying the mode ends)."""
        stager, self._stager = self._stager, None
        if stager is not None and not stager.join(0.0):
            CommContext().destroy()
            if not stager.join(min(timeout, 30.0)):
                logger.warning("rlightning: the background receive of the previous generation did not end")

    def _check_engine(self) -> None:
        parallel = self.parallel_config
        if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
            raise ValueError(
                "the rlightning backend serves an engine of tensor-parallel workers only; got pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size}, data_parallel_size={parallel.data_parallel_size}"
            )
        quantization = getattr(self.model_config, "quantization", None)
        if quantization is not None:
            raise ValueError(f"the rlightning backend does not support quantized models ({quantization})")
        if self._layout is None:
            self._layout = derive(self.model)

    # ------------------------------------------------------------------ one sync
    def start_weight_update(self) -> None:
        """Nothing to prepare: a call on an engine that is not connected fails in :meth:`update_weights`."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> RLightningUpdateInfo:
        """``update_info`` checked and typed (see :class:`RLightningUpdateInfo`).

        Raises:
            ValueError: ``update_dict`` is not a dict, has no ``"version"``, or has a key that is neither
                ``"version"`` nor an option of ``reshard_state_dict`` (:data:`OPTIONS`). The options' values are
                checked by ``reshard_state_dict``, on every member.
        """
        if not isinstance(update_dict, dict):
            raise ValueError(f"update_info must be a dict; got {type(update_dict).__name__}")
        unknown = sorted(set(update_dict) - {"version", *OPTIONS})
        if unknown or "version" not in update_dict:
            what = f"unknown keys {unknown}" if unknown else "no 'version'"
            raise ValueError(f"update_info has {what}; expected 'version' and any of {list(OPTIONS)}")
        options = {k: v for k, v in update_dict.items() if k != "version"}
        return RLightningUpdateInfo(update_dict["version"], options)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's call: :meth:`parse_update_info`, then :meth:`receive_weights`. A malformed ``update_info`` is refused
        on every member of the mode (the trainer ranks' ``reshard_state_dict`` raise the same ``ValueError``) rather
        than raised here, where the trainer ranks would wait for the engine until their timeout."""
        try:
            info = self.parse_update_info(update_info)
        except ValueError as err:
            info = RLightningUpdateInfo(problem=(ValueError, str(err)))
        self.receive_weights(info)

    def receive_weights(self, update_info: RLightningUpdateInfo) -> None:
        """One sync: receive this worker's blocks, agree with the engine's other workers, then load them.

        The weights being served are not touched until every worker of the engine holds all of its blocks: a sync that
        is refused or fails leaves the engine serving its previous weights on every worker, and raises.
        """
        ctx, init = CommContext(), self._init
        if self._stager is not None and init is not None:
            self._apply_staged(update_info, init, self._stager)
            return
        before = None if init is None else ctx.get_weight_version(init.mode)
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            if init is None or self._layout is None:
                raise RuntimeError("the rlightning backend is not connected: call init_weight_transfer_engine first")
            if update_info.problem is not None:
                refuse_reshard(
                    init.mode, update_info.problem[0](update_info.problem[1])
                )  # raises on every member, the trainers included
            wanted, loads = self._buffers(update_info.options.get("delta") is True)
            report = reshard_state_dict(
                wanted=wanted, comm_mode=init.mode, version=update_info.version, **update_info.options
            )
        except Exception as err:  # noqa: BLE001 - every worker learns it before any weight is touched
            error = err
        if error is None and init is not None:
            record_weight_version(init.mode, before)  # committed only once loaded, on every worker
        if _failed(self, error, f"; every worker of this engine still serves {_held(before)}"):
            return
        assert init is not None
        self._load(init, loads, update_info.version, report, start)

    def _apply_staged(self, update_info: RLightningUpdateInfo, init: RLightningInitInfo, stager: Stager) -> None:
        """``update_weights`` with a background receive: wait for ``version`` to be staged on this worker (a staged
        older one is superseded: discarded), agree with the engine's other workers, load it, and arm the receive of the
        next one. Nothing is sent to the trainer ranks here: they published already (or will)."""
        before = CommContext().get_weight_version(init.mode)
        start = time.perf_counter()
        error: BaseException | None = None
        report = None
        try:
            if update_info.problem is not None:
                raise update_info.problem[0](update_info.problem[1])
            version = update_info.version
            if update_info.options:
                raise ValueError(
                    f"update_info has options {sorted(update_info.options)}; with a background receive the options are "
                    "init_info['background']'s: update_info holds 'version' only"
                )
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"update_info['version'] must be an int with a background receive; got {version!r}")
            report = stager.take(version, before, init.timeout)
        except Exception as err:  # noqa: BLE001 - every worker learns it before any weight is touched
            error = err
        if _failed(self, error, f"; every worker of this engine still serves {_held(before)}"):
            return
        stager.ready()
        try:
            self._load(init, stager.loads, update_info.version, report, start)
        finally:
            stager.arm()

    def _load(self, init: RLightningInitInfo, loads: list, version: Any, report: Any, start: float) -> None:
        """vLLM's reload of what every worker received, and the version recorded once every worker has loaded it."""
        assert self._layout is not None
        received = time.perf_counter()
        error: BaseException | None = None
        try:
            with reloading(self.model):  # packs a tied LM head again, which vLLM's reload leaves stale
                reload_weights(
                    self.vllm_config, self.model, weights_iterator=loads, weights_path=None, is_checkpoint_format=True
                )
        except Exception as err:  # noqa: BLE001 - every worker learns it
            error = err
        record_weight_version(init.mode, None)  # until every worker has loaded it: no committed version
        tail = "; the engine's weights may be a mix of the previous and the new version: sync again before serving"
        if _failed(self, error, tail):
            return
        record_weight_version(init.mode, version)
        done = time.perf_counter()
        self.last_sync = {
            **dataclasses.asdict(report),
            "wanted_bytes": self._layout.wanted_bytes,
            "transfer_s": received - start,
            "load_s": done - received,
            "total_s": done - start,
        }

    def _buffers(self, delta: bool) -> tuple[dict, list]:
        """The buffers to receive into: with ``delta``, the same ones every update (they hold the version the last
        update brought, which a delta applies to; vLLM's loaders only read them), else fresh ones."""
        if not delta:
            self._kept = None
            return self._layout.allocate()
        if self._kept is None:
            self._kept = self._layout.allocate()
        return self._kept

    def finish_weight_update(self) -> None:
        """Nothing left to do: :meth:`receive_weights` loaded the weights once every worker had its blocks."""

    def shutdown(self) -> None:
        """Leave the mode: destroys this worker's context (every mode this process joined through the library)."""
        if self._init is not None:
            stager, self._stager = self._stager, None
            CommContext().destroy()  # ends a background receive waiting for a publish
            if stager is not None:
                stager.join(5.0)
            self._init = None


def _failed(engine: RLightningWeightTransferEngine, error: BaseException | None, tail: str) -> bool:
    """Whether any worker of the engine failed (every worker learns it); if so, the failure is reported."""
    errors = outcomes(error)
    if all(e is None for e in errors):
        return False
    fail(engine, error, errors, tail)
    return True


def _held(version: int | None) -> str:
    return "the weights it served before (no committed version)" if version is None else f"version {version}"
