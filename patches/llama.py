"""Llama family: ring attention for ``LlamaAttention`` (causal full attention in every layer; nothing family-specific beyond GQA and scaling)."""

from __future__ import annotations

from ..hf_attention import RingConfig
from ._family import FamilyPatch

__all__ = ["PATCH", "apply_ring_attention_to_llama", "revert_ring_attention_from_llama"]


PATCH = FamilyPatch(
    name="llama",
    # and checkpoints that load Llama's classes under a model type of their own (EXAONE 3.x, InternLM3, IQuest-Coder)
    model_types=("llama", "exaone", "internlm3", "iquestcoder"),
    attention_class="transformers.models.llama.modeling_llama.LlamaAttention",
)


def apply_ring_attention_to_llama(*, group=None, layout: str = "zigzag", backend: str = "auto", model=None):
    """Register hf_ring attention; with ``model`` (a Llama ``PreTrainedModel``) also switch it to ring attention.

    Returns ``model`` (patched in place), or None when ``model`` is None.
    """
    return PATCH.apply(model, RingConfig(group=group, layout=layout, backend=backend))


def revert_ring_attention_from_llama(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention_to_llama``."""
    return PATCH.revert(model)
