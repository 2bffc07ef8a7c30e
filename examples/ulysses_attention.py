"""Train a tiny attention model with Ulysses sequence parallelism and check it against single-process training.

From the repository root, with the package installed (``pip install .``). On its own it spawns 4 local gloo ranks
that meet through a file store (no launcher, gloo on loopback; ``--nprocs N`` for another count)::

    python examples/ulysses_attention.py

or, under torchrun, each process is one rank::

    torchrun --nproc-per-node 4 examples/ulysses_attention.py

Every rank trains the same model two ways, step by step: sequence-parallel (the sequence split across the ranks,
attention through ``ulysses_attention``, parameter gradients summed over the group) and on the whole sequence in one
process. Rank 0 prints both losses per step; any rank exits non-zero if they differ. The sequence length (30 by default)
does not divide by 4: the ranks hold 8, 8, 7 and 7 tokens.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.distributed as dist

from rlightning_comm import CommContext, CommMode
from rlightning_comm.launch import run
from rlightning_comm.sequence_parallel import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    sdpa_bshd,
    sequence_split_sizes,
    ulysses_attention,
)

SP = CommMode.SEQUENCE_PARALLEL
RTOL = 1e-9  # float64: the two runs differ only in the order of floating-point sums


class TinyAttentionModel(torch.nn.Module):
    """Two pre-norm attention + MLP blocks; ``attend(q, k, v)`` works on [batch, seq, heads, head_dim]."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "ln1": torch.nn.LayerNorm(dim),
                    "qkv": torch.nn.Linear(dim, 3 * dim),
                    "out": torch.nn.Linear(dim, dim),
                    "ln2": torch.nn.LayerNorm(dim),
                    "mlp": torch.nn.Sequential(
                        torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
                    ),
                }
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, s, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            x = x + blk["out"](attend(q, k, v).reshape(b, s, d))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


@torch.no_grad()
def sgd_step(model: torch.nn.Module, lr: float = 0.1) -> None:
    """Plain SGD, written out (and cheaper to start than torch.optim)."""
    for p in model.parameters():
        p -= lr * p.grad


def train(rank: int, world_size: int, steps: int, seq: int) -> bool:
    """Train both ways on this rank; return whether every step's losses matched."""
    torch.manual_seed(0)  # same model, data and targets on every rank
    model = TinyAttentionModel().double()
    reference = TinyAttentionModel().double()
    reference.load_state_dict(model.state_dict())
    sp_group = CommContext().get_group(SP)
    # Every rank knows the split (torch.tensor_split's), so the ops need not exchange lengths.
    lens = sequence_split_sizes(seq, world_size)
    causal_ulysses = partial(ulysses_attention, is_causal=True, seq_lens=lens)
    causal_sdpa = partial(sdpa_bshd, is_causal=True)
    x = torch.randn(2, seq, 32, dtype=torch.float64)
    target = torch.randn(2, seq, 32, dtype=torch.float64)
    all_match = True
    for step in range(steps):
        # Sequence-parallel: each rank runs its chunk of the sequence; attention sees all of it through Ulysses.
        local = scatter_to_sequence_parallel_region(x, rank0_only=False)
        y = gather_from_sequence_parallel_region(model(local, causal_ulysses), rank0_only=False, seq_lens=lens)
        loss = torch.nn.functional.mse_loss(y, target)
        model.zero_grad()
        loss.backward()
        # Each rank's parameter gradients cover its own tokens: sum them over the group, in one collective.
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=sp_group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))
        sgd_step(model)

        # Single process, whole sequence.
        ref_loss = torch.nn.functional.mse_loss(reference(x, causal_sdpa), target)
        reference.zero_grad()
        ref_loss.backward()
        sgd_step(reference)

        match = abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
        all_match &= match
        if rank == 0:
            verdict = "match" if match else "MISMATCH"
            print(
                f"step {step}: sequence-parallel loss {loss.item():.12f}  single-process loss {ref_loss.item():.12f}  "
                f"{verdict}",
                flush=True,
            )
    return all_match


def main(steps: int, seq: int) -> None:
    """One rank's work; :func:`rlightning_comm.launch.run` has initialised the context."""
    torch.set_num_threads(1)  # the ranks share this machine's cores; more threads each would only contend
    ctx = CommContext()
    rank, world_size = ctx.get_global_rank(), ctx.get_world_size()
    ctx.init_group(list(range(world_size)), SP)
    if not train(rank, world_size, steps, seq):
        raise SystemExit(1)
    if rank == 0:
        print(
            f"sequence-parallel training on {world_size} ranks matched single-process training for {steps} steps",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=30, help="sequence length (need not divide by the number of ranks)")
    parser.add_argument("--nprocs", type=int, default=4, help="ranks to spawn when not launched by torchrun")
    args = parser.parse_args()
    try:
        run(main, args.nprocs, args.steps, args.seq)  # under torchrun: this process is one rank
    except RuntimeError as err:
        sys.exit(f"{err}")
