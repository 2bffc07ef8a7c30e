"""Ulysses attention in a tiny transformer block on 1, 2 and 4 ranks against the same block on one rank, and the
example."""

from __future__ import annotations

import math
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
from example_commands import documented, environment
from sp_oracle import SP, Checks, assert_all_within, data, init_sp

ROOT = Path(__file__).resolve().parent.parent
DIM = 16


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Attention written out by hand, [batch, seq, heads, head_dim] in and out: any callable can be plugged in."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


class Block(torch.nn.Module):
    """Pre-norm attention + MLP; ``attend(q, k, v)`` takes and returns [batch, seq, heads, head_dim]."""

    def __init__(self, heads: int, kv_heads: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.hd = heads, kv_heads, DIM // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.q = torch.nn.Linear(DIM, DIM)
        self.kv = torch.nn.Linear(DIM, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
        self.double()

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, self.hd)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        x = x + self.o(attend(q, k, v).reshape(b, s, DIM))
        return x + self.mlp(self.ln2(x))


def _check_block(chk: Checks, ctx, P: int, heads: int, kv_heads: int, S: int, sp_attend, ref_attend, tag: str) -> None:
    import torch.distributed as dist

    import rlightning_comm.sequence_parallel as sp

    X, W = data(S + heads, (2, S, DIM), (2, S, DIM))
    ref, model = Block(heads, kv_heads, seed=S), Block(heads, kv_heads, seed=S)
    rx = X.clone().requires_grad_()
    ry = ref(rx, ref_attend)
    ref_loss = (ry * W).sum() + ry.pow(2).mean()
    ref_loss.backward()

    x = X.clone().requires_grad_()
    lens = sp.sequence_split_sizes(S, P)  # unequal lengths are passed: the default is equal lengths
    attend = sp_attend if len(set(lens)) == 1 else partial(sp_attend, seq_lens=lens)
    y = sp.gather_from_sequence_parallel_region(
        model(sp.scatter_to_sequence_parallel_region(x, False), attend), False, seq_lens=lens
    )
    loss = (y * W).sum() + y.pow(2).mean()
    loss.backward()
    chk.close(f"{tag} output", y, ry)
    chk.close(f"{tag} loss", loss.detach(), ref_loss.detach())
    chk.close(f"{tag} input grad", x.grad, rx.grad)
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(
            grad, group=ctx.get_group(SP)
        )  # parameters see one chunk each: their gradients are partial, summed
        chk.close(f"{tag} grad {name}", grad, rp.grad)


def _task_block(rank: int, size: int, url: str) -> dict[str, float]:
    from functools import partial

    import rlightning_comm.sequence_parallel as sp

    ctx = init_sp(rank, size, url)
    chk = Checks()
    lengths = {1: [5], 2: [8, 7], 4: [8, 7, 3]}[size]  # even, uneven, and fewer tokens than ranks
    causal_sdpa = partial(sp.ulysses_attention, is_causal=True)
    for S in lengths:
        _check_block(chk, ctx, size, 4, 4, S, causal_sdpa, partial(sp.sdpa_bshd, is_causal=True), f"S={S} sdpa")
    # Two models with different head counts (and attention functions) in one process, no shared state.
    module = sp.UlyssesAttention(partial(_math_attention, causal=True))
    _check_block(chk, ctx, size, 8, 8, lengths[-1], module, partial(_math_attention, causal=True), "8 heads math")
    _check_block(chk, ctx, size, 4, 4, lengths[-1], causal_sdpa, partial(sp.sdpa_bshd, is_causal=True), "4 heads again")
    if size <= 2:  # grouped-query attention: 2 kv heads shard over at most 2 ranks
        gqa = partial(sp.ulysses_attention, is_causal=True, enable_gqa=True)
        _check_block(
            chk, ctx, size, 4, 2, lengths[-1], gqa, partial(sp.sdpa_bshd, is_causal=True, enable_gqa=True), "gqa"
        )
    # Lengths given explicitly give the same result.
    lens = sp.sequence_split_sizes(lengths[-1], size)
    given = partial(sp.ulysses_attention, is_causal=True, seq_lens=lens)
    _check_block(chk, ctx, size, 4, 4, lengths[-1], given, partial(sp.sdpa_bshd, is_causal=True), "seq_lens given")
    return chk.errors


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_transformer_block_with_ulysses_matches_one_rank(world) -> None:
    assert_all_within(world.run(_task_block, timeout=120))


def test_example_trains_with_matching_losses() -> None:
    proc = subprocess.run(
        documented("ulysses_attention.py", False, "--steps", "3"),
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, proc.stdout
    assert all("match" in line for line in steps), proc.stdout
