"""A sharded trainer syncs a sharded engine with no gather: FSDP2 to tensor parallel, across two worlds.

From the repository root, with the package installed (``pip install .``)::

    python examples/reshard_sync.py --steps 3

It starts 4 processes on this machine (gloo, CPU, loopback only). A trainer world of 2 trains a small transformer block
under FSDP2 (``fully_shard``: each parameter a ``DTensor`` sharded by rows, 61 vocabulary rows split 31/30). An engine
world of 2 holds the same model in a tensor-parallel layout, as vLLM lays it out: q/k/v fused into one column-parallel
``qkv_proj`` (2 K/V heads, one per engine rank), gate and up fused into one ``gate_up_proj``, ``o_proj`` and
``down_proj`` row-parallel (their columns split, where the trainer splits
rows: the boundaries cross), the rest replicated. The four processes join a
connected mode. Each step the trainer takes an optimizer step, every process calls ``reshard_state_dict`` (each trainer
sends each engine rank only the intersection of its shard and that rank's blocks), and the engine's forward must equal
the trainer's full-model forward on the same tokens. Every process prints what it sent and received; the exit code is
non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, TOKENS = 61, 48, 6, 2, 8, 80, 9
TP = 2
MODE = "WEIGHT_SYNC"


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``[T, heads * HEAD_DIM]`` queries on ``[T, kv_heads * HEAD_DIM]`` keys and values (GQA)."""
    t = q.shape[0]
    q, k, v = (x.view(t, -1, HEAD_DIM).transpose(0, 1) for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for x in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(t, -1)


class Block(nn.Module):
    """The trainer's model: one transformer block with separate q/k/v and gate/up projections."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.norm1 = nn.Parameter(torch.ones(DIM))
        self.norm2 = nn.Parameter(torch.ones(DIM))
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = rms_norm(x, self.norm1)
        x = x + self.o_proj(attention(self.q_proj(h), self.k_proj(h), self.v_proj(h)))
        h = rms_norm(x, self.norm2)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.lm_head(x)


class Engine:
    """One tensor-parallel rank of the engine: fused, sharded parameters, and the ``wanted`` slices that fill them."""

    def __init__(self, rank: int) -> None:
        from rlightning_comm.weights import layouts

        q, kv = HEADS // TP * HEAD_DIM, max(1, KV_HEADS // TP) * HEAD_DIM
        self.p = {
            "embed": torch.empty(VOCAB, DIM),
            "qkv_proj.weight": torch.empty(q + 2 * kv, DIM),
            "qkv_proj.bias": torch.empty(q + 2 * kv),
            "o_proj": torch.empty(DIM, HEADS * HEAD_DIM // TP),
            "norm1": torch.empty(DIM),
            "norm2": torch.empty(DIM),
            "gate_up_proj": torch.empty(2 * FFN // TP, DIM),
            "down_proj": torch.empty(DIM, FFN // TP),
            "lm_head": torch.empty(VOCAB, DIM),
        }
        p, heads = self.p, {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
        self.wanted = {
            "embed.weight": layouts.replicated(p["embed"]),
            **layouts.qkv(
                p["qkv_proj.weight"], rank, TP, names=("q_proj.weight", "k_proj.weight", "v_proj.weight"), **heads
            ),
            **layouts.qkv(p["qkv_proj.bias"], rank, TP, names=("q_proj.bias", "k_proj.bias", "v_proj.bias"), **heads),
            "o_proj.weight": layouts.row_parallel(p["o_proj"], rank, TP),
            "norm1": layouts.replicated(p["norm1"]),
            "norm2": layouts.replicated(p["norm2"]),
            **layouts.fused(p["gate_up_proj"], {"gate_proj.weight": FFN, "up_proj.weight": FFN}, rank, TP),
            "down_proj.weight": layouts.row_parallel(p["down_proj"], rank, TP),
            "lm_head.weight": layouts.replicated(p["lm_head"]),
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from rlightning_comm import CommMode, collective

        p, q, kv = self.p, HEADS // TP * HEAD_DIM, max(1, KV_HEADS // TP) * HEAD_DIM
        x = p["embed"][tokens]
        h = rms_norm(x, p["norm1"])
        qkv = h @ p["qkv_proj.weight"].T + p["qkv_proj.bias"]
        partial = attention(qkv[:, :q], qkv[:, q : q + kv], qkv[:, q + kv :]) @ p["o_proj"].T
        collective.all_reduce(partial, CommMode.GLOBAL)  # the row-parallel sum, in the engine's own world
        x = x + partial
        h = rms_norm(x, p["norm2"])
        gate, up = (h @ p["gate_up_proj"].T).chunk(2, dim=-1)
        partial = (F.silu(gate) * up) @ p["down_proj"].T
        collective.all_reduce(partial, CommMode.GLOBAL)
        return (x + partial) @ p["lm_head"].T


def member(role: str, local: int, folder: str, steps: int) -> None:
    """One process: rank ``local`` of the trainer or engine world, member ``2 * (role == "engine") + local`` of the
    connected mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlightning_comm import CommContext, collective, reshard_state_dict

    torch.set_num_threads(1)
    ctx = CommContext()
    ctx.init_distributed_env(world_size=2, rank=local, backend="gloo", dist_url=f"file://{folder}/{role}-store")
    me = local + (2 if role == "engine" else 0)
    published = Path(folder, "address")
    if me == 0:
        address = ctx.listen("127.0.0.1:0")
        Path(folder, "address.tmp").write_text(address)
        os.replace(Path(folder, "address.tmp"), published)
    else:
        deadline = time.monotonic() + 60
        while not published.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer's rank 0 did not publish the mode's address")
            time.sleep(0.01)
        address = published.read_text()
    ctx.connect(MODE, rank=me, world_size=4, address=address, timeout=60)

    torch.manual_seed(0)  # the same initial model on both trainer ranks (fully_shard keeps each rank's rows)
    if role == "trainer":
        model = Block()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        engine = Engine(local)
    failed = False
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (TOKENS + 1,), generator=gen)
        if role == "trainer":
            loss = F.cross_entropy(model(tokens[:-1]), tokens[1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            report = reshard_state_dict(held=dict(model.named_parameters()), comm_mode=MODE)
            with torch.no_grad():
                expected = model(tokens[:-1])  # the full model's forward (FSDP2 gathers for it)
        else:
            report = reshard_state_dict(wanted=engine.wanted, comm_mode=MODE)
            with torch.no_grad():
                got = engine.forward(tokens[:-1])
            expected = torch.empty_like(got)
        collective.broadcast(expected, MODE, src=0)  # the trainer's logits, to compare on the engine
        line = f"step {step} {role} {local}: sent {dict(report.sent)} received {dict(report.received)} bytes"
        if role == "engine":
            diff = (got - expected).abs().max().item()
            ok = torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
            failed |= not ok
            line += f"; engine forward {'==' if ok else '!='} trainer forward (max diff {diff:.2e})"
        line += f"; plan {'kept' if report.plan_cached else 'made'}\n"
        os.write(sys.stdout.fileno(), line.encode())  # one write: the four processes' lines do not interleave
    # Leave together: a member that leaves the mode while a peer's last call is in flight fails that call.
    Path(folder, f"done-{me}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(folder, f"done-{m}").exists() for m in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    ctx.destroy()
    if failed:
        raise SystemExit(1)


def _entry(role: str, local: int, folder: str, steps: int) -> None:
    try:
        member(role, local, folder, steps)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the processes are stopped")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    folder = tempfile.mkdtemp(prefix="reshard-sync-")
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(target=_entry, args=(role, local, folder, args.steps))
        for role in ("trainer", "engine")
        for local in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()  # ours, by its handle
            p.join()
        codes.append(p.exitcode)
    if any(codes):
        print(f"FAILED: exit codes {codes}", file=sys.stderr)
        return 1
    print(f"OK: {args.steps} steps, every engine forward equal to the trainer's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
