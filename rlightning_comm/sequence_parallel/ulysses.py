"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, attention on the full sequence, and back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rlightning_comm.modes import CommMode
from rlightning_comm.sequence_parallel._functions import apply_all_to_all
from rlightning_comm.sequence_parallel._resolve import Group, check_input, resolve_group
from rlightning_comm.sequence_parallel._sizes import local_sizes

AttentionFn = Callable[..., torch.Tensor]
_SEQ, _HEADS = 1, 2


def sdpa_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``[batch, seq, heads, head_dim]`` tensors (it wants
    ``[batch, heads, seq, head_dim]``)."""
    return F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **kwargs
    ).transpose(1, 2)


def _check(query: Any, key: Any, value: Any, g: Group) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_input(t, g, name)
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq/P, heads, head_dim] (4 dims); got shape {tuple(t.shape)}")
        if t.shape[_HEADS] % g.world_size:
            raise ValueError(
                f"{name} has {t.shape[_HEADS]} heads, which is not divisible by the group size {g.world_size} "
                f"({g.name}); "
                "Ulysses shards the heads across the group"
            )
    if not query.shape[:2] == key.shape[:2] == value.shape[:2]:
        raise ValueError(
            f"query, key and value must share batch and local sequence length; got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )


def _distinct(tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors (by identity, in first-seen order) and, for each of ``tensors``, its index among them."""
    distinct: list[torch.Tensor] = []
    roles = []
    for t in tensors:
        for i, seen in enumerate(distinct):
            if t is seen:
                roles.append(i)
                break
        else:
            roles.append(len(distinct))
            distinct.append(t)
    return distinct, roles


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_fn: AttentionFn | None = None,
    *,
    mode: Any = CommMode.SEQUENCE_PARALLEL,
    seq_lens: Sequence[int] | None = None,
    **attn_kwargs: Any,
) -> torch.Tensor:
    """Attention over the full sequence on sequence-sharded inputs (DeepSpeed Ulysses).

    ``query``, ``key`` and ``value`` go together through one all-to-all (as :func:`all_to_all` does for one tensor; one
    tensor passed in two roles goes once) from ``[batch, seq/P, heads, head_dim]`` (sequence-sharded, rank r holding
    chunk r of the sequence) to ``[batch, seq, heads/P, head_dim]`` (head-sharded); then ``attn_fn`` runs on the full
    sequence for this rank's heads, and one more all-to-all brings the result back to sequence-sharded. Gradients are
    exact with no assumption (each all-to-all's backward is its inverse), so the result and its gradients equal
    attention on the whole sequence on one rank.

    The function keeps no state between calls: models with different head counts, groups or attention functions can
    share a process.

    Args:
        query: ``[batch, seq/P, heads, head_dim]``.
        key: ``[batch, seq/P, kv_heads, head_dim]`` (``kv_heads`` may be fewer, for grouped-query attention).
        value: ``[batch, seq/P, kv_heads, head_dim_v]``.
        attn_fn: ``attn_fn(q, k, v, **attn_kwargs)`` on head-sharded ``[batch, seq, heads/P, head_dim]`` tensors,
            returning ``[batch, seq, heads/P, head_dim_v]``. Default: :func:`sdpa_bshd`
            (``F.scaled_dot_product_attention`` in that layout). Masks and similar arguments must cover the full
            sequence and this rank's heads.
        mode: The group: a :class:`CommMode` or its string, a :class:`Communicator` or a ``ProcessGroup``.
        seq_lens: Every rank's local sequence length; ``None``: every rank's is this rank's.
        **attn_kwargs: Passed to ``attn_fn`` (e.g. ``is_causal=True``).

    Returns:
        ``[batch, seq/P, heads, head_dim_v]``, sequence-sharded like ``query``.

    Raises:
        ValueError: not 4-dim, head counts not divisible by the group size, or query/key/value disagree on batch or
            local length.
    """
    fn = sdpa_bshd if attn_fn is None else attn_fn
    if not callable(fn):
        raise TypeError(f"attn_fn must be callable; got {type(fn).__name__}")
    g = resolve_group(mode)
    _check(query, key, value, g)
    lens = local_sizes(query, _SEQ, g, seq_lens, "seq_lens")
    if g.world_size == 1:
        return fn(query, key, value, **attn_kwargs)
    ws = g.world_size
    # A tensor in two roles (self-attention's q, q, q; a shared key and value) travels once and its output serves every
    # role, so autograd adds up its gradients (and dynamo, which refuses one tensor twice in an autograd.Function's
    # inputs, compiles it).
    sent, roles = _distinct((query, key, value))
    even = [[t.shape[_HEADS] // ws] * ws for t in sent]
    if (
        query.dtype == key.dtype == value.dtype and query.device == key.device == value.device
    ):  # one buffer, one collective for all
        heads = apply_all_to_all(g, _HEADS, even, _SEQ, [lens] * len(sent), *sent)
    else:
        heads = [apply_all_to_all(g, _HEADS, [e], _SEQ, [lens], t)[0] for t, e in zip(sent, even)]
    out = fn(*(heads[r] for r in roles), **attn_kwargs)
    expected = (query.shape[0], sum(lens), query.shape[_HEADS] // ws)
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or tuple(out.shape[:3]) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"attn_fn must return [batch, seq, heads/P, head_dim_v] with leading dims {expected}; got {got}"
        )
    # Every rank checked the same shapes, so all ranks raise alike and none is left in a collective.
    (back,) = apply_all_to_all(g, _SEQ, [lens], _HEADS, [[out.shape[_HEADS]] * ws], out)
    return back


class UlyssesAttention(torch.nn.Module):
    """:func:`ulysses_attention` as a module, holding its attention function and group (no parameters).

    Args:
        attn_fn: As for :func:`ulysses_attention`; ``None`` for :func:`sdpa_bshd`.
        mode: The group.
    """

    def __init__(self, attn_fn: AttentionFn | None = None, *, mode: Any = CommMode.SEQUENCE_PARALLEL) -> None:
        super().__init__()
        self.attn_fn = attn_fn
        self.mode = mode

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        seq_lens: Sequence[int] | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        """Run :func:`ulysses_attention` with this module's function and group."""
        return ulysses_attention(query, key, value, self.attn_fn, mode=self.mode, seq_lens=seq_lens, **attn_kwargs)
