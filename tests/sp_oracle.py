"""Helpers for the sequence-parallel tests: seeded data every rank can rebuild, and error bookkeeping.

The oracle in every test is plain single-process torch (slicing, cat and autograd on the full tensor), never the
library's own code.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TOL = 1e-10
SP = "SEQUENCE_PARALLEL"


def init_sp(rank: int, size: int, url: str, partition: list[list[int]] | None = None, mode: str = SP) -> Any:
    """Initialise the world and bind ``mode`` (the whole world unless ``partition`` is given)."""
    from world import init_world

    ctx = init_world(rank, size, url)
    ctx.init_group(partition or list(range(size)), mode)
    return ctx


def data(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Float64 normals, the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def with_dim(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def rel_err(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Relative error in the 2-norm (absolute when ``want`` is zero); inf on a shape mismatch or a missing tensor."""
    if got is None or got.shape != want.shape:
        return math.inf
    diff = (got.detach() - want.detach()).norm().item()
    ref = want.norm().item()
    return diff / ref if ref > 0 else diff


class Checks:
    """Named errors collected in a worker and sent back as a plain dict; the parent asserts they are within TOL."""

    def __init__(self, prefix: str = "") -> None:
        self.errors: dict[str, float] = {}
        self.prefix = prefix

    def close(self, name: str, got: torch.Tensor | None, want: torch.Tensor) -> None:
        key = self.prefix + name
        self.errors[key] = max(self.errors.get(key, 0.0), rel_err(got, want))

    def equal(self, name: str, got: torch.Tensor | None, want: torch.Tensor) -> None:
        ok = got is not None and got.shape == want.shape and torch.equal(got.detach(), want.detach())
        self.errors[self.prefix + name] = 0.0 if ok else math.inf

    def true(self, name: str, ok: bool) -> None:
        self.errors[self.prefix + name] = 0.0 if ok else math.inf


def assert_all_within(results: list[dict[str, float]], tol: float = TOL) -> None:
    """Fail with every check, on every rank, whose error is above ``tol`` (or NaN); fail also when nothing was
    checked."""
    bad = [
        f"rank {r}: {name}: {err:.3g}"
        for r, errs in enumerate(results)
        for name, err in sorted(errs.items())
        if not err <= tol
    ]
    assert all(results), "a rank ran no checks"
    assert not bad, "checks above tolerance:\n" + "\n".join(bad)
