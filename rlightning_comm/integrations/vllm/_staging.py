"""Receiving the trainer's next version while the engine generates: one worker's background receive into buffers kept
for it, which the driver's ``update_weights`` then hands to vLLM's reload.

Armed at ``init_weight_transfer_engine`` (when ``init_info`` asks for it) and again after each apply, a thread of the
worker's own calls ``reshard_state_dict(wanted=<the kept buffers>, version="any", ...)``: it joins the next publish of
the trainer ranks, whatever version they name, and holds it until the driver applies it. One version ahead at most:
the thread is not armed again until the staged version was applied or discarded, so the trainer's next publish waits
in its own queue (a trainer's third publish blocks it: its staleness is bounded by the engine). A publish refused
before any byte moved (a stale version, a mismatched manifest) is refused on every member and the thread joins the
next; a failure midway (a lost member, a timeout) ends it, and the version it was receiving is lost.

On a GPU (untested here) the buffers live on the worker's device and the thread runs the receive on a CUDA stream of
its own, so NCCL's writes and the unpacking copies never queue on the compute stream; the apply makes the compute
stream wait for that stream before vLLM's reload reads the buffers. Memory: one copy of the worker's shard on the
device (two during an ``atomic`` receive, which stages).

Imports vLLM: only :mod:`.backend` imports this module.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommMismatchError, CommTimeoutError
from rlightning_comm.integrations.vllm._layout import WorkerLayout
from rlightning_comm.weights import reshard_state_dict
from rlightning_comm.weights.engines import record_weight_version

REFUSED = (ValueError, TypeError, CommMismatchError)
"""What a call raises when it was refused before any byte moved, or found a mismatch after (the mode stays usable)."""


class Stager:
    """One worker's background receive (see the module's docstring).

    Args:
        mode: The connected mode the trainer ranks publish on.
        layout: The worker's layout: the buffers are allocated once, from it, and kept.
        options: Keywords of ``reshard_state_dict`` the worker passes (``atomic``, ``verify``, ``delta``).
        device: Where the buffers live (the worker's device for NCCL, the host for gloo).
        log: Where refused and discarded versions are reported.
    """

    def __init__(
        self, mode: str, layout: WorkerLayout, options: dict[str, Any], device: torch.device, log: Any
    ) -> None:
        self.mode, self.options, self.log = mode, options, log
        self.wanted, self.loads = layout.allocate(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.discarded: list[int] = []
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._outcome: tuple[Any, Any] = (None, None)  # (version, report) or (None, error)

    def arm(self) -> None:
        """Start receiving the next version in the background."""
        self._done.clear()
        self._outcome = (None, None)
        self._thread = threading.Thread(target=self._receive, name="rlightning-comm staging", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        ctx = CommContext()
        before = ctx.get_weight_version(self.mode)  # what the engine serves: a staged version is not committed
        try:
            while True:
                try:
                    with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                        report = reshard_state_dict(
                            wanted=self.wanted, comm_mode=self.mode, version="any", **self.options
                        )
                    self._outcome = (report.version, report)
                    return
                except REFUSED as err:  # refused on every member (or a mismatch): the mode is usable, join the next
                    self.log.warning("rlightning: a publish was refused; receiving the next one: %s", err)
                finally:
                    record_weight_version(self.mode, before)
        except BaseException as err:  # noqa: BLE001 - the driver's update_weights raises it
            self._outcome = (None, err)
        finally:
            self._done.set()

    def take(self, version: int, serving: int | None, timeout: float) -> Any:
        """Wait (at most ``timeout`` seconds) for ``version`` to be staged on this worker and return its report.

        A staged version older than ``version`` is superseded: it is discarded and the next publish received.

        Raises:
            ValueError: ``version`` is stale (at or below ``serving``) or superseded (a later version is staged).
            CommTimeoutError: ``version`` did not arrive within ``timeout``.
            Exception: the background receive failed (a lost member: ``PeerLostError``), restated to name ``version``.
        """
        if serving is not None and version <= serving:
            raise ValueError(f"version {version} refused: stale, the engine serves version {serving}")
        deadline = time.monotonic() + timeout
        while True:
            if self._thread is None or not self._done.wait(max(deadline - time.monotonic(), 0.0)):
                raise CommTimeoutError(
                    f"version {version} was not received within {timeout:g} s (no publish of it reached the engine); "
                    f"the engine serves {_serving(serving)}"
                )
            staged, report = self._outcome
            if staged is None:
                raise _restated(report, f"version {version} was not received: {report}")
            if staged == version:
                return report
            if staged > version:
                raise ValueError(
                    f"version {version} refused: superseded, version {staged} is staged (published after it); the "
                    f"engine serves {_serving(serving)}"
                )
            self.log.warning("rlightning: version %s superseded by %s before it was applied", staged, version)
            self.discarded.append(staged)
            self.arm()

    def ready(self) -> None:
        """Before vLLM's reload reads the buffers: the compute stream waits for the receive's stream (GPU)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def staged(self) -> Any:
        """The version staged now, ``None`` while receiving (or after a failure)."""
        return self._outcome[0] if self._done.is_set() else None

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end (after its mode was destroyed or its peers lost); whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _serving(version: int | None) -> str:
    return "no committed version" if version is None else f"version {version}"


def _restated(error: BaseException, text: str) -> BaseException:
    try:
        return type(error)(text, *error.args[1:])
    except Exception:  # noqa: BLE001 - a type that does not take its message first
        return RuntimeError(text)
