"""Differentiable sequence-parallel communication: thin public functions over the Functions in ``_functions.py``.

The gradient contract (see the sequence-parallelism guide, docs/sequence-parallel.md, for the table): every backward is
the exact gradient of one global loss under the assumption its docstring names. Words used below:

* replicated: every rank of the group holds the same value (or the same gradient);
* sharded: rank r holds chunk r along ``dim``;
* partial: the value that matters is the sum over the ranks of what each rank holds.

Every rank of the group must call each op, and run backward through it, in the same order: the backward is a collective
too. With one rank every op returns its input unchanged and communicates nothing.

Lengths. Each op runs exactly one collective forward and one backward, and never exchanges lengths: without
``seq_lens=`` (``gather_sizes=`` / ``scatter_sizes=`` for :func:`all_to_all`) they follow one rule.

* Gather-type ops (the gathers, :func:`all_to_all`'s ``gather_dim``, :func:`~.ulysses.ulysses_attention`): every rank
  holds the same local shape.
* Scatter-type ops (the scatters, the reduce-scatter): the ``torch.tensor_split`` split of the full length
  (:func:`~._sizes.sequence_split_sizes`), which every rank holds. With ``rank0_only=True`` the data are the source's
  (group rank 0): the others pass a tensor of the same shape, whose values are not read.

Any other lengths are passed explicitly, the same list on every rank. Every local check runs before the collective, on
every rank alike. A length that breaks the rule on one rank only cannot be seen locally: in debug mode
(``CommContext().set_debug(True)``) every rank raises ``CommMismatchError`` naming each rank's shapes before anything is
sent; in default mode the collective fails as any mismatched collective does (gloo may abort).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlightning_comm.modes import CommMode
from rlightning_comm.sequence_parallel._functions import (
    _AllGather,
    _Gather,
    _GatherFirstGrad,
    _ReduceScatter,
    _ScatterFromFirst,
    _Split,
    apply_all_to_all,
)
from rlightning_comm.sequence_parallel._resolve import check_flag, check_input, normalize_dim, resolve_group
from rlightning_comm.sequence_parallel._sizes import local_sizes, split_sizes

_SP = CommMode.SEQUENCE_PARALLEL


def all_to_all(
    input_: torch.Tensor,
    gather_dim: int,
    scatter_dim: int,
    group: Any,
    *,
    gather_sizes: Sequence[int] | None = None,
    scatter_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Re-shard: split ``scatter_dim`` across the group and concatenate ``gather_dim`` from it.

    forward: one ``all_to_all_single`` on one contiguous buffer: chunk j of
    ``scatter_dim`` goes to rank j, and the chunks received are concatenated along ``gather_dim`` in rank order.
    backward: the inverse all-to-all (``gather_dim`` and ``scatter_dim`` swapped). This is the exact gradient with no
    assumption: the op is a permutation of the elements held across the group, and its inverse is its transpose.

    Ulysses: ``all_to_all(x, 1, 2, group)`` turns a sequence-sharded
    ``[b, s/P, h, d]`` into a head-sharded ``[b, s, h/P, d]``; ``all_to_all(y, 2, 1, group, scatter_sizes=lens)`` goes
    back.

    Args:
        input_: Any strides; ranks must agree on every dim but ``gather_dim``.
        gather_dim: Dim to concatenate along; its length may differ between ranks.
        scatter_dim: Dim to split across the group.
        group: A :class:`CommMode` or its string, a :class:`Communicator`, or a torch ``ProcessGroup``.
        gather_sizes: Every rank's length along ``gather_dim``. ``None``: every rank's is this rank's (equal local
            shapes). Given, it is checked against this rank's length only.
        scatter_sizes: The length of ``scatter_dim`` each rank receives; ``None`` splits evenly. Same list on every
            rank.

    Returns:
        A new contiguous tensor; ``input_`` itself with one rank.

    Raises:
        TypeError: ``input_`` is not a tensor, or a bad ``group``.
        ValueError: equal or out-of-range dims, ``scatter_dim`` not divisible by the group size, or sizes that do not
            fit.
    """
    g = resolve_group(group)
    check_input(input_, g)
    gather_dim = normalize_dim(gather_dim, input_.dim(), "gather_dim")
    scatter_dim = normalize_dim(scatter_dim, input_.dim(), "scatter_dim")
    if gather_dim == scatter_dim:
        raise ValueError(f"gather_dim and scatter_dim must differ; both are {gather_dim}")
    n = input_.shape[scatter_dim]
    if scatter_sizes is not None:
        send_sizes = split_sizes(n, g, scatter_sizes, "scatter_sizes")
    elif n % g.world_size:
        raise ValueError(
            f"scatter_dim {scatter_dim} has size {n}, which is not divisible by the group size {g.world_size} "
            f"({g.name}); "
            "pass scatter_sizes= to split it unevenly"
        )
    else:
        send_sizes = [n // g.world_size] * g.world_size
    recv_sizes = local_sizes(input_, gather_dim, g, gather_sizes, "gather_sizes")
    if g.world_size == 1:
        return input_
    (out,) = apply_all_to_all(g, scatter_dim, [send_sizes], gather_dim, [recv_sizes], input_)
    return out


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    rank0_only: bool = True,
    *,
    dim: int = 1,
    mode: Any = _SP,
    seq_lens: Sequence[int] | None = None,
    legacy_grad_scale: bool = False,
) -> torch.Tensor:
    """Split a full sequence so that group rank r keeps chunk r along ``dim``.

    ``rank0_only=False``: forward: keep this rank's chunk of the local, replicated ``input_`` (no communication);
    backward: all-gather the chunks' gradients, so every rank gets the full gradient of ``input_``. Exact when
    ``input_`` is the same on every rank and gradients are taken with respect to that one (replicated) tensor.

    ``rank0_only=True``: forward: scatter the chunks of the group's first rank's ``input_``; other ranks pass a tensor
    of the same shape, dtype and device, whose values are not read (its shape decides nothing the source's does
    not: every rank checks ``seq_lens`` against it, so all raise alike). backward: gather the chunks' gradients to the
    first rank, which gets the full gradient; the other ranks get zeros, the exact gradient of a tensor the output does
    not depend on. Exact with no further assumption.

    A length that does not divide evenly is split as ``torch.tensor_split``
    does: the first ``S % P`` ranks get one more.

    Args:
        input_: The full sequence.
        rank0_only: Take the data from the group's first rank.
        dim: The sequence dim (1 for ``[batch, seq, ...]``).
        mode: The group: a :class:`CommMode` or its string (default ``SEQUENCE_PARALLEL``), a :class:`Communicator` or a
            ``ProcessGroup``.
        seq_lens: Chunk lengths per rank, summing to ``input_.shape[dim]``; ``None`` for the ``tensor_split`` rule.
        legacy_grad_scale: Divide the gradient by the group size P, as the original implementation did. Off by default:
            the factor is exact only when composed with ``gather_from_sequence_parallel_region(...,
            legacy_grad_scale=True)`` and parameter gradients are averaged (not summed) over the group.

    Returns:
        This rank's chunk, a new contiguous tensor; ``input_`` itself with one rank.
    """
    g = resolve_group(mode)
    check_input(input_, g)
    check_flag(rank0_only, "rank0_only")
    check_flag(legacy_grad_scale, "legacy_grad_scale")
    dim = normalize_dim(dim, input_.dim(), "dim")
    sizes = split_sizes(
        input_.shape[dim], g, seq_lens, "seq_lens"
    )  # every rank checks alike: the shapes agree by the rule
    if g.world_size == 1:
        return input_
    scale = 1.0 / g.world_size if legacy_grad_scale else 1.0
    return (_ScatterFromFirst if rank0_only else _Split).apply(input_, g, dim, sizes, scale)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    rank0_only: bool = True,
    *,
    dim: int = 1,
    mode: Any = _SP,
    seq_lens: Sequence[int] | None = None,
    legacy_grad_scale: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` into the full sequence, on every rank.

    forward (both settings): all-gather; chunks may have unequal lengths.

    ``rank0_only=False``: backward: keep this rank's chunk of the gradient. Exact when the gradient arriving at the
    output is replicated: every rank computes the same loss from the (identical) output.

    ``rank0_only=True``: backward: scatter the chunks of the first rank's gradient; the other ranks' gradients are
    ignored. Exact when the loss is the first rank's (what the other ranks compute from the output does not count). When
    every rank computes the same loss both settings agree.

    Args:
        input_: This rank's chunk.
        rank0_only: Take the gradient from the group's first rank.
        dim: The sequence dim.
        mode: The group, as for :func:`scatter_to_sequence_parallel_region`.
        seq_lens: Every rank's chunk length; ``None`` for equal lengths.
        legacy_grad_scale: Multiply the gradient by the group size P, as the original implementation did (see
            :func:`scatter_to_sequence_parallel_region`).

    Returns:
        The full sequence, a new contiguous tensor; ``input_`` itself with one rank.
    """
    g = resolve_group(mode)
    check_input(input_, g)
    check_flag(rank0_only, "rank0_only")
    check_flag(legacy_grad_scale, "legacy_grad_scale")
    dim = normalize_dim(dim, input_.dim(), "dim")
    sizes = local_sizes(input_, dim, g, seq_lens, "seq_lens")
    if g.world_size == 1:
        return input_
    scale = float(g.world_size) if legacy_grad_scale else 1.0
    return (_GatherFirstGrad if rank0_only else _Gather).apply(input_, g, dim, sizes, scale)


def all_gather_from_sequence_parallel_region(
    input_: torch.Tensor, *, dim: int = 1, mode: Any = _SP, seq_lens: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim``, with the gradient summed over the ranks (Megatron's pair).

    forward: all-gather; backward: reduce-scatter (sum) of every rank's
    gradient. Exact when each rank's use of the output is its own term of the loss (the gradient arriving at the output
    is partial, different per rank), as after a tensor-parallel layer. If instead every rank computes the same loss,
    this counts it P times: use :func:`gather_from_sequence_parallel_region`.

    Args:
        input_: This rank's chunk.
        dim: The sequence dim.
        mode: The group, as for :func:`scatter_to_sequence_parallel_region`.
        seq_lens: Every rank's chunk length; ``None`` for equal lengths.

    Returns:
        The full sequence, a new contiguous tensor; ``input_`` itself with one rank.
    """
    g = resolve_group(mode)
    check_input(input_, g)
    dim = normalize_dim(dim, input_.dim(), "dim")
    sizes = local_sizes(input_, dim, g, seq_lens, "seq_lens")
    if g.world_size == 1:
        return input_
    return _AllGather.apply(input_, g, dim, sizes)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, *, dim: int = 1, mode: Any = _SP, seq_lens: Sequence[int] | None = None
) -> torch.Tensor:
    """Sum ``input_`` over the group and keep chunk r along ``dim`` on rank r (Megatron's pair).

    forward: reduce-scatter (sum); backward: all-gather of the chunks'
    gradients. Exact with no assumption: ``input_`` is partial (the value that matters is the sum over ranks), so each
    rank's ``input_`` gets the full gradient of that sum.

    Args:
        input_: Full length along ``dim``, the same shape on every rank.
        dim: The sequence dim.
        mode: The group, as for :func:`scatter_to_sequence_parallel_region`.
        seq_lens: Chunk lengths per rank, summing to ``input_.shape[dim]``; ``None`` for the ``torch.tensor_split``
            rule.

    Returns:
        This rank's chunk of the sum, a new contiguous tensor; ``input_`` itself with one rank.
    """
    g = resolve_group(mode)
    check_input(input_, g)
    dim = normalize_dim(dim, input_.dim(), "dim")
    sizes = split_sizes(input_.shape[dim], g, seq_lens, "seq_lens")
    if g.world_size == 1:
        return input_
    return _ReduceScatter.apply(input_, g, dim, sizes)
