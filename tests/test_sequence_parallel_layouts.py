"""Backward takes any gradient layout autograd produces: expanded (``.sum()``), ``.mean()``, sliced, transposed.

For every op (both ``rank0_only`` settings) and ``ulysses_attention``, each rank's loss is a different function of the
op's output; the oracle is single-process autograd of the same total loss on the full tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from sp_oracle import Checks, assert_all_within, init_sp
from sp_oracle import data as _data

B, H, D = 2, 4, 3
KINDS = ("sum", "mean", "strided", "transposed")


def _loss(kind: str, out: torch.Tensor, scale: float) -> torch.Tensor:
    """A loss whose gradient reaches ``out`` expanded, scaled, sliced or transposed."""
    if kind == "sum":
        return out.sum() * scale  # a stride-0 gradient
    if kind == "mean":
        return out.mean() * scale
    if kind == "strided":
        return out[..., ::2].sum() * scale  # zeros between the slices
    (a,) = _data(int(out.shape[-2]), (out.shape[-2], 3))
    a = a.to(out.device)
    return (out.transpose(-1, -2) @ a).square().sum() * scale  # a transposed gradient


def _check(
    chk: Checks,
    tag: str,
    P: int,
    r: int,
    full: torch.Tensor,
    local: Callable[[torch.Tensor], torch.Tensor],
    op,
    oracle,
    scale,
    own=None,
) -> None:
    """``op(local(x))`` on this rank against autograd of ``sum_j scale(j) * loss(oracle(X, j))`` on the full tensor.

    This rank's loss is ``own`` times its term (``scale(r)`` by default).
    """
    for kind in KINDS:
        X = full.clone().requires_grad_()
        total = sum(_loss(kind, oracle(X, j), scale(j)) for j in range(P))
        (want,) = torch.autograd.grad(total, X)
        x = local(full).clone().requires_grad_()
        out = op(x)
        _loss(kind, out, scale(r) if own is None else own).backward()
        chk.close(f"{tag} {kind} forward", out, oracle(full, r))
        chk.close(f"{tag} {kind} grad", x.grad, local(want))


def _task(rank: int, size: int, url: str) -> dict[str, float]:
    init_sp(rank, size, url)
    return run_checks(size, rank, torch.device("cpu"))


def run_checks(P: int, r: int, device: torch.device) -> dict[str, float]:
    """Every op under every loss kind on ``device``, on this rank of a bound SEQUENCE_PARALLEL group of P ranks."""
    import rlightning_comm.sequence_parallel as sp

    chk = Checks()
    S = 3 * P

    def data(seed, *shapes):
        return [t.to(device) for t in _data(seed, *shapes)]

    (X,) = data(S, (B, S, H, D))
    chunk = lambda t, j=r: t[:, 3 * j : 3 * j + 3]
    heads = lambda t, j: t[:, :, j * H // P : (j + 1) * H // P]
    per_rank = lambda j: 1.0 + j  # (each rank's loss counts differently)
    once = lambda j: 1.0 if j == 0 else 0.0  # (one loss, computed alike on every rank)

    _check(chk, "all_to_all", P, r, X, chunk, lambda x: sp.all_to_all(x, 1, 2, "SEQUENCE_PARALLEL"), heads, per_rank)
    _check(
        chk,
        "all_gather",
        P,
        r,
        X,
        chunk,
        lambda x: sp.all_gather_from_sequence_parallel_region(x),
        lambda t, j: t,
        per_rank,
    )
    # rank0_only=False gather: exact when every rank computes the same loss.
    _check(
        chk,
        "gather r0=False",
        P,
        r,
        X,
        chunk,
        lambda x: sp.gather_from_sequence_parallel_region(x, False),
        lambda t, j: t,
        once,
        own=1.0,
    )
    # rank0_only=True gather: only the first rank's loss counts.
    first = lambda j: 2.0 if j == 0 else 0.0
    x = chunk(X).clone().requires_grad_()
    for kind in KINDS:
        x.grad = None
        _loss(kind, sp.gather_from_sequence_parallel_region(x), 2.0 if r == 0 else 5.0 + r).backward()
        Xf = X.clone().requires_grad_()
        (want,) = torch.autograd.grad(sum(_loss(kind, Xf, first(j)) for j in range(P)), Xf)
        chk.close(f"gather r0=True {kind} grad", x.grad, chunk(want))
    # Scatters: X replicated (rank0_only=False), or read on the first rank only (others pass other values).
    _check(
        chk,
        "scatter r0=False",
        P,
        r,
        X,
        lambda t: t,
        lambda x: sp.scatter_to_sequence_parallel_region(x, False),
        lambda t, j: chunk(t, j),
        per_rank,
    )
    for kind in KINDS:
        x = (X if r == 0 else X + 3.0).clone().requires_grad_()
        out = sp.scatter_to_sequence_parallel_region(x)
        _loss(kind, out, per_rank(r)).backward()
        Xf = X.clone().requires_grad_()
        (want,) = torch.autograd.grad(sum(_loss(kind, chunk(Xf, j), per_rank(j)) for j in range(P)), Xf)
        chk.close(f"scatter r0=True {kind} forward", out, chunk(X))
        chk.close(f"scatter r0=True {kind} grad", x.grad, want if r == 0 else torch.zeros_like(X))
    # reduce_scatter: every rank's full-length partial; the value is their sum.
    parts = data(S + 1, *[(B, S, H, D)] * P)
    for kind in KINDS:
        leaves = [p.clone().requires_grad_() for p in parts]
        total = sum(leaves)
        grads = torch.autograd.grad(sum(_loss(kind, chunk(total, j), per_rank(j)) for j in range(P)), leaves)
        x = parts[r].clone().requires_grad_()
        out = sp.reduce_scatter_to_sequence_parallel_region(x)
        _loss(kind, out, per_rank(r)).backward()
        chk.close(f"reduce_scatter {kind} forward", out, chunk(sum(parts)))
        chk.close(f"reduce_scatter {kind} grad", x.grad, grads[r])
    # ulysses_attention: q, k, v sequence-sharded; attention on the full sequence.
    q, k, v = data(S + 2, (B, S, H, D), (B, S, H, D), (B, S, H, D))
    for kind in KINDS:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = sp.sdpa_bshd(*full, is_causal=True)
        grads = torch.autograd.grad(sum(_loss(kind, chunk(ref, j), per_rank(j)) for j in range(P)), full)
        local = [chunk(t).clone().requires_grad_() for t in (q, k, v)]
        out = sp.ulysses_attention(*local, is_causal=True)
        _loss(kind, out, per_rank(r)).backward()
        chk.close(f"ulysses {kind} forward", out, chunk(ref))
        for name, got, want in zip("qkv", local, grads):
            chk.close(f"ulysses {kind} d{name}", got.grad, chunk(want))
    return chk.errors


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_backward_takes_every_gradient_layout(world) -> None:
    assert_all_within(world.run(_task, timeout=120))
