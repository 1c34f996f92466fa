"""Mistral family: ring attention for ``MistralAttention`` (every layer uses ``config.sliding_window`` when it is set)."""

from __future__ import annotations

from ..hf_attention import RingConfig
from ._family import FamilyPatch, check_window

__all__ = ["PATCH", "apply_ring_attention_to_mistral", "revert_ring_attention_from_mistral"]


def _check(config) -> None:
    check_window(config, "mistral")


PATCH = FamilyPatch(
    name="mistral",
    model_types=("mistral",),
    attention_class="transformers.models.mistral.modeling_mistral.MistralAttention",
    check_config=_check,
)


def apply_ring_attention_to_mistral(*, group=None, layout: str = "zigzag", backend: str = "auto", model=None):
    """Register hf_ring attention; with ``model`` (a Mistral ``PreTrainedModel``) also switch it to ring attention.

    Returns ``model`` (patched in place), or None when ``model`` is None.
    """
    return PATCH.apply(model, RingConfig(group=group, layout=layout, backend=backend))


def revert_ring_attention_from_mistral(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention_to_mistral``."""
    return PATCH.revert(model)
