"""What every weight-sync check returns, and the views both calls compare.

A check returns the problem it finds (an exception type and a message, :data:`Problem`) instead of raising it: the
rounds share each member's verdict with every member, so a problem anywhere raises the same error everywhere before any
weight moves.
"""

from __future__ import annotations

import torch

Problem = tuple[type[Exception], str] | None
"""A problem one member found: the exception type and its message, or ``None``."""


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the very same view: address, dtype, shape, strides, device and conjugate / negative
    bits."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
        and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
    )


def plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values as they read: contiguous, and no lazy conjugate or negation on top."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()
