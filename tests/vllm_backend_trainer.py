"""The trainer processes of tests/test_vllm_backend.py (kept apart so that spawning them does not import vLLM).

Three processes form an FSDP2 world (gloo) around a tiny Qwen2 and, with the engine's two workers, the connected mode
``WEIGHT_SYNC`` (trainer ranks are members 0 to 2). Each serves the orders of its own queue until ``None`` and puts
``(rank, kind, ...)`` on the shared replies queue; any failure is replied as ``(rank, "error", traceback)``. Orders:

* ``("step", seed)``: an optimizer step on a batch of its own;
* ``("lr", value)``: the optimizer's learning rate from then on;
* ``("tokens", prompts, new_tokens)``: the Hugging Face model's greedy tokens on the current weights (the full state
  gathered for the oracle on every rank, replied by rank 0);
* ``("sync", version, options)``: ``reshard_state_dict(held=<its FSDP2 parameters>, ...)``; replies the report, or what
  it raised and how long it took. ``options["rename"]`` holds a tensor under another name (a mismatched manifest);
* ``("publish", version, options)``: ``reshard_state_dict(..., async_op=True)`` (in-flight updates); replies how long
  it blocked the caller;
* ``("wait",)``: waits for the oldest publish not waited for; replies as ``"sync"`` does;
* ``("checkpoint", folder)``: writes its local blocks to ``folder`` (what a replacement resumes from);
* ``("arm",)``: dies (SIGKILL) at its second send of the next sync;
* ``("connect", address)``: joins the mode again (a new generation).

:func:`replacement` is a process that takes the place of a lost rank from its checkpoint, holding the same blocks.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback

MODE = "WEIGHT_SYNC"
TRAINERS, MEMBERS = 3, 5  # trainer ranks 0-2, the engine's workers 3 and 4
BOUND = 300


def _blocks(model) -> dict:
    """Every parameter's local block as a TensorSlice (offsets from the DTensor's placements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from rlightning_comm import TensorSlice

    out = {}
    for name, p in model.named_parameters():
        _, offsets = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
        out[name] = TensorSlice(p.to_local().detach().clone(), tuple(offsets), tuple(p.shape))
    return out


def _greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


def _sync(rank: int, held: dict, version: int, options: dict, replies) -> None:
    from rlightning_comm import PeerLostError, TensorSlice, reshard_state_dict

    options = dict(options)
    rename = options.pop("rename", {})
    held = {rename.get(n, n): t for n, t in held.items()}
    local = [t.tensor if isinstance(t, TensorSlice) else getattr(t, "to_local", lambda t=t: t)() for t in held.values()]
    start = time.monotonic()
    try:
        report = reshard_state_dict(held=held, comm_mode=MODE, version=version, **options)
        nbytes = sum(t.numel() * t.element_size() for t in local)
        replies.put((rank, "synced", dataclasses.asdict(report), time.monotonic() - start, nbytes))
    except Exception as err:  # noqa: BLE001 - the test names it
        member = err.member if isinstance(err, PeerLostError) else None
        replies.put((rank, "failed", type(err).__name__, str(err), member, time.monotonic() - start))


_PUBLISHED: list = []  # this process's publishes not waited for yet: (handle, start, bytes)


def _publish(rank: int, held: dict, version: int, options: dict, replies) -> None:
    from rlightning_comm import reshard_state_dict

    start = time.monotonic()
    handle = reshard_state_dict(held=held, comm_mode=MODE, version=version, async_op=True, **options)
    _PUBLISHED.append((handle, start))
    replies.put((rank, "published", version, time.monotonic() - start))


def _wait(rank: int, replies) -> None:
    from rlightning_comm import PeerLostError

    handle, start = _PUBLISHED.pop(0)
    try:
        report = handle.wait()
        replies.put((rank, "synced", dataclasses.asdict(report), time.monotonic() - start, 0))
    except Exception as err:  # noqa: BLE001 - the test names it
        member = err.member if isinstance(err, PeerLostError) else None
        replies.put((rank, "failed", type(err).__name__, str(err), member, time.monotonic() - start))


def _arm() -> None:
    from rlightning_comm.weights.reshard import _mover

    original, sends = _mover.Mover._send, []

    def send(self, data, peer, tag):
        sends.append(peer)
        if len(sends) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, data, peer, tag)

    _mover.Mover._send = send


def trainer(rank: int, store: str, config_dir: str, orders, replies) -> None:
    """One rank of the FSDP2 trainer (see the module's docstring)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext

    try:
        torch.set_num_threads(1)
        ctx = CommContext()
        ctx.init_distributed_env(world_size=TRAINERS, rank=rank, backend="gloo", dist_url=f"file://{store}", timeout=60)
        config = AutoConfig.from_pretrained(config_dir)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        box = [ctx.listen("127.0.0.1:0") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        replies.put((rank, "address", box[0]))
        ctx.connect(MODE, rank=rank, world_size=MEMBERS, address=box[0], timeout=60, connect_timeout=BOUND)
        while (order := orders.get(timeout=BOUND)) is not None:
            kind, *args = order
            if kind == "step":
                gen = torch.Generator().manual_seed(args[0] + rank)
                batch = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                replies.put((rank, "stepped"))
            elif kind == "lr":
                for group in optimizer.param_groups:
                    group["lr"] = args[0]
            elif kind == "tokens":
                full = {n: t.full_tensor() for n, t in model.state_dict().items()}  # the oracle's gather only
                if rank == 0:
                    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
                    reference.load_state_dict(full)
                    nbytes = sum(t.numel() * t.element_size() for t in full.values())
                    replies.put((rank, "tokens", _greedy(reference, *args), nbytes))
            elif kind == "sync":
                _sync(rank, dict(model.named_parameters()), *args, replies)
            elif kind == "publish":
                _publish(rank, dict(model.named_parameters()), *args, replies)
            elif kind == "wait":
                _wait(rank, replies)
            elif kind == "checkpoint":
                torch.save(_blocks(model), os.path.join(args[0], f"rank{rank}.pt"))
                replies.put((rank, "saved", sum(p.to_local().numel() * 4 for p in model.parameters())))
            elif kind == "arm":
                _arm()
            elif kind == "connect":
                ctx.connect(MODE, rank=rank, world_size=MEMBERS, address=args[0], timeout=60, connect_timeout=BOUND)
                replies.put((rank, "connected", ctx.get_generation(MODE)))
        ctx.destroy()
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        raise


def replacement(rank: int, folder: str, address: str, orders, replies) -> None:
    """A process in place of the lost trainer ``rank``: its blocks from the checkpoint, no world (see the docstring)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    from rlightning_comm import CommContext

    try:
        torch.set_num_threads(1)
        held = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False)
        ctx = CommContext()
        replies.put((rank, "started"))
        ctx.connect(MODE, rank=rank, world_size=MEMBERS, address=address, timeout=60, connect_timeout=BOUND)
        replies.put((rank, "connected", ctx.get_generation(MODE)))
        while (order := orders.get(timeout=BOUND)) is not None:
            kind, *args = order
            if kind == "sync":
                _sync(rank, held, *args, replies)
            elif kind == "publish":
                _publish(rank, held, *args, replies)
            elif kind == "wait":
                _wait(rank, replies)
        ctx.destroy()
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        raise


def whole_trainer(config_dir: str, prompts: list[list[int]], new_tokens: int, members: int, orders, replies) -> None:
    """A trainer of one process that holds every tensor whole (member 0 of ``members``). Orders: ``("sync", version,
    perturb)``: perturb the weights (seeded by the version) if asked, reply the Hugging Face model's tokens, then
    ``reshard_state_dict`` and reply as a trainer rank does; ``("broadcast", version, perturb)``: the same with
    ``broadcast_state_dict`` of the model from member 0 (what the worker extension receives: its state dict, a tied
    tensor under each of its names); ``("broadcast_params", ...)``: of its named parameters (a tied tensor once, under
    the first name, as a tied model's checkpoint holds it)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, broadcast_state_dict

    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32).eval()
        ctx = CommContext()
        address = ctx.listen("127.0.0.1:0")
        replies.put((0, "address", address))
        ctx.connect(MODE, rank=0, world_size=members, address=address, timeout=60, connect_timeout=BOUND)
        while (order := orders.get(timeout=BOUND)) is not None:
            kind, version, perturb = order
            if perturb:
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=0.05)
            replies.put((0, "tokens", _greedy(model, prompts, new_tokens)))
            if kind in ("broadcast", "broadcast_params"):
                sent = model if kind == "broadcast" else dict(model.named_parameters())
                report = broadcast_state_dict(sent, MODE, src=0, version=version)
                replies.put((0, "synced", dataclasses.asdict(report)))
            else:
                _sync(0, dict(model.named_parameters()), version, {}, replies)
        ctx.destroy()
    except BaseException:
        replies.put((0, "error", traceback.format_exc()))
        raise
