"""Each sequence-parallel op alone: forward values and float64 gradients against single-process torch on the full
tensor.

One task per world runs the whole battery (even and uneven lengths, several dims, every group form), so the spawned
ranks are reused.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within, data, init_sp, with_dim

# Sequence lengths per world size: even, uneven, and (where P allows) shorter than P so a rank holds nothing.
LENGTHS = {1: [4, 3], 2: [6, 5, 1], 4: [8, 7, 3]}


def _check_all_to_all(
    chk: Checks, mode, P: int, r: int, seed: int, lens: list[int], gd: int, sd: int, shape, pass_sizes: bool
) -> None:
    from rlightning_comm.sequence_parallel import all_to_all

    tag = f"all_to_all lens={lens} gd={gd} sd={sd} sizes={pass_sizes} "
    xs = data(seed, *[with_dim(shape, gd, n) for n in lens])
    leaves = [x.clone().requires_grad_() for x in xs]
    outs = torch.cat(leaves, gd).chunk(P, sd)  # the full tensor, re-sharded along sd
    ws = data(seed + 1, *[o.shape for o in outs])
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, ws)), leaves)

    x = xs[r].clone().requires_grad_()
    y = all_to_all(x, gd, sd, mode, gather_sizes=lens if pass_sizes else None)
    (y * ws[r]).sum().backward()
    chk.equal(tag + "forward", y, outs[r])
    chk.close(tag + "grad", x.grad, grads[r])
    chk.equal(tag + "input untouched", x.detach(), xs[r])
    chk.equal(
        tag + "non-contiguous input",
        all_to_all(_strided(xs[r]), gd, sd, mode, gather_sizes=lens if pass_sizes else None),
        outs[r],
    )

    # The way back (uneven scatter_sizes): sharded along sd -> sharded along gd.
    ys = [o.detach().clone().requires_grad_() for o in outs]
    backs = torch.cat(ys, sd).split(lens, gd)
    vs = data(seed + 2, *[b.shape for b in backs])
    grads = torch.autograd.grad(sum((b * v).sum() for b, v in zip(backs, vs)), ys)
    y = outs[r].detach().clone().requires_grad_()
    back = all_to_all(y, sd, gd, mode, scatter_sizes=lens, gather_sizes=[y.shape[sd]] * P if pass_sizes else None)
    (back * vs[r]).sum().backward()
    chk.equal(tag + "inverse forward", back, xs[r])
    chk.close(tag + "inverse grad", y.grad, grads[r])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (reversed dim order in memory)."""
    dims = list(range(t.dim()))[::-1]
    out = t.permute(dims).contiguous().permute(dims)
    return out


def _check_regions(
    chk: Checks, mode, P: int, r: int, seed: int, S: int, dim: int, shape, lens: list[int] | None
) -> None:
    import rlightning_comm.sequence_parallel as sp

    split = lens or [len(c) for c in torch.arange(S).tensor_split(P)]
    # The gathers' default is equal lengths: after an uneven default split they are told the lengths.
    gathered = lens if lens is not None or len(set(split)) == 1 else split
    tag = f"S={S} dim={dim} lens={lens} "
    full_shape = with_dim(shape, dim, S)
    (X,) = data(seed, full_shape)
    chunks = [with_dim(shape, dim, n) for n in split]
    Ws = data(seed + 1, *chunks)  # one weight per rank's chunk
    Wf = data(seed + 2, *[full_shape] * P)  # one weight per rank on the full tensor

    # scatter, rank0_only=False: X replicated; every rank gets dL/dX of L = sum_r <chunk_r, W_r>.
    want = torch.cat(Ws, dim)
    for rank0_only in (False, True):
        # rank0_only: only the first rank's X is read; the others pass a different tensor of the same shape.
        x = (X if rank0_only is False or r == 0 else X * 0 + 7).clone().requires_grad_()
        y = sp.scatter_to_sequence_parallel_region(x, rank0_only, dim=dim, mode=mode, seq_lens=lens)
        (y * Ws[r]).sum().backward()
        chk.equal(f"{tag}scatter r0={rank0_only} forward", y, X.split(split, dim)[r])
        zero = rank0_only and r != 0 and P > 1
        chk.equal(f"{tag}scatter r0={rank0_only} grad", x.grad, torch.zeros_like(X) if zero else want)

    # gather: chunk_r -> full X on every rank.
    for rank0_only in (False, True):
        x = X.split(split, dim)[r].clone().requires_grad_()
        y = sp.gather_from_sequence_parallel_region(x, rank0_only, dim=dim, mode=mode, seq_lens=gathered)
        # Every rank computes its own loss from the output; the contract says which ones count: rank0_only=False assumes
        # they are the same loss (replicated), rank0_only=True counts the first rank's.
        (y * (Wf[r] if rank0_only else Wf[0])).sum().backward()
        chk.equal(f"{tag}gather r0={rank0_only} forward", y, X)
        chk.equal(f"{tag}gather r0={rank0_only} grad", x.grad, Wf[0].split(split, dim)[r])

    # all_gather (Megatron): each rank's loss counts, so the gradient is the sum of every rank's.
    x = X.split(split, dim)[r].clone().requires_grad_()
    y = sp.all_gather_from_sequence_parallel_region(x, dim=dim, mode=mode, seq_lens=gathered)
    (y * Wf[r]).sum().backward()
    chk.equal(f"{tag}all_gather forward", y, X)
    chk.close(f"{tag}all_gather grad", x.grad, sum(Wf).split(split, dim)[r])

    # reduce_scatter: every rank holds a different full tensor; the value is their sum.
    parts = data(seed + 3, *[full_shape] * P)
    leaves = [p.clone().requires_grad_() for p in parts]
    outs = sum(leaves).split(split, dim)
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, Ws)), leaves)
    x = parts[r].clone().requires_grad_()
    y = sp.reduce_scatter_to_sequence_parallel_region(x, dim=dim, mode=mode, seq_lens=lens)
    (y * Ws[r]).sum().backward()
    chk.close(f"{tag}reduce_scatter forward", y, outs[r])
    chk.close(f"{tag}reduce_scatter grad", x.grad, grads[r])
    chk.equal(f"{tag}reduce_scatter input untouched", x.detach(), parts[r])

    # Non-contiguous inputs give the same values.
    chunk = X.split(split, dim)[r]
    chk.equal(
        f"{tag}strided scatter",
        sp.scatter_to_sequence_parallel_region(_strided(X), False, dim=dim, mode=mode, seq_lens=lens),
        chunk,
    )
    chk.equal(
        f"{tag}strided gather",
        sp.gather_from_sequence_parallel_region(_strided(chunk), False, dim=dim, mode=mode, seq_lens=gathered),
        X,
    )
    chk.equal(
        f"{tag}strided all_gather",
        sp.all_gather_from_sequence_parallel_region(_strided(chunk), dim=dim, mode=mode, seq_lens=gathered),
        X,
    )
    chk.close(
        f"{tag}strided reduce_scatter",
        sp.reduce_scatter_to_sequence_parallel_region(_strided(parts[r]), dim=dim, mode=mode, seq_lens=lens),
        outs[r],
    )


def _battery(chk: Checks, mode, P: int, r: int, seed: int) -> None:
    for S in LENGTHS[P]:
        for dim, shape in ((1, (2, S, 3)), (0, (S, 2, 3)), (2, (2, 3, S))):
            _check_regions(chk, mode, P, r, seed + S + 10 * dim, S, dim, shape, None)
    custom = [3, 0, 2, 1][:P] if P > 1 else [5]
    _check_regions(chk, mode, P, r, seed + 99, sum(custom), 1, (2, sum(custom), 3), custom)
    ulysses_lens = [[2] * P, [len(c) for c in torch.arange(7).tensor_split(P)], custom]
    for lens in ulysses_lens:
        # Unequal lengths are outside the default rule: they are always passed.
        defaults = (False, True) if len(set(lens)) == 1 else (True,)
        for pass_sizes in defaults:
            _check_all_to_all(chk, mode, P, r, seed + sum(lens), lens, 1, 2, (2, 0, 4, 3), pass_sizes)  # Ulysses layout
        _check_all_to_all(
            chk, mode, P, r, seed + 7, lens, 0, 2, (0, 2, 4), defaults[0]
        )  # gather on the leading dim (no copy)
        _check_all_to_all(chk, mode, P, r, seed + 8, lens, 2, 0, (4, 3, 0), defaults[0])  # scatter on the leading dim


def _task_battery(rank: int, size: int, url: str) -> dict[str, float]:
    import torch.distributed as dist

    from rlightning_comm import CommContext

    ctx = init_sp(rank, size, url)
    chk = Checks()
    _battery(chk, SP, size, rank, seed=1000)
    # The same op through each form of group gives the same result.
    from rlightning_comm.sequence_parallel import all_to_all

    (x,) = data(5 + rank, (2, 3, 4, 2))
    want = all_to_all(x, 1, 2, SP)
    for form in (
        ctx.get_communicator(SP),
        ctx.get_group(SP),
        dist.group.WORLD,
        CommContext().get_communicator("GLOBAL"),
    ):
        chk.equal(f"group form {type(form).__name__}", all_to_all(x, 1, 2, form), want)
    return chk.errors


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_each_op_matches_single_process_autograd(world) -> None:
    assert_all_within(world.run(_task_battery, timeout=120))


def _task_subgroups(rank: int, size: int, url: str) -> dict[str, float]:
    # Two SP groups [0, 1] and [2, 3]: "first rank" is the group's first (global 0 or 2), data differ per group.
    init_sp(rank, size, url, partition=[[0, 1], [2, 3]], mode="SP_PAIRS")
    chk = Checks()
    _battery(chk, "SP_PAIRS", 2, rank % 2, seed=2000 + 500 * (rank // 2))
    return chk.errors


def test_ops_on_partitioned_groups(world4) -> None:
    assert_all_within(world4.run(_task_subgroups, timeout=120))


def _task_world1_no_collective(rank: int, size: int, url: str) -> dict[str, float]:
    import torch.distributed as dist

    init_sp(rank, size, url)

    from rlightning_comm.sequence_parallel._resolve import Group

    def forbidden(*args, **kwargs):
        raise RuntimeError("a collective ran with one rank")

    names = [n for n in dir(dist) if n.startswith(("all_", "reduce", "scatter", "gather", "broadcast"))]
    saved = {n: getattr(dist, n) for n in names}
    group_saved = {n: getattr(Group, n) for n in ("all_to_all", "all_gather", "reduce_scatter")}
    try:
        for name in saved:
            setattr(dist, name, forbidden)
        for name in group_saved:
            setattr(Group, name, forbidden)
        return _identity_checks()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for name, fn in group_saved.items():
            setattr(Group, name, fn)


def _identity_checks() -> dict[str, float]:
    import rlightning_comm.sequence_parallel as sp

    chk = Checks()
    (x,) = data(3, (2, 5, 4, 3))
    ops = {
        "all_to_all": lambda t: sp.all_to_all(t, 1, 2, SP),
        "scatter": lambda t: sp.scatter_to_sequence_parallel_region(t),
        "scatter split": lambda t: sp.scatter_to_sequence_parallel_region(t, False, legacy_grad_scale=True),
        "gather": lambda t: sp.gather_from_sequence_parallel_region(t),
        "all_gather": lambda t: sp.all_gather_from_sequence_parallel_region(t),
        "reduce_scatter": lambda t: sp.reduce_scatter_to_sequence_parallel_region(t),
        "ulysses": lambda t: sp.ulysses_attention(t, t, t) - sp.sdpa_bshd(t, t, t),
    }
    for name, op in ops.items():
        leaf = x.clone().requires_grad_()
        out = op(leaf)
        if name != "ulysses":
            chk.true(f"{name} returns its input", out is leaf)
        else:
            chk.equal("ulysses equals plain attention", out, torch.zeros_like(x))
        out.sum().backward()
        chk.true(f"{name} backward ran", leaf.grad is not None)
    return chk.errors


def test_world_size_one_is_identity_without_collectives(world1) -> None:
    assert_all_within(world1.run(_task_world1_no_collective))


def test_exports() -> None:
    import rlightning_comm
    import rlightning_comm.sequence_parallel as sp
    from rlightning_comm import collective

    expected = [
        "UlyssesAttention",
        "all_gather_from_sequence_parallel_region",
        "all_to_all",
        "gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
        "scatter_to_sequence_parallel_region",
        "sdpa_bshd",
        "sequence_split_sizes",
        "ulysses_attention",
    ]
    assert sp.__all__ == expected
    assert rlightning_comm.__all__ == sorted(rlightning_comm.__all__)
    for name in expected:
        if name != "sdpa_bshd":
            assert getattr(rlightning_comm, name) is getattr(sp, name)
    seed = {
        "all_to_all": ["input_", "gather_dim", "scatter_dim", "group"],
        "scatter_to_sequence_parallel_region": ["input_", "rank0_only"],
        "gather_from_sequence_parallel_region": ["input_", "rank0_only"],
    }
    for name, params in seed.items():
        fn = getattr(collective, name)
        assert fn is getattr(sp, name)
        assert list(inspect.signature(fn).parameters)[: len(params)] == params, name
    assert inspect.signature(sp.scatter_to_sequence_parallel_region).parameters["rank0_only"].default is True
    assert inspect.signature(sp.gather_from_sequence_parallel_region).parameters["rank0_only"].default is True


def test_sequence_split_sizes_matches_tensor_split() -> None:
    from rlightning_comm.sequence_parallel import sequence_split_sizes

    for length in range(11):
        for ws in range(1, 6):
            assert sequence_split_sizes(length, ws) == [len(c) for c in torch.arange(length).tensor_split(ws)]
    with pytest.raises(ValueError, match="world_size"):
        sequence_split_sizes(4, 0)
