"""The seam for engine adapters: what an integration that loads the received bytes itself needs from weight sync.

An engine adapter (the vLLM backend of :mod:`rlightning_comm.integrations.vllm`, or one written for another engine)
receives a version with :func:`~rlightning_comm.weights.reshard_state_dict` into buffers of its own and then loads them
into the engine. Two things of the sync are then the adapter's:

* the engine's committed version: :func:`record_weight_version` once every worker has loaded a version (and ``None``
  while a load is under way, so that a failure in the middle leaves no version claimed), read back with
  :meth:`CommContext.get_weight_version <rlightning_comm.context.CommContext.get_weight_version>`;
* refusing a sync the engine cannot take (a stale version, malformed options): :func:`refuse_reshard` joins the
  trainers' ``reshard_state_dict`` with the problem, so it raises on every member, the trainers included, before any
  byte moves.

Example (an excerpt of an adapter's worker, under its engine's own update call)::

    before = CommContext().get_weight_version(mode)
    if problem is not None:
        refuse_reshard(mode, ValueError(problem))  # every member raises it; nothing moved
    reshard_state_dict(wanted=buffers, comm_mode=mode, version=version)  # records nothing on the engine side yet
    record_weight_version(mode, None)  # loading: no one version until every worker has loaded it
    engine.load(buffers)
    record_weight_version(mode, version)
"""

from __future__ import annotations

from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode, ParallelMode, mode_name
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.reshard._call import DEFAULT_BUCKET_BYTES, reshard

__all__ = ["record_weight_version", "refuse_reshard"]


def record_weight_version(comm_mode: CommMode | ParallelMode | str, version: int | None) -> None:
    """Record ``version`` as the weight version this process committed on ``comm_mode`` (``None``: none).

    For an adapter that loads the received bytes itself: call it once the engine holds ``version`` (on every worker
    that loaded it), and with ``None`` before a load whose failure would leave a mix of versions.

    Args:
        comm_mode: The mode the weights came over.
        version: The version the engine now holds, or ``None``.
    """
    CommContext()._record_weight_version(mode_name(comm_mode), version)


def refuse_reshard(comm_mode: CommMode | ParallelMode | str, error: Exception) -> None:
    """Join the other members' :func:`~rlightning_comm.weights.reshard_state_dict` on ``comm_mode`` with ``error``.

    Every member of the mode raises ``error``'s type with its message (this one included), before any byte moves; the
    members' tensors and versions are left as they were. Use it where an engine's worker cannot take a sync it must
    still join (a stale version, options it does not accept), so that no trainer waits for it.

    Args:
        comm_mode: The mode the trainers call ``reshard_state_dict`` on.
        error: What to raise on every member (its type and message travel).

    Raises:
        Exception: ``error``'s type, on this process too, with the message every member raises.
    """
    comm = CommContext().get_communicator(comm_mode)
    options = SyncOptions(None, False, False, None, None, comm.mode)
    options.problem = (type(error), str(error))
    reshard(comm, None, None, DEFAULT_BUCKET_BYTES, options)
