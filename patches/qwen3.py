"""Qwen3 family: ring attention for ``Qwen3Attention`` (``config.layer_types`` says per layer whether it slides; q/k norms run before attention and need nothing here)."""

from __future__ import annotations

from ..hf_attention import RingConfig
from ._family import FamilyPatch, check_layer_types

__all__ = ["PATCH", "apply_ring_attention_to_qwen3", "revert_ring_attention_from_qwen3"]


def _check(config) -> None:
    check_layer_types(config, "qwen3")


PATCH = FamilyPatch(
    name="qwen3",
    model_types=("qwen3",),
    attention_class="transformers.models.qwen3.modeling_qwen3.Qwen3Attention",
    check_config=_check,
)


def apply_ring_attention_to_qwen3(*, group=None, layout: str = "zigzag", backend: str = "auto", model=None):
    """Register hf_ring attention; with ``model`` (a Qwen3 ``PreTrainedModel``) also switch it to ring attention.

    Returns ``model`` (patched in place), or None when ``model`` is None.
    """
    return PATCH.apply(model, RingConfig(group=group, layout=layout, backend=backend))


def revert_ring_attention_from_qwen3(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention_to_qwen3``."""
    return PATCH.revert(model)
