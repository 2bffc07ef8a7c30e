"""Differentiable sequence-parallel communication with exact, documented gradients, uneven lengths and Ulysses
attention."""

from rlightning_comm.sequence_parallel._sizes import sequence_split_sizes
from rlightning_comm.sequence_parallel.ops import (
    all_gather_from_sequence_parallel_region,
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from rlightning_comm.sequence_parallel.ulysses import UlyssesAttention, sdpa_bshd, ulysses_attention

__all__ = [
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
