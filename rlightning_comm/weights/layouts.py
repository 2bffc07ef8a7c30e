"""The blocks of common tensor-parallel engine layouts, as :class:`TensorSlice` for ``reshard_state_dict``.

Each helper takes the engine's own local parameter (or a view of it) and the rank's place in its tensor-parallel group,
and says which block of which global tensor it is, so no caller writes index arithmetic. The layouts are those of vLLM's
and SGLang's linear layers: column-parallel (output rows split), row-parallel (input columns split), merged
column-parallel (gate and up in one), the fused q/k/v projection, whose K/V heads are replicated when the model has
fewer K/V heads than tensor-parallel ranks, and the vocabulary-parallel embedding and LM head, whose vocabulary is
padded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlightning_comm.weights.reshard._slices import TensorSlice

__all__ = ["column_parallel", "fused", "qkv", "replicated", "row_parallel", "vocab_parallel"]


def _check(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")


def _sharded(tensor: torch.Tensor, dim: int, rank: int, world_size: int, at: int = 0) -> TensorSlice:
    """``tensor`` as rank ``rank``'s equal shard along ``dim`` of a global tensor ``world_size`` times as large."""
    _check(rank, world_size)
    if tensor.dim() <= dim:
        raise ValueError(
            f"a shard along dimension {dim} needs a tensor of at least {dim + 1} dimensions; "
            f"got shape {tuple(tensor.shape)}"
        )
    offsets = [0] * tensor.dim()
    offsets[dim] = at + rank * tensor.shape[dim]
    shape = list(tensor.shape)
    shape[dim] = tensor.shape[dim] * world_size
    return TensorSlice(tensor, tuple(offsets), tuple(shape))


def replicated(tensor: torch.Tensor) -> TensorSlice:
    """``tensor`` is the whole global tensor (a replicated parameter: a norm's weight, a row-parallel bias)."""
    return TensorSlice(tensor, (0,) * tensor.dim(), tuple(tensor.shape))


def column_parallel(tensor: torch.Tensor, rank: int, world_size: int) -> TensorSlice:
    """Rank ``rank`` of ``world_size``'s shard of a column-parallel weight or bias (output rows split in equal
    blocks, dimension 0; also a vocabulary-parallel embedding).

    Args:
        tensor: The local parameter, ``global_rows / world_size`` rows.
        rank: This rank in the tensor-parallel group.
        world_size: The tensor-parallel group's size.
    """
    return _sharded(tensor, 0, rank, world_size)


def row_parallel(tensor: torch.Tensor, rank: int, world_size: int) -> TensorSlice:
    """Rank ``rank`` of ``world_size``'s shard of a row-parallel weight (input columns split in equal blocks,
    dimension 1). Its bias is not split: :func:`replicated`.

    Args:
        tensor: The local weight, ``[out_features, in_features / world_size]``.
        rank: This rank in the tensor-parallel group.
        world_size: The tensor-parallel group's size.
    """
    return _sharded(tensor, 1, rank, world_size)


def vocab_parallel(
    tensor: torch.Tensor, rank: int, world_size: int, num_embeddings: int, *, padding: int = 64
) -> TensorSlice:
    """Rank ``rank`` of ``world_size``'s rows of a vocabulary-parallel embedding or LM head whose vocabulary is padded,
    as vLLM's ``VocabParallelEmbedding`` and ``ParallelLMHead`` lay it out.

    The vocabulary of ``num_embeddings`` rows is padded to a multiple of ``padding`` and split in equal row blocks; a
    rank's block ends with the padding rows past the vocabulary, which belong to no global tensor (the engine fills
    them). The slice is the block's rows that are real: all of them on the first ranks, fewer (or none) on the last.

    Args:
        tensor: The local parameter, ``padded / world_size`` rows.
        rank: This rank in the tensor-parallel group.
        world_size: The tensor-parallel group's size.
        num_embeddings: Rows of the global tensor (the vocabulary, unpadded).
        padding: The multiple the vocabulary is padded to (vLLM's default is 64).

    Returns:
        The slice of ``tensor`` that holds global rows (a view, written in place; zero rows on a rank that holds only
        padding).

    Raises:
        ValueError: a padded vocabulary not divisible by ``world_size``, or ``tensor``'s rows are not a block of it.
    """
    _check(rank, world_size)
    for label, value in (("num_embeddings", num_embeddings), ("padding", padding)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int; got {value!r}")
    padded = -(-num_embeddings // padding) * padding
    if padded % world_size:
        raise ValueError(
            f"the vocabulary of {num_embeddings} padded to {padded} (a multiple of {padding}) is not divisible by the "
            f"tensor-parallel size {world_size}"
        )
    rows = padded // world_size
    if tensor.dim() < 1 or tensor.shape[0] != rows:
        raise ValueError(
            f"the vocabulary-parallel parameter has shape {tuple(tensor.shape)}; expected {rows} rows here (a "
            f"vocabulary of {num_embeddings} padded to {padded}, split {world_size} ways)"
        )
    start = min(rank * rows, num_embeddings)
    real = min(rows, num_embeddings - start)
    return TensorSlice(
        tensor.narrow(0, 0, real), (start,) + (0,) * (tensor.dim() - 1), (num_embeddings, *tensor.shape[1:])
    )


def fused(tensor: torch.Tensor, sizes: Mapping[str, int], rank: int, world_size: int) -> dict[str, TensorSlice]:
    """The global tensors a merged column-parallel parameter holds (gate and up in one ``gate_up_proj``): each of
    ``sizes`` split in equal row blocks, rank ``rank``'s blocks stacked in the order of ``sizes``.

    Args:
        tensor: The local fused parameter (weight or bias), ``sum(sizes) / world_size`` rows.
        sizes: Each global tensor's name and number of rows (output features), in the fused order:
            ``{"mlp.gate_proj.weight": 1024, "mlp.up_proj.weight": 1024}``.
        rank: This rank in the tensor-parallel group.
        world_size: The tensor-parallel group's size.

    Returns:
        Per name, the slice of ``tensor`` that holds its rows (a view, written in place).

    Raises:
        ValueError: a size not divisible by ``world_size``, or ``tensor``'s rows are not their sum.
    """
    _check(rank, world_size)
    rows = {}
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"{name!r} has {size} rows, not divisible by the tensor-parallel size {world_size}")
        rows[name] = size // world_size
    return _stack(tensor, [(name, n, rank * n, n * world_size) for name, n in rows.items()])


def _stack(tensor: torch.Tensor, parts: Sequence[tuple[str, int, int, int]]) -> dict[str, TensorSlice]:
    """``parts``: (name, local rows, global row offset, global rows) stacked along dimension 0 of ``tensor``."""
    total = sum(p[1] for p in parts)
    if tensor.dim() < 1 or tensor.shape[0] != total:
        raise ValueError(
            f"the fused parameter has shape {tuple(tensor.shape)}; expected {total} rows here "
            f"({', '.join(f'{name}: {n}' for name, n, _, _ in parts)})"
        )
    out, at = {}, 0
    for name, n, offset, rows in parts:
        out[name] = TensorSlice(
            tensor.narrow(0, at, n), (offset,) + (0,) * (tensor.dim() - 1), (rows, *tensor.shape[1:])
        )
        at += n
    return out


def qkv(
    tensor: torch.Tensor,
    rank: int,
    world_size: int,
    *,
    names: tuple[str, str, str],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, TensorSlice]:
    """The q, k and v tensors a fused ``qkv_proj`` parameter (weight or bias) holds on rank ``rank`` of
    ``world_size``, as vLLM's ``QKVParallelLinear`` lays them out.

    Each rank holds ``num_heads / world_size`` query heads. With at least as many K/V heads as ranks each holds
    ``num_kv_heads / world_size`` of them; with fewer, each K/V head is replicated on ``world_size / num_kv_heads``
    consecutive ranks (rank ``r`` holds head ``r // (world_size / num_kv_heads)``), and every replica is written.

    Args:
        tensor: The local fused parameter: its rows are this rank's q rows, then its k rows, then its v rows.
        rank: This rank in the tensor-parallel group.
        world_size: The tensor-parallel group's size.
        names: The global tensors' names: ``(q, k, v)``.
        num_heads: Query heads of the model.
        num_kv_heads: Key/value heads of the model.
        head_dim: Elements per head.

    Returns:
        Per name, the slice of ``tensor`` that holds its rows (a view, written in place).

    Raises:
        ValueError: head counts that do not divide (or are not divided by) ``world_size``, or ``tensor``'s rows.
    """
    _check(rank, world_size)
    if num_heads % world_size:
        raise ValueError(f"num_heads={num_heads} is not divisible by the tensor-parallel size {world_size}")
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by the tensor-parallel size {world_size}")
        kv_heads, first_kv = num_kv_heads // world_size, rank * (num_kv_heads // world_size)
    else:
        if world_size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size {world_size} is not divisible by num_kv_heads={num_kv_heads}")
        kv_heads, first_kv = 1, rank // (world_size // num_kv_heads)
    q_rows, kv_rows = num_heads // world_size * head_dim, kv_heads * head_dim
    q, k, v = names
    return _stack(
        tensor,
        [
            (q, q_rows, rank * q_rows, num_heads * head_dim),
            (k, kv_rows, first_kv * head_dim, num_kv_heads * head_dim),
            (v, kv_rows, first_kv * head_dim, num_kv_heads * head_dim),
        ],
    )
