"""What vLLM's layer-by-layer reload leaves to its caller: a tied LM head's packed weight, and a warning that reads as a
failed sync.

vLLM 0.32 processes a layer (fuses, repacks) once all of its checkpoint tensors have arrived. On its CPU build that
processing of an LM head (``UnquantizedEmbeddingMethod.process_weights_after_loading``) packs a copy of the weight for
the head's matrix product (a oneDNN handle or an AMX-packed tensor, held by the layer's ``cpu_linear``). A head tied to
the input embeddings (``tie_word_embeddings``: Qwen2.5 up to 3B, Llama 3.2, Gemma) shares the embedding's parameter,
and the checkpoint names that parameter once, under the embedding: the reload writes the new values into it through the
embedding layer, which it processes, and finds nothing loaded for the head, so it puts the head's tensors back as they
were ("ParallelLMHead: Failed to load weights") and never packs its weight again. The head then computes the logits
with the previous version's packed copy, silently: the same happens with vLLM's own ``reload_weights`` on whole tensors
(a bug of vLLM's reload; its load from disk packs after loading and is exact). :func:`reloading` packs the tied heads
again from the parameter they share, once the reload is done: what the reload does for an untied head.

The reload also warns ``"RotaryEmbedding: Failed to load weights"`` on every worker at every reload: a rotary embedding
holds only its cos/sin cache, a non-persistent buffer computed from the config that no checkpoint holds, which the
reload counts as a tensor to load and then puts back unchanged. :func:`reloading` drops that warning for the layers
that hold no checkpoint tensor (and for the tied heads it packs again); the warning for any other layer still shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

# The logger of vLLM's vllm/model_executor/model_loader/reload/layerwise.py (vLLM names its loggers by module).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED = "%s: Failed to load weights"


def tied_heads(model: torch.nn.Module) -> list[ParallelLMHead]:
    """The LM heads that compute with a packed copy (``cpu_linear``: vLLM's CPU build) of a parameter another layer
    also holds (the input embeddings')."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [
        module
        for module in model.modules()
        if isinstance(module, ParallelLMHead)
        and hasattr(module, "cpu_linear")
        and any(owners[id(p)] > 1 for p in module.parameters(recurse=False))
    ]


class _Expected(logging.Filter):
    """Drops vLLM's "Failed to load weights" for the layers named."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == FAILED and args[:1] and args[0] in self.names)


def _expected_failures(model: torch.nn.Module, heads: list[ParallelLMHead]) -> set[str]:
    """Class names of the layers the reload finds nothing to load for, rightly: those whose every tensor is a
    non-persistent buffer (no checkpoint holds one), and the tied heads."""
    names = {type(m).__name__ for m in heads}
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            continue
        buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None]
        if buffers and all(n in module._non_persistent_buffers_set for n in buffers):
            names.add(type(module).__name__)
    return names


@contextmanager
def reloading(model: torch.nn.Module) -> Iterator[None]:
    """Around one reload of ``model`` (vLLM's ``reload_weights``, or its ``initialize_layerwise_reload`` to
    ``finalize_layerwise_reload``): drops the reload's warning for the layers that have nothing to load, and afterwards
    packs again every tied head that the reload did not process (its ``cpu_linear`` is still the one from before: the
    checkpoint named the shared tensor only under the embedding), whether or not the reload raised (the head then
    computes with what the embedding holds). A head the reload did process (the tensor sent under the head's name too)
    is not packed twice."""
    heads = {head: head.cpu_linear for head in tied_heads(model)}
    quiet = _Expected(_expected_failures(model, list(heads)))
    log = logging.getLogger(RELOAD_LOGGER)
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)
        with torch.no_grad():
            for head, before in heads.items():
                if head.cpu_linear is before:  # held above, so a new callable cannot be this one
                    head.quant_method.process_weights_after_loading(head)
