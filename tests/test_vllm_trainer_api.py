"""The trainer side of the "rlightning" backend through vLLM's own trainer-side API: ``WeightTransferTrainerFactory``
builds it from :class:`RLightningTrainerInitInfo`, and ``send_weights`` drives a client of vLLM's
``VLLMWeightSyncClient`` protocol while the trainer sends. The client here stands in for vLLM's HTTP or Ray client: its
calls are carried out by a process that does what each worker of the backend does (joins the mode, receives). The
oracle is the trainer's own tensors, bit for bit. Skipped where vLLM is not installed."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest

pytest.importorskip("vllm")

BOUND = 120


def _worker(orders, replies) -> None:
    """One engine worker: ``("init", init_info)`` joins the mode, ``("update", update_info)`` receives a version."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    from rlightning_comm import CommContext, reshard_state_dict

    try:
        ctx = CommContext()
        while (order := orders.get(timeout=BOUND)) is not None:
            kind, info = order
            if kind == "init":
                ctx.connect(info["mode"], rank=info["rank"], world_size=info["world_size"], address=info["address"])
                replies.put(("init", info))
            else:
                wanted = {"weight": torch.empty(3, 4), "bias": torch.empty(3)}
                report = reshard_state_dict(wanted=wanted, comm_mode="WEIGHT_SYNC", version=info["version"])
                replies.put(("update", info, report.version, {n: t.tolist() for n, t in wanted.items()}))
        ctx.destroy()
    except BaseException:
        replies.put(("error", traceback.format_exc()))


class Client:
    """vLLM's ``VLLMWeightSyncClient`` protocol (structural): each call carried out by the worker process."""

    def __init__(self, orders, replies):
        self.orders, self.replies, self.calls = orders, replies, []

    def _do(self, kind, info):
        self.orders.put((kind, info))
        reply = self.replies.get(timeout=BOUND)
        assert reply[0] != "error", reply[1]
        self.calls.append(reply)

    def init_weight_transfer_engine(self, init_info):
        self._do("init", init_info)

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self._do("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


def test_a_trainer_written_for_vllms_clients_syncs_through_the_backend() -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlightning_comm import CommContext
    from rlightning_comm.integrations.vllm.trainer import RLightningTrainerInitInfo

    spawn = mp.get_context("spawn")
    orders, replies = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=_worker, args=(orders, replies), daemon=True)
    proc.start()
    try:
        model = torch.nn.Linear(4, 3)
        client = Client(orders, replies)
        engine = WeightTransferTrainerFactory.trainer_init(
            RLightningTrainerInitInfo(rank=0, world_size=2), client=client, source=ModuleSource(model)
        )
        assert type(engine).__name__ == "RLightningTrainerWeightTransferEngine"
        for version in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            engine.send_weights()
            _, info, got, received = client.calls[-2]
            assert info == {"version": version} and got == version
            assert received == {"weight": model.weight.tolist(), "bias": model.bias.tolist()}  # bit for bit
            assert client.calls[-1] == ("finish", str(version))
        assert client.calls[0][1]["rank"] == 1 and client.calls[0][1]["world_size"] == 2
    finally:
        orders.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        CommContext().destroy()
