"""vLLM's general-plugin hook: registers the ``"rlightning"`` weight-transfer backend in the process that runs it."""

from __future__ import annotations

BACKEND = "rlightning"


def register_backend() -> None:
    """Register the weight-transfer backend ``"rlightning"`` with vLLM (``WeightTransferEngineFactory``, and its
    trainer side with ``WeightTransferTrainerFactory``).

    vLLM calls it in each of its processes (the driver, the engine core, every worker) through the package's entry point
    in the ``vllm.general_plugins`` group, so a user only names the backend. The backend's module is imported only when
    an engine creates it. Calling this again does nothing.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, name in (
        (WeightTransferEngineFactory, "backend", "RLightningWeightTransferEngine"),
        (WeightTransferTrainerFactory, "trainer", "RLightningTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, f"rlightning_comm.integrations.vllm.{module}", name)
        except ValueError as err:  # registered already: vLLM may load its plugins more than once
            if "already registered" not in str(err):
                raise
