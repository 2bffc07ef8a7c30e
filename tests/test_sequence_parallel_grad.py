"""Compositions of the sequence-parallel ops (the seed's scatter -> model -> gather, Megatron's pair), gradcheck,
the legacy scaling option, and differential checks against torch.distributed.nn.functional."""

from __future__ import annotations

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within, data, init_sp

B, E, HID = 2, 5, 6


def _mlp_params(seed: int) -> list[torch.Tensor]:
    return data(seed, (HID, E), (HID,), (E, HID), (E,))


def _mlp(x: torch.Tensor, p: list[torch.Tensor]) -> torch.Tensor:
    return torch.tanh(x @ p[0].T + p[1]) @ p[2].T + p[3]


def _loss(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (y * w).sum() + (y**2).mean()


def _sum_over_group(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """What the user does with the partial parameter gradients: all-reduce SUM over the SP group (raw
    torch.distributed)."""
    import torch.distributed as dist

    out = [g.clone() for g in grads]
    for g in out:
        dist.all_reduce(g, group=group)
    return out


def _check_seed_composition(chk: Checks, ctx, P: int, r: int, S: int, rank0_only: bool, legacy: bool) -> None:
    """scatter -> token-wise MLP -> gather -> the same loss on every rank, against the MLP on the full sequence."""
    import rlightning_comm.sequence_parallel as sp

    tag = f"seed composition S={S} rank0_only={rank0_only} legacy={legacy} "
    X, W = data(S, (B, S, E), (B, S, E))
    params = _mlp_params(7)
    ref_x, ref_p = X.clone().requires_grad_(), [p.clone().requires_grad_() for p in params]
    ref_loss = _loss(_mlp(ref_x, ref_p), W)
    ref_grads = torch.autograd.grad(ref_loss, [ref_x, *ref_p])

    x = (X if not rank0_only or r == 0 else torch.zeros_like(X)).clone().requires_grad_()
    ps = [p.clone().requires_grad_() for p in params]
    lens = sp.sequence_split_sizes(S, P)  # the scatter's default split; the gather's default is equal lengths
    local = sp.scatter_to_sequence_parallel_region(x, rank0_only, legacy_grad_scale=legacy)
    y = sp.gather_from_sequence_parallel_region(_mlp(local, ps), rank0_only, legacy_grad_scale=legacy, seq_lens=lens)
    loss = _loss(y, W)
    loss.backward()
    chk.close(tag + "loss", loss.detach(), ref_loss.detach())
    zero = rank0_only and r != 0 and P > 1
    chk.close(tag + "input grad", x.grad, torch.zeros_like(X) if zero else ref_grads[0])
    # Parameters are replicated and each rank saw its own chunk: their gradients are partial. The exact rule wants them
    # summed over the group; legacy scaling multiplied each by P, so it wants them averaged.
    summed = _sum_over_group([p.grad for p in ps], ctx.get_group(SP))
    for i, (got, want) in enumerate(zip(summed, ref_grads[1:])):
        chk.close(tag + f"param {i} grad", got / P if legacy else got, want)


def _check_megatron_chain(chk: Checks, P: int, r: int, S: int) -> None:
    """Megatron SP+TP: all-gather -> column-parallel -> row-parallel -> reduce-scatter, inside scatter/gather."""
    import rlightning_comm.sequence_parallel as sp

    tag = f"megatron chain S={S} "
    X, W = data(S + 1, (B, S, E), (B, S, E))
    A, Bm = data(11, (E, 4 * P), (4 * P, E))  # hidden width 4P, so each rank owns 4 columns of A and 4 rows of B
    rx, rA, rB = (t.clone().requires_grad_() for t in (X, A, Bm))
    ref_loss = _loss(torch.tanh(rx @ rA) @ rB, W)
    ref = torch.autograd.grad(ref_loss, [rx, rA, rB])

    x = X.clone().requires_grad_()
    a = A[:, 4 * r : 4 * r + 4].clone().requires_grad_()
    b = Bm[4 * r : 4 * r + 4].clone().requires_grad_()
    lens = sp.sequence_split_sizes(S, P)
    shard = sp.scatter_to_sequence_parallel_region(x, False)
    full = sp.all_gather_from_sequence_parallel_region(shard, seq_lens=lens)
    partial = torch.tanh(full @ a) @ b
    y = sp.gather_from_sequence_parallel_region(
        sp.reduce_scatter_to_sequence_parallel_region(partial), False, seq_lens=lens
    )
    loss = _loss(y, W)
    loss.backward()
    chk.close(tag + "loss", loss.detach(), ref_loss.detach())
    chk.close(tag + "input grad", x.grad, ref[0])
    chk.close(tag + "column shard grad", a.grad, ref[1][:, 4 * r : 4 * r + 4])
    chk.close(tag + "row shard grad", b.grad, ref[2][4 * r : 4 * r + 4])


def _check_legacy_alone(chk: Checks, P: int, r: int) -> None:
    """legacy_grad_scale multiplies the exact gradient by exactly 1/P (scatter) or P (gather), and nothing else."""
    import rlightning_comm.sequence_parallel as sp

    X, W = data(42, (B, 5, E), (B, 5, E))

    def scatter_grad(legacy: bool) -> torch.Tensor:
        x = X.clone().requires_grad_()
        (
            sp.scatter_to_sequence_parallel_region(x, False, legacy_grad_scale=legacy) * W.tensor_split(P, 1)[r]
        ).sum().backward()
        return x.grad

    def gather_grad(legacy: bool) -> torch.Tensor:
        x = X.tensor_split(P, 1)[r].clone().requires_grad_()
        (
            sp.gather_from_sequence_parallel_region(
                x, False, legacy_grad_scale=legacy, seq_lens=sp.sequence_split_sizes(5, P)
            )
            * W
        ).sum().backward()
        return x.grad

    chk.close("legacy scatter grad = exact / P", scatter_grad(True), scatter_grad(False) / P)
    chk.close("legacy gather grad = exact * P", gather_grad(True), gather_grad(False) * P)


def _gradchecks(chk: Checks, P: int) -> None:
    """gradcheck where it applies: the input is replicated (every rank perturbs it alike) and so is the output."""
    import rlightning_comm.sequence_parallel as sp

    lens5, lens3 = sp.sequence_split_sizes(5, P), sp.sequence_split_sizes(3, P)

    def seed_chain(x):
        return sp.gather_from_sequence_parallel_region(
            torch.tanh(sp.scatter_to_sequence_parallel_region(x, False)) * 1.5, False, seq_lens=lens5
        )

    def megatron_chain(x):
        scale = 1.0 + torch.distributed.get_rank()  # a different partial on every rank
        full = sp.all_gather_from_sequence_parallel_region(
            sp.scatter_to_sequence_parallel_region(x, False), seq_lens=lens5
        )
        return sp.gather_from_sequence_parallel_region(
            sp.reduce_scatter_to_sequence_parallel_region(torch.sin(full) * scale), False, seq_lens=lens5
        )

    def ulysses_chain(q, k, v):
        parts = [sp.scatter_to_sequence_parallel_region(t, False) for t in (q, k, v)]
        return sp.gather_from_sequence_parallel_region(
            sp.ulysses_attention(*parts, is_causal=True, seq_lens=lens3), False, seq_lens=lens3
        )

    (X,) = data(3, (1, 5, 2))
    q, k, v = (t.requires_grad_() for t in data(4, (1, 3, 4, 1), (1, 3, 4, 1), (1, 3, 4, 1)))
    # fast_mode checks the Jacobian along random directions instead of element by element: far fewer collectives, which
    # are slow on a loaded machine with 4 ranks. Element by element up to 2 ranks.
    fast = P > 2
    chk.true(
        "gradcheck scatter->tanh->gather",
        torch.autograd.gradcheck(seed_chain, (X.clone().requires_grad_(),), fast_mode=fast),
    )
    chk.true(
        "gradgradcheck scatter->tanh->gather",
        torch.autograd.gradgradcheck(seed_chain, (X.clone().requires_grad_(),), fast_mode=fast),
    )
    chk.true(
        "gradcheck megatron chain",
        torch.autograd.gradcheck(megatron_chain, (X.clone().requires_grad_(),), fast_mode=fast),
    )
    chk.true("gradcheck ulysses chain", torch.autograd.gradcheck(ulysses_chain, (q, k, v), fast_mode=True))


def _task_compositions(rank: int, size: int, url: str) -> dict[str, float]:
    ctx = init_sp(rank, size, url)
    chk = Checks()
    for S in (4 * size, 4 * size - 1):
        for rank0_only in (True, False):
            for legacy in (False, True):
                _check_seed_composition(chk, ctx, size, rank, S, rank0_only, legacy)
        _check_megatron_chain(chk, size, rank, S)
    _check_legacy_alone(chk, size, rank)
    _gradchecks(chk, size)
    return chk.errors


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_compositions_and_gradcheck(world) -> None:
    assert_all_within(world.run(_task_compositions, timeout=150))


def _task_against_torch(rank: int, size: int, url: str) -> dict[str, float]:
    """The same op through torch.distributed.nn.functional (world group) and through ours: forward and gradients
    agree."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as tdnf

    import rlightning_comm.sequence_parallel as sp

    init_sp(rank, size, url)
    # torch.distributed.nn.functional's default group is group.WORLD as of its import; these processes outlive worlds.
    world = dist.group.WORLD
    chk = Checks()
    P, a, c = size, 3, 2
    split = [2, 0, 3, 1][:P]  # uneven, the same list on every rank
    (x, w_out) = data(10 + rank, (P * a, c), (P * a, c))

    # all_to_all_single, even and uneven splits: ours on x viewed [1, L, c] with gather_dim 0 is torch's [P, chunk, c].
    for sizes in ([a] * P, split):
        L = sum(sizes)
        xt, xo = (x[:L].clone().requires_grad_() for _ in range(2))
        out_t = tdnf.all_to_all_single(
            torch.empty(P * sizes[rank], c, dtype=x.dtype), xt, [sizes[rank]] * P, sizes, group=world
        )
        out_o = sp.all_to_all(xo.view(1, L, c), 0, 1, dist.group.WORLD, scatter_sizes=sizes).reshape(P * sizes[rank], c)
        w = w_out[: P * sizes[rank]]
        (out_t * w).sum().backward()
        (out_o * w).sum().backward()
        chk.equal(f"all_to_all_single sizes={sizes} forward", out_o, out_t)
        chk.equal(f"all_to_all_single sizes={sizes} grad", xo.grad, xt.grad)

    # all_gather (backward: sum over ranks) = our Megatron all-gather.
    xt, xo = (x.clone().requires_grad_() for _ in range(2))
    out_t = torch.cat(tdnf.all_gather(xt, group=world), 0)
    out_o = sp.all_gather_from_sequence_parallel_region(xo, dim=0, mode=dist.group.WORLD)
    (w,) = data(20 + rank, out_t.shape)
    (out_t * w).sum().backward()
    (out_o * w).sum().backward()
    chk.equal("all_gather forward", out_o, out_t)
    chk.close("all_gather grad", xo.grad, xt.grad)

    # reduce_scatter (list of chunks) = our reduce-scatter on the concatenation.
    xt, xo = (x.clone().requires_grad_() for _ in range(2))
    out_t = tdnf.reduce_scatter(torch.empty(a, c, dtype=x.dtype), list(xt.chunk(P, 0)), group=world)
    out_o = sp.reduce_scatter_to_sequence_parallel_region(xo, dim=0, mode=dist.group.WORLD)
    (w,) = data(30 + rank, (a, c))
    (out_t * w).sum().backward()
    (out_o * w).sum().backward()
    chk.close("reduce_scatter forward", out_o, out_t)
    chk.close("reduce_scatter grad", xo.grad, xt.grad)

    # scatter from rank 0 (backward: gather to rank 0, zeros elsewhere) = ours with rank0_only=True.
    xt, xo = (x.clone().requires_grad_() for _ in range(2))
    out_t = tdnf.scatter(list(xt.chunk(P, 0)), src=0, group=world)
    out_o = sp.scatter_to_sequence_parallel_region(xo, True, dim=0, mode=dist.group.WORLD)
    (out_t * w).sum().backward()
    (out_o * w).sum().backward()
    chk.equal("scatter forward", out_o, out_t)
    chk.equal("scatter grad", xo.grad, xt.grad)
    return chk.errors


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_differential_against_torch_distributed_nn(world) -> None:
    assert_all_within(world.run(_task_against_torch))
