"""What one bench run measures: the validated configuration, size and dtype parsing."""

from __future__ import annotations

import re

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

OPS = (
    "all_reduce",
    "all_gather",
    "broadcast",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "all_reduce_dict",
    "broadcast_object_list",
    "barrier",
)
"""The ops the bench measures, in the order it runs them."""

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGB]?)\s*$", re.IGNORECASE)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
"""Accepted ``--dtype`` names (torch names and the usual aliases)."""


def parse_size(text: str) -> int:
    """Parse ``"64"``, ``"64B"``, ``"1K"``, ``"16M"``, ``"1G"`` (binary multiples, as nccl-tests) into bytes.

    Raises:
        ValueError: not a positive size with an optional K/M/G suffix.
    """
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional K, M or G suffix (e.g. 4, 1K, 64M)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return value


def parse_sizes(text: str, factor: int = 2) -> tuple[int, ...]:
    """Parse ``--sizes``: a range ``"MIN:MAX"`` (MIN, MIN*factor, ... up to MAX), a list ``"1K,4M"`` or one size.

    Raises:
        ValueError: a bad size, MIN > MAX, or ``factor`` < 2 with a range.
    """
    text = str(text).strip()
    if ":" in text:
        low_text, _, high_text = text.partition(":")
        low, high = parse_size(low_text), parse_size(high_text)
        if low > high:
            raise ValueError(f"sizes range {text!r} goes down: {low} > {high} bytes; expected MIN:MAX with MIN <= MAX")
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
            raise ValueError(f"factor must be an int >= 2 to step through a range; got {factor!r}")
        sizes = [low]
        while sizes[-1] * factor <= high:
            sizes.append(sizes[-1] * factor)
        return tuple(sizes)
    return tuple(parse_size(part) for part in text.split(","))


def parse_ops(text: str) -> tuple[str, ...]:
    """Parse ``--ops``: ``"all"`` or a comma-separated subset of :data:`OPS` (run in :data:`OPS` order).

    Raises:
        ValueError: an unknown op; the message lists the known ones.
    """
    names = [p.strip() for p in str(text).split(",") if p.strip()]
    if names == ["all"]:
        return OPS
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise ValueError(
            f"unknown op(s) {unknown or names!r}; expected 'all' or a comma-separated subset of {list(OPS)}"
        )
    return tuple(op for op in OPS if op in names)


class BenchConfig(BaseModel):
    """Everything every rank needs to run the same sweep."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sizes: tuple[int, ...] = Field(min_length=1)
    """Sizes ``S`` in bytes (the nccl-tests size of each op: see :mod:`rlightning_comm.bandwidth`)."""
    ops: tuple[str, ...] = Field(min_length=1)
    """Ops to run, a subset of :data:`OPS`."""
    backend: str = "gloo"
    """Name of a registered communicator."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``: where the tensors live."""
    mode: str = Field(default="GLOBAL", min_length=1)
    """The mode the collectives run on; any mode other than GLOBAL is bound to groups of ``group_size``."""
    group_size: int | None = Field(default=None, ge=1)
    """Ranks per group of ``mode`` (consecutive global ranks); ``None`` means the whole world."""
    dtype: str = "float32"
    """A key of :data:`DTYPES`."""
    iters: int = Field(default=20, ge=1)
    """Timed calls per size and path."""
    warmup: int = Field(default=5, ge=0)
    """Untimed calls per size and path before the timed ones (checked all the same)."""
    repeat: int = Field(default=1, ge=1)
    """Independent measurements of each row; the overhead column gives their median and spread (noise against cost)."""
    dict_keys: int = Field(default=64, ge=1)
    """Keys of the all_reduce_dict payload (fewer when the size has fewer elements)."""
    timeout: float = Field(default=300.0, gt=0)
    """Timeout of each collective, in seconds."""
    json_path: str | None = None
    """Where rank 0 writes every figure as JSON."""
    plot_path: str | None = None
    """Where rank 0 draws busbw against size (needs matplotlib)."""
    inject_wrong: str | None = None
    """Test hook: corrupt this op's results on the library path after each call, to exercise the checks."""
    argv: tuple[str, ...] = ()
    """The command line, recorded in the JSON."""

    @field_validator("ops")
    @classmethod
    def _known_ops(cls, ops: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [op for op in ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; expected a subset of {list(OPS)}")
        return ops

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str) -> str:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return dtype

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by :attr:`dtype`."""
        return DTYPES[self.dtype]
