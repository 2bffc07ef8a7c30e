"""Local checks of a communicator's arguments, made before any collective starts.

A bad argument raises here, on the rank that passed it, instead of reaching the backend (where it could hang the peers
or fail obscurely). Each collective ``op`` has one ``_check_<op>`` method taking the public method's
parameters: it runs every local check the op makes, never communicates and
changes nothing. Debug mode calls them before its fingerprint exchange.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp

_Tensor = torch.Tensor
_SUM = ReduceOp.SUM
_compiling = torch.compiler.is_dynamo_compiling
_AVG = ReduceOp.AVG
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
# torch views a complex tensor as real pairs, which is only exact for these ops.
_COMPLEX_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG})


def reduce_op_type(op: Any) -> Any:
    """``ReduceOp(ReduceOp.MAX)`` as ``ReduceOp.MAX``: torch takes both, the option tables are keyed by the second."""
    return op.op if type(op) is ReduceOp else op


def launched_op(op: Any, dtype: torch.dtype) -> Any:
    """The op to launch for ``op`` on ``dtype``: a bool SUM runs as MAX, a logical or.

    torch's NCCL backend does the same; gloo would add the bytes and leave bools that are neither ``True`` nor ``False``
    (a byte 2 compares unequal to both).
    """
    op = reduce_op_type(op)
    return ReduceOp.MAX if op is ReduceOp.SUM and dtype is torch.bool else op


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Two CPU tensors without building a torch.device per read (this is on every call's path).
    return (a.is_cpu and b.is_cpu) or a.device == b.device


class InputChecks:
    """Mixin of :class:`Communicator`: the checks every collective runs on its arguments."""

    _mode: str
    _world_size: int
    _global_rank: int
    _group_rank_of: dict[int, int]
    _ranks: tuple[int, ...]
    on_device: Callable[[torch.Tensor, torch.Tensor], bool]  # the backend's fast device test (Communicator.on_device)
    supported_reduce_ops: ClassVar[frozenset[Any]]
    integer_avg_supported: ClassVar[bool]
    supported_dtypes: ClassVar[frozenset[torch.dtype] | None]
    # check_device(tensor, name) is the backend's part, declared abstract on Communicator.

    # ------------------------------------------------------------ primitives
    def _check_tensor(self, tensor: Any, name: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__} (mode {self._mode!r})")
        if tensor.is_nested:
            raise ValueError(
                f"{name} is a nested tensor; {type(self).__name__} (mode {self._mode!r}) takes dense, contiguous "
                "tensors. "
                "Hint: pass its values as one dense tensor (t.values() of a jagged tensor, torch.cat([x.flatten() for "
                "x in t.unbind()]) otherwise)"
            )
        try:
            contiguous = tensor.is_contiguous()
        except RuntimeError:  # sparse compressed layouts have no strides at all
            contiguous = False
        if not contiguous:
            self._refuse_layout(tensor, name)
        if not _compiling() and (tensor.is_conj() or tensor.is_neg()):  # dynamo traces neither
            kind, fix = ("conjugate", "resolve_conj") if tensor.is_conj() else ("negative", "resolve_neg")
            raise ValueError(
                f"{name} is a {kind} view, whose memory holds the values before the {kind} bit is applied; "
                f"{type(self).__name__} "
                f"(mode {self._mode!r}) moves memory as it is, so expected a tensor without the bit. Hint: pass "
                f"t.{fix}() (a copy) and copy the result back"
            )
        self.check_device(tensor, name)
        dtypes = self.supported_dtypes
        if dtypes is not None and tensor.dtype not in dtypes:
            self._refuse_dtype(tensor.dtype, name)

    def _refuse_dtype(self, dtype: torch.dtype, name: str) -> None:
        moves = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.supported_dtypes or ()))
        raise ValueError(
            f"{name} is {dtype}, which {type(self).__name__} (mode {self._mode!r}) cannot move; expected one of: "
            f"{moves}. "
            "Hint: cast it (for example t.to(torch.int64)) and cast the result back"
        )

    def _refuse_layout(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.layout != torch.strided:
            raise ValueError(
                f"{name} is a sparse tensor (layout {tensor.layout}); {type(self).__name__} (mode {self._mode!r}) "
                "takes dense, contiguous tensors. "
                "Hint: pass t.to_dense()"
            )
        raise ValueError(
            f"{name} must be contiguous; got a tensor of shape {tuple(tensor.shape)} with stride {tensor.stride()} "
            f"(mode {self._mode!r}). Hint: pass t.contiguous() and copy the result back into your view"
        )

    def _check_like(self, tensor: Any, ref: torch.Tensor, name: str) -> None:
        self._check_tensor(tensor, name)
        if tensor.dtype != ref.dtype or tensor.shape != ref.shape or not same_device(tensor, ref):
            raise ValueError(
                f"{name} must match the tensor argument: expected shape {tuple(ref.shape)}, {ref.dtype} on "
                f"{ref.device}; "
                f"got shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device} (mode {self._mode!r})"
            )

    def _check_list(self, tensors: Any, ref: torch.Tensor, name: str) -> None:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{name} must be a list of {self._world_size} tensors; got {type(tensors).__name__} (mode "
                f"{self._mode!r})"
            )
        if len(tensors) != self._world_size:
            raise ValueError(
                f"{name} must hold one tensor per rank: expected {self._world_size}; got {len(tensors)} (mode "
                f"{self._mode!r})"
            )
        for i, t in enumerate(tensors):
            self._check_like(t, ref, f"{name}[{i}]")

    def _check_peer(self, rank: Any, name: str) -> None:
        if type(rank) is int and rank in self._group_rank_of:
            return
        expected = list(self._ranks)
        if isinstance(rank, bool) or not hasattr(type(rank), "__index__"):
            raise TypeError(
                f"{name}={rank!r} is not a global rank of mode {self._mode!r}: expected an int, one of {expected}; got "
                f"{type(rank).__name__}"
            )
        if operator.index(rank) not in self._group_rank_of:
            raise ValueError(f"{name}={rank!r} is not a global rank of mode {self._mode!r}; expected one of {expected}")

    def _check_reduction(self, op: Any, dtype: torch.dtype) -> None:
        """The checks of a reducing op (``op`` on ``dtype``), whatever the op: SUM too."""
        op = reduce_op_type(op)
        if op is not _SUM:
            self._check_reduce_op(op, dtype)
        if dtype in self._unreducible_dtypes():
            raise ValueError(
                f"{type(self).__name__} (mode {self._mode!r}) cannot reduce {dtype} tensors (the backend has no such "
                "reduction); "
                "expected another dtype. Hint: reduce a copy in a wider dtype (t.float()); moving this dtype "
                "(broadcast, all_gather) works"
            )

    def _unreducible_dtypes(self) -> frozenset[torch.dtype]:
        """Dtypes the backend moves but cannot reduce (none by default)."""
        return frozenset()

    def _check_reduce_op(self, op: Any, dtype: torch.dtype) -> None:
        op = reduce_op_type(op)
        if op is _SUM:
            return
        if op is ReduceOp.PREMUL_SUM:
            raise ValueError(
                f"reduce op PREMUL_SUM (torch's _make_nccl_premul_sum) is not supported by {type(self).__name__} (mode "
                f"{self._mode!r}); "
                "expected SUM, AVG, PRODUCT, MIN or MAX. Hint: scale the tensor first (t.mul_(factor)), then reduce "
                "with SUM"
            )
        if op not in self.supported_reduce_ops:
            supported = sorted(str(o).rsplit(".", 1)[-1] for o in self.supported_reduce_ops)
            raise ValueError(
                f"reduce op {op!r} is not supported by {type(self).__name__} (mode {self._mode!r}); supported: "
                f"{supported}"
            )
        if dtype.is_complex:
            if op not in _COMPLEX_OPS:
                raise ValueError(
                    f"reduce op {op!r} is not defined on complex tensors ({dtype}, mode {self._mode!r}); expected SUM "
                    "or AVG"
                )
        elif op in _BITWISE:
            if dtype.is_floating_point:
                raise ValueError(
                    f"bitwise reduce op {op!r} needs an integer or bool tensor; got {dtype} (mode {self._mode!r})"
                )
        elif op is _AVG and (dtype is torch.bool or (not dtype.is_floating_point and not self.integer_avg_supported)):
            raise ValueError(
                f"reduce op AVG needs a floating-point tensor with {type(self).__name__}; got {dtype} (mode "
                f"{self._mode!r})"
            )

    def _check_rooted(self, name: str, tensor: Any, tensors: Any, root_name: str, root: Any) -> None:
        on_device = self.on_device
        try:  # the common case in C-level reads (a cold call pays for each frame); anything else gets the checks below
            if (
                type(root) is int
                and root in self._group_rank_of
                and isinstance(tensor, _Tensor)
                and on_device(tensor, tensor)
                and tensor.is_contiguous()
                and not tensor.is_complex()
                and not tensor.is_nested
                and (_compiling() or not tensor.is_neg())  # dynamo cannot trace is_neg
            ):
                if self._global_rank != root:
                    return
                if type(tensors) is list and len(tensors) == self._world_size:
                    dtype, shape = tensor.dtype, tensor.shape
                    for t in tensors:
                        if not (
                            isinstance(t, _Tensor)
                            and t.dtype is dtype
                            and on_device(t, tensor)
                            and t.is_contiguous()
                            and not t.is_nested
                            and (_compiling() or not t.is_neg())
                            and t.shape == shape
                        ):
                            break
                    else:
                        return
        except RuntimeError:  # a sparse compressed tensor raises in is_contiguous
            pass
        self._check_tensor(tensor, "tensor")
        self._check_peer(root, root_name)
        if self._global_rank == root:
            self._check_list(tensors, tensor, f"{name}_list")

    def _check_splits(self, sizes: Any, t: torch.Tensor, name: str, tensor_name: str) -> None:
        ws = self._world_size
        if sizes is None:
            if t.dim() == 0 or t.shape[0] % ws:
                raise ValueError(
                    f"dim 0 of a tensor split evenly must be divisible by the group size {ws}; got {tensor_name} of "
                    f"shape {tuple(t.shape)} (mode {self._mode!r})"
                )
            return
        if not isinstance(sizes, (list, tuple)):
            raise TypeError(
                f"{name} must be a list of {ws} ints (or None for an even split); got {type(sizes).__name__} {sizes!r} "
                f"(mode {self._mode!r})"
            )
        if t.dim() == 0:
            raise ValueError(
                f"{name} splits dim 0, so {tensor_name} needs at least one dimension; got a 0-d tensor (mode "
                f"{self._mode!r})"
            )
        if len(sizes) != ws or not all(type(n) is int and n >= 0 for n in sizes) or sum(sizes) != t.shape[0]:
            raise ValueError(
                f"{name} must have {ws} entries summing to dim 0 = {t.shape[0]} of {tensor_name}, each a non-negative "
                f"int; got {list(sizes)} (mode {self._mode!r})"
            )
