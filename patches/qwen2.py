"""Qwen2 family: ring attention for ``Qwen2Attention`` (``use_sliding_window`` / ``max_window_layers`` decide per layer through ``config.layer_types``: sliding and full layers may mix)."""

from __future__ import annotations

from ..hf_attention import RingConfig
from ._family import FamilyPatch, check_layer_types

__all__ = ["PATCH", "apply_ring_attention_to_qwen2", "revert_ring_attention_from_qwen2"]


def _check(config) -> None:
    check_layer_types(config, "qwen2")


PATCH = FamilyPatch(
    name="qwen2",
    model_types=("qwen2",),
    attention_class="transformers.models.qwen2.modeling_qwen2.Qwen2Attention",
    check_config=_check,
)


def apply_ring_attention_to_qwen2(*, group=None, layout: str = "zigzag", backend: str = "auto", model=None):
    """Register hf_ring attention; with ``model`` (a Qwen2 ``PreTrainedModel``) also switch it to ring attention.

    Returns ``model`` (patched in place), or None when ``model`` is None.
    """
    return PATCH.apply(model, RingConfig(group=group, layout=layout, backend=backend))


def revert_ring_attention_from_qwen2(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention_to_qwen2``."""
    return PATCH.revert(model)
