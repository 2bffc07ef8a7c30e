"""What one tensor-parallel worker of a vLLM engine wants of each checkpoint tensor, derived from vLLM's own model.

For each parameter of the model as vLLM loads it (before its CPU or GPU kernels repack it), the module that owns it says
how the checkpoint's tensors map onto its local shard: a fused ``qkv_proj`` holds this rank's query heads and its K/V
heads (replicated when the model has fewer K/V heads than ranks), a ``gate_up_proj`` the row blocks of gate and up, a
row-parallel weight a column block (its bias whole), a vocabulary-parallel embedding or LM head a row block of the
padded vocabulary; anything else is replicated. :mod:`rlightning_comm.weights.layouts` turns each into the blocks of the
checkpoint tensors the worker wants, and the names come from the model's own ``packed_modules_mapping`` (checked against
its ``hf_to_vllm_mapper`` where it has one).

Imports vLLM: only :mod:`.backend` imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from rlightning_comm.integrations.vllm._views import checkpoint_view
from rlightning_comm.weights import TensorSlice, layouts

Split = Callable[[torch.Tensor], dict[str, TensorSlice]]


@dataclass(frozen=True)
class Entry:
    """One parameter of the model as vLLM loads it: its name, local shape and dtype, and the checkpoint blocks a buffer
    of that shape holds (``split``)."""

    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: Split


class WorkerLayout:
    """Every checkpoint block one worker wants, in the model's order (a layer's tensors together)."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        probe = self.allocate(device="meta")[0]
        self.names = list(probe)
        self.wanted_bytes = sum(s.tensor.numel() * s.tensor.element_size() for s in probe.values())

    def allocate(
        self, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, TensorSlice], list[tuple[str, torch.Tensor]]]:
        """Fresh buffers, one per parameter: the blocks to pass as ``wanted`` to ``reshard_state_dict``, and what vLLM's
        ``load_weights`` is handed for each checkpoint name once they are written (views of the same buffers)."""
        wanted: dict[str, TensorSlice] = {}
        loads: list[tuple[str, torch.Tensor]] = []
        for entry in self.entries:
            buffer = torch.empty(entry.shape, dtype=entry.dtype, device=device)
            for name, block in entry.split(buffer).items():
                if block.tensor.numel() == 0:  # a rank whose vocabulary block is all padding
                    continue
                if name in wanted:
                    raise ValueError(f"checkpoint tensor {name!r} feeds two parameters of the model; expected one")
                wanted[name] = block
                loads.append((name, checkpoint_view(block, name)))
        return wanted, loads


def derive(model: torch.nn.Module) -> WorkerLayout:
    """This worker's layout of ``model`` (vLLM's, on this worker).

    Raises:
        ValueError: a module whose layout is not known (a linear layer of another kind), a fused module missing from
            the model's ``packed_modules_mapping``, or checkpoint names the model's mapper does not map back.
    """
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    entries: list[Entry] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if is_deferred_attention_layer(module):  # its tensors (scales) are not a dense checkpoint's
            continue
        restore = get_layerwise_info(module).restore_metadata[0]  # the parameters as loaded, before any repacking
        live = dict(module.named_parameters(recurse=False))
        for pname in [*restore, *(n for n in live if n not in restore)]:
            if pname in live:
                if id(live[pname]) in seen:  # a tied parameter (lm_head sharing the embedding): loaded once
                    continue
                seen.add(id(live[pname]))
            loaded = restore.get(pname, live.get(pname))
            param = f"{module_name}.{pname}" if module_name else pname
            names = _checkpoint_names(module, module_name, pname, packed)
            if mapper is not None:
                wrong = [n for n in names if mapper.map_name(n) != param]
                if wrong:
                    mapped = [mapper.map_name(n) for n in wrong]
                    raise ValueError(
                        f"the checkpoint names derived for {param!r} ({wrong}) are not mapped back to it by the "
                        f"model's hf_to_vllm_mapper ({mapped}): this model's naming is not supported"
                    )
            entries.append(Entry(param, tuple(loaded.shape), loaded.dtype, _split(module, param, pname, names)))
    return WorkerLayout(entries)


def _checkpoint_names(module: torch.nn.Module, module_name: str, pname: str, packed: dict) -> list[str]:
    """The checkpoint tensors that feed ``module``'s parameter ``pname``: one, or the packed modules' in order."""
    if not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
        return [f"{module_name}.{pname}" if module_name else pname]
    prefix, _, last = module_name.rpartition(".")
    parts = packed.get(last)
    expected = 3 if isinstance(module, QKVParallelLinear) else len(module.output_sizes)
    if parts is None or len(parts) != expected:
        raise ValueError(
            f"{module_name!r} ({type(module).__name__}) fuses {expected} checkpoint tensors, but the model's "
            f"packed_modules_mapping gives {last!r}: {parts}; expected the names of its {expected} parts"
        )
    return [f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}" for part in parts]


def _split(module: torch.nn.Module, param: str, pname: str, names: list[str]) -> Split:
    """How a buffer of ``param``'s local shape holds the checkpoint blocks ``names``."""
    rank, size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
    (name, *_) = names
    if isinstance(module, QKVParallelLinear):
        if module.v_head_size != module.head_size:
            raise ValueError(f"{param!r}: a V head size ({module.v_head_size}) unlike the Q/K one is not supported")
        heads = dict(
            num_heads=module.total_num_heads, num_kv_heads=module.total_num_kv_heads, head_dim=module.head_size
        )
        return lambda t: layouts.qkv(t, rank, size, names=tuple(names), **heads)
    if isinstance(module, MergedColumnParallelLinear):
        sizes = dict(zip(names, module.output_sizes))
        return lambda t: layouts.fused(t, sizes, rank, size)
    if isinstance(module, ColumnParallelLinear):
        return lambda t: {name: layouts.column_parallel(t, rank, size)}
    if isinstance(module, RowParallelLinear):
        if pname == "bias":
            return lambda t: {name: layouts.replicated(t)}
        return lambda t: {name: layouts.row_parallel(t, rank, size)}
    if isinstance(module, VocabParallelEmbedding):
        return _vocab(module, param, name, rank, size)
    if isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
        raise ValueError(f"{param!r}: the layout of {type(module).__name__} is not known to the rlightning backend")
    return lambda t: {name: layouts.replicated(t)}


def _vocab(module: VocabParallelEmbedding, param: str, name: str, rank: int, size: int) -> Split:
    if module.num_added_embeddings:
        raise ValueError(f"{param!r}: a vocabulary with added embeddings (LoRA's) is not supported")
    indices = module.shard_indices

    def split(t: torch.Tensor) -> dict[str, TensorSlice]:
        block = layouts.vocab_parallel(t, rank, size, module.org_vocab_size, padding=module.padding_size)
        mine = (block.offsets[0], block.offsets[0] + block.tensor.shape[0])
        if mine != (indices.org_vocab_start_index, indices.org_vocab_end_index) and block.tensor.numel():
            raise ValueError(
                f"{param!r}: vLLM keeps vocabulary rows {indices.org_vocab_start_index}:{indices.org_vocab_end_index} "
                f"on this rank; the padding layout gives {mine[0]}:{mine[1]}"
            )
        return {name: block}

    return split
